"""Start-up failures as one line: ``specsplit: <what>: <why>``.

Owns: ``StartupError`` (raised by the serving plumbing with what failed and
why: the listen port, TLS material, the bind policy, the admin token file,
the start-up weights) and ``describe``, which turns any exception that ends
a service's start into the (what, why) pair the CLI prints before exiting 2
— configuration errors, missing files, ports in use, checkpoint roots that
exclude the start-up model, a backend package that is not installed.

Must not know: the services. The CLI decides about exit codes and tracebacks.
"""

from __future__ import annotations

import errno


class StartupError(Exception):
    """A service cannot start; ``what`` failed because of ``why``."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")
        self.what, self.why = what, why


_BACKEND_MODULES = {"paddle": "paddlepaddle", "torch": "torch"}


def describe(exc: BaseException) -> tuple[str, str]:
    """(what, why) of an exception that stopped a service from starting."""
    from core.config import ConfigError

    if isinstance(exc, StartupError):
        return exc.what, exc.why
    if isinstance(exc, ConfigError):
        return "configuration error", str(exc)
    if isinstance(exc, ModuleNotFoundError):
        name = (exc.name or "").split(".")[0]
        package = _BACKEND_MODULES.get(name, name)
        what = "backend" if name in _BACKEND_MODULES else "missing package"
        return what, f"{name} is not installed (pip install {package})"
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
        where = exc.filename if exc.filename is not None else ""
        return "file", f"{where}: {exc.strerror or exc}" if where else str(exc)
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return "port", f"address already in use ({exc})"
    if isinstance(exc, OSError):
        return "system", str(exc)
    if isinstance(exc, ValueError):
        # Checkpoint roots that exclude the start-up model, unreadable checkpoints, bad model configs.
        return "start-up", str(exc)
    return "start-up", f"{type(exc).__name__}: {exc}"
