"""Generated admin tokens and the files that hand them to local clients (the Jupyter pattern).

Owns: the runtime directory (``$SPECSPLIT_RUNTIME_DIR``, else
``$XDG_RUNTIME_DIR/specsplit``, else ``~/.local/share/specsplit/runtime``),
the token file of a service (``admin-<port>.token`` there unless
``security.admin_token_file`` names another path; mode 0600 in a 0700
directory, written atomically), the per-process generated token, looking a
token up for a loopback address (what the CLI, ``specsplit up`` and the
orchestrator's links to local workers do when no token is given), which
ports this process serves with the generated token (``serve_generated``
until ``stop_serving``, which also removes the file), and token fingerprints
for audit lines.

Must not know: gRPC, services. A token file is only read for loopback
addresses: a token of this machine is never sent elsewhere.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import secrets
import threading
from pathlib import Path

_lock = threading.Lock()
_process_token: str | None = None
_serving: dict[int, Path] = {}     # port -> token file, for this process's servers with the generated token


def runtime_dir(env: dict[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("SPECSPLIT_RUNTIME_DIR"):
        return Path(env["SPECSPLIT_RUNTIME_DIR"])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "specsplit"
    return Path.home() / ".local" / "share" / "specsplit" / "runtime"


def default_token_path(port: int, env: dict[str, str] | None = None) -> Path:
    return runtime_dir(env) / f"admin-{port}.token"


def process_token() -> str:
    """The admin token generated for this process (one per process).

    NOTE: one per process, not one per server: services started in one process (tests,
    embedding) then accept each other's admin calls, as a stack started by ``specsplit up``
    does with its one token.
    """
    global _process_token
    with _lock:
        if _process_token is None:
            _process_token = secrets.token_urlsafe(32)
        return _process_token


def serve_generated(port: int, path: str | Path) -> None:
    """Record that a server of this process listens on ``port`` with the generated token,
    written to ``path``."""
    with _lock:
        _serving[port] = Path(path).expanduser()


def stop_serving(port: int) -> None:
    """The server on ``port`` has stopped: forget it and remove its token file if the file
    still holds this process's token (a file another process rewrote since is left alone).

    NOTE: forgotten before the file goes, and both before the port can be reused: a later
    server on the same port with a configured token must not be taken for this one (a stale
    file holding this process's token once made the orchestrator present the wrong token).
    """
    with _lock:
        path = _serving.pop(port, None)
        token = _process_token
    if path is None or token is None:
        return
    try:
        if read_token_file(path) == token:
            path.unlink()
    except (OSError, ValueError):
        pass


def write_token_file(path: str | Path, token: str) -> Path:
    """Write ``token`` to ``path`` readable only by this user; OSError when it cannot."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def read_token_file(path: str | Path) -> str:
    """The token in ``path`` (first line, stripped); OSError / ValueError when unusable."""
    token = Path(path).expanduser().read_text().strip().splitlines()
    if not token or not token[0].strip():
        raise ValueError(f"{path} holds no token")
    return token[0].strip()


def is_loopback_host(host: str) -> bool:
    host = host.strip("[]")
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_address(address: str) -> tuple[str, int | None]:
    """(host, port) of ``host:port`` / ``[v6]:port`` / ``ipv4:host:port``; port None if absent."""
    for scheme in ("ipv4:", "ipv6:", "dns:///", "dns:"):
        if address.startswith(scheme):
            address = address[len(scheme):]
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return address, None
    return host, int(port)


def find_admin_token(address: str, env: dict[str, str] | None = None) -> str | None:
    """The token a service at a loopback ``address`` wrote to the runtime dir (None: none there)."""
    host, port = split_address(address)
    if port is None or not is_loopback_host(host):
        return None
    try:
        return read_token_file(default_token_path(port, env))
    except (OSError, ValueError):
        return None


def fingerprint(token: str | bytes) -> str:
    """A short, non-reversible name of a token for logs: ``sha256:<12 hex>``."""
    raw = token.encode() if isinstance(token, str) else token
    return "sha256:" + hashlib.sha256(raw).hexdigest()[:12]


def token_for_worker(worker_admin_token: str | None, own_admin_token: str | None, address: str) -> str | None:
    """The admin token the orchestrator presents to the worker at ``address``.

    In order: ``worker_admin_token``; for a loopback worker served by this process with the
    generated token (``serve_generated``, not yet ``stop_serving``), that token; the
    orchestrator's own configured admin token (one setting serves both);
    for a loopback worker, the token file it wrote, else this process's generated token.
    None: send no token (a token of this machine never goes to another one).
    """
    if worker_admin_token:
        return worker_admin_token
    host, port = split_address(address)
    local = is_loopback_host(host)
    with _lock:
        ours = local and port in _serving
    if ours:
        return process_token()
    if own_admin_token:
        return own_admin_token
    if not local:
        return None
    return find_admin_token(address) or process_token()
