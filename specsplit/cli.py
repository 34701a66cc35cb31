"""The ``specsplit`` command line.

Owns: argument parsing for every subcommand (services, ``up``, ``demo``,
``generate``, ``status``, ``reload``, ``push``, ``train``, ``train-mtp``, ``bench``,
``healthcheck``, ``config-reference``; the client commands' and ``train-mtp``'s own arguments
live in ``cli_client`` and ``cli_train``) and process-level concerns: logging set-up, the
"listening" announcement on stdout, signal handling and child processes of
``up``. This is the only place (with ``config_loader``) that parses flags,
files or environment variables.

Must not know: how the services work inside.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from core.config import ConfigError
from orchestrator.config import OrchestratorConfig
from worker.config import WorkerConfig
from core import config_loader, heap
from specsplit import configs
from specsplit.cli_client import (DEFAULT_ADDRESS, add_client_parsers, cmd_generate, cmd_healthcheck, cmd_push,
                                  cmd_reload, cmd_status)
from specsplit.cli_train import add_train_mtp_args, cmd_train_mtp

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / "models" / "tiny"
SHUTDOWN_GRACE_S = 10.0


def version() -> str:
    """The installed package's version (``pyproject.toml``); "unknown" when not installed."""
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version("specsplit")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def announce(service: str, port: int, metrics_port: int | None, host: str, security: Any = None,
             **extra: object) -> None:
    """One JSON line on stdout telling a parent process where the service listens (and, when the
    admin token was generated, the file that holds it; ``extra``: more ports, e.g. ``http_port``)."""
    msg: dict[str, Any] = {"event": "listening", "service": service, "address": f"{host}:{port}",
                           "metrics_port": metrics_port, **extra}
    if security is not None and not (security.admin_token or security.admin_client_cns):
        from core.admin_token import default_token_path

        msg["admin_token_file"] = str(security.admin_token_file or default_token_path(port))
    print(json.dumps(msg), flush=True)


class StartFailed(Exception):
    """A service did not start; the cause is the exception that stopped it."""


def wait_for_signal() -> int:
    """Block until SIGINT or SIGTERM; returns the signal number."""
    got: list[int] = []
    done = threading.Event()

    def handler(signum, _frame):
        got.append(signum)
        done.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    while not done.wait(1.0):
        pass
    return got[0]


def cmd_worker(role: str, args: argparse.Namespace) -> int:
    from core.observability import configure_logging, redact

    overrides = {"role": role}
    cfg = configs.build(WorkerConfig, args, overrides=overrides)
    log = configure_logging(f"{role}_service", args.log_level)
    log.info("starting", config=redact(cfg))
    try:
        rendezvous = torchrun_rendezvous(os.environ) if role == "target" and cfg.tp > 1 else None
        if rendezvous is not None and rendezvous.rank > 0:
            from target_service.tp_launch import follower_main

            follower_main(cfg, rendezvous)       # ranks > 0 serve nothing: they follow rank 0
            return 0
        if role == "draft":
            from draft_service.server import start
        else:
            from target_service.server import start
        # NOTE: `start` (not `create_server`) returns the service with its bound metrics port,
        # so the listening line reports the port actually served.
        heap.enable()
        if cfg.colocated_draft:
            from draft_service.server import colocated

            service = start(cfg, draft=colocated(cfg))      # the draft in this process (worker/config.py)
        else:
            service = start(cfg, rendezvous) if rendezvous is not None else start(cfg)
        heap.settle()          # loaded, captured: the long-lived heap out of the collector's walks
    except Exception as exc:  # noqa: BLE001 - every start-up failure becomes one line (main)
        raise StartFailed() from exc
    announce(role, service.port, service.metrics_port, cfg.server.host, cfg.security)
    sig = wait_for_signal()
    log.info("stopping", signal=sig)
    # NOTE: the workers hold no client state worth draining: stop with a short grace so
    # in-flight rounds answer, then the service's ordered stop: the round loop ends its
    # requests (the orchestrator's stream closes then, not at the end of the grace period),
    # graphs go before weights, and a tensor-parallel target tells its other ranks to stop.
    service.stop(grace=SHUTDOWN_GRACE_S)
    return 0


def torchrun_rendezvous(env: Any) -> Any:
    """The tensor-parallel rendezvous torchrun gives each process (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), or None outside torchrun (``specsplit target --tp N`` then spawns the ranks)."""
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return None
    from runtime.tp_plan import Rendezvous

    try:
        return Rendezvous(int(env["RANK"]), int(env["WORLD_SIZE"]), env.get("MASTER_ADDR", "127.0.0.1"),
                          int(env.get("MASTER_PORT", "29500")))
    except ValueError as exc:
        raise ConfigError(f"torchrun environment: RANK/WORLD_SIZE/MASTER_PORT must be integers ({exc})") from None


def cmd_orchestrator(args: argparse.Namespace) -> int:
    from core.observability import configure_logging, redact

    try:
        from orchestrator.server import create_server
    except ImportError as exc:
        raise StartFailed() from exc

    cfg = configs.build(OrchestratorConfig, args)
    log = configure_logging("orchestrator", args.log_level)
    log.info("starting", config=redact(cfg))
    try:
        heap.enable()
        server, port = create_server(cfg)
    except Exception as exc:  # noqa: BLE001 - every start-up failure becomes one line (main)
        raise StartFailed() from exc
    http = None
    if cfg.http_port is not None:
        from orchestrator.http_api import start_http_api

        try:
            http = start_http_api(cfg.server.host, cfg.http_port, port, cfg.http_model_name, cfg.tokenizer)
        except Exception as exc:  # noqa: BLE001 - one line, like every start-up failure
            server.stop(0)
            raise StartFailed() from exc
    heap.settle()
    announce("orchestrator", port, getattr(server, "metrics_port", None), cfg.server.host, cfg.security,
             http_port=http.port if http is not None else None)
    sig = wait_for_signal()
    log.info("stopping", signal=sig)
    if http is not None:
        http.stop(timeout=cfg.shutdown_grace_s)       # HTTP callers are Generate calls: they end first
    # NOTE: graceful shutdown order: stop admitting new requests first, then
    # let in-flight generations finish within the grace period, then exit.
    grace = cfg.shutdown_grace_s
    shutdown = getattr(server, "graceful_shutdown", None)
    if shutdown is not None:
        shutdown(grace)
    else:
        server.stop(grace=grace).wait(grace + 1)
    log.info("stopped")
    return 0


def cmd_up(args: argparse.Namespace, then=None) -> int:
    from specsplit.launcher import Stack, StackOptions

    mtp = Path(args.model) / "mtp.safetensors"
    # NOTE: only for a model directory that exists: a missing model is the target's start-up
    # error (one line naming the weights), not a missing draft head.
    if not args.no_draft and Path(args.model).is_dir() and not mtp.is_file():
        print(f"specsplit: {args.command}: draft head: no MTP file at {mtp}; serve target-only with --no-draft",
              file=sys.stderr)
        return 2

    opts = StackOptions(model=str(args.model), backend=args.backend, draft_device=args.draft_device,
                        target_device=args.target_device, port=args.port, k=args.k, max_batch=args.max_batch,
                        no_draft=args.no_draft, capture_graphs=args.capture_graphs, metrics=args.metrics,
                        log_level=args.log_level, extra_env={}, admin_token=args.admin_token, host=args.host,
                        allow_insecure=args.allow_insecure, http_port=args.http_port,
                        colocated_draft=args.colocated_draft)
    from core.startup import StartupError

    stack = Stack(opts)
    try:
        stack.__enter__()
    except Exception as exc:  # noqa: BLE001 - a child that failed printed its own one-line reason first
        raise StartFailed() from StartupError("up", str(exc))
    try:
        print(json.dumps(stack.addresses()), flush=True)
        if then is not None:
            return then(stack)
        sig = wait_for_signal()
        print(json.dumps({"event": "stopping", "signal": sig}), file=sys.stderr, flush=True)
    finally:
        stack.close()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from specsplit.demo import run_demo

    # The demo's terminal shows the generation: services log warnings only,
    # unless SPECSPLIT_LOG_LEVEL asks for more.
    args.log_level = os.environ.get("SPECSPLIT_LOG_LEVEL", "WARNING")
    return cmd_up(args, then=lambda stack: run_demo(stack.orchestrator_address, args))


def cmd_convert_mtp(args: argparse.Namespace) -> int:
    from runtime.checkpoint import CheckpointError
    from runtime.convert_mtp import convert

    try:
        out = convert(args.source, args.target, args.out or Path(args.target) / "mtp.safetensors", args.layer)
    except CheckpointError as exc:
        print(f"specsplit convert-mtp: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"event": "converted", "mtp": str(out)}))
    return 0


def cmd_config_reference(_args: argparse.Namespace) -> int:
    print(config_loader.reference_markdown([("Draft and target workers (`specsplit draft`, `specsplit target`)", WorkerConfig),
                                            ("Orchestrator (`specsplit orchestrator`)", OrchestratorConfig)]))
    return 0


def cmd_metrics_reference(_args: argparse.Namespace) -> int:
    from specsplit.metrics_reference import reference_markdown

    print(reference_markdown())
    return 0


def _stack_args(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="target checkpoint dir (with mtp.safetensors)")
    p.add_argument("--backend", default="paddle", choices=("paddle", "torch"))
    p.add_argument("--draft-device", default="cpu", help="cpu | cuda:N")
    p.add_argument("--target-device", default="cpu", help="cpu | cuda:N")
    # NOTE: `up` listens where `generate` and `status` look by default (DEFAULT_ADDRESS), so a
    # stack started without flags is found without copying its port; `demo` talks to its own stack.
    p.add_argument("--port", type=int, default=port,
                   help=f"orchestrator port (0 = pick; default {port}" +
                        (", the port of generate's and status's default --address)" if port else ")"))
    p.add_argument("--host", default="127.0.0.1", help="orchestrator listen address (the workers always listen on "
                                                       "127.0.0.1); a non-loopback one needs --allow-insecure")
    p.add_argument("--allow-insecure", action="store_true",
                   help="let the orchestrator serve plaintext on a non-loopback --host (warned at every start)")
    p.add_argument("--k", type=int, default=3, help="default drafts per round")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--no-draft", action="store_true", help="run target-only (no draft service)")
    p.add_argument("--colocated-draft", action="store_true",
                   help="run the draft in the target's process (on --draft-device): two processes, rounds call "
                        "the draft directly; for one GPU")
    p.add_argument("--capture-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="capture CUDA graphs at start (default: on for cuda devices)")
    p.add_argument("--metrics", action="store_true", help="serve Prometheus metrics (ports printed)")
    p.add_argument("--admin-token", default=os.environ.get("SPECSPLIT_SECURITY_ADMIN_TOKEN"),
                   help="admin token of all three services, also presented by the orchestrator to the workers "
                        "[env SPECSPLIT_SECURITY_ADMIN_TOKEN]; default: generated and written to the token file")
    p.add_argument("--http-port", type=int, default=None,
                   help="serve the OpenAI-compatible HTTP API on this port (0 = pick; default: off)")


def _allow_insecure_alias(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-insecure", dest="cfg__security__allow_insecure", action="store_const", const=True,
                   default=None, help="same as --security-allow-insecure: serve plaintext on a non-loopback "
                                      "address (warned at every start)")


def build_parser(train_args: bool = True) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specsplit", description="Speculative decoding split into gRPC services.")
    ap.add_argument("--log-level", default=os.environ.get("SPECSPLIT_LOG_LEVEL", "INFO"))
    ap.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = ap.add_subparsers(dest="command", required=True)

    for role in ("draft", "target"):
        p = sub.add_parser(role, help=f"run the {role} service")
        config_loader.add_arguments(p, WorkerConfig, skip=("role",))
        _allow_insecure_alias(p)
    p = sub.add_parser("orchestrator", help="run the orchestrator")
    config_loader.add_arguments(p, OrchestratorConfig)
    _allow_insecure_alias(p)

    p = sub.add_parser("up", help="all three services on loopback (Ctrl-C stops them)")
    _stack_args(p, port=int(DEFAULT_ADDRESS.rpartition(":")[2]))
    p = sub.add_parser("demo", help="bring the stack up, stream one generation with acceptance statistics")
    _stack_args(p, port=0)
    p.add_argument("--prompt", default=None, help="prompt text (default: a held-out prompt of the bundled model)")
    p.add_argument("--max-tokens", type=int, default=160)

    add_client_parsers(sub)

    p = sub.add_parser("train", help="train the tiny target and its MTP head (Torch)")
    if train_args:
        # NOTE: imported only for `train`: it loads Torch, which the other
        # commands (and Paddle workers) must not pay for.
        from training.torch_train import add_train_args

        add_train_args(p)

    p = sub.add_parser("train-mtp", help="train an MTP draft head for an existing target (Torch)")
    add_train_mtp_args(p)

    p = sub.add_parser("convert-mtp", help="import MTP weights stored in the DeepSeek-V3 layout")
    p.add_argument("source", help="safetensors file or directory holding model.layers.N.{enorm,hnorm,eh_proj,...}")
    p.add_argument("--target", required=True, help="the target checkpoint dir the head drafts for")
    p.add_argument("--layer", type=int, default=None, help="N of the MTP layer (default: the only one)")
    p.add_argument("--out", default=None, help="output file (default: TARGET/mtp.safetensors)")

    p = sub.add_parser("bench", help="benchmarks that print ratios measured side by side")
    from bench import add_bench_args

    add_bench_args(p)

    sub.add_parser("config-reference", help="print the configuration reference (Markdown)")
    sub.add_parser("metrics-reference", help="print the metrics reference (Markdown)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(train_args="train" in argv).parse_args(argv)
    args.log_level = str(args.log_level).upper()    # `--log-level debug` works as DEBUG
    from orchestrator.client import SpecsplitError

    if args.command in ("draft", "target", "orchestrator", "up", "demo"):
        # NOTE: before the services allocate anything: host memory stays flat over reloads.
        from runtime import host_memory

        host_memory.pin_mmap_threshold()
    try:
        if args.command in ("draft", "target"):
            return cmd_worker(args.command, args)
        handlers = {"orchestrator": cmd_orchestrator, "up": cmd_up, "demo": cmd_demo, "generate": cmd_generate,
                    "status": cmd_status, "reload": cmd_reload, "push": cmd_push, "healthcheck": cmd_healthcheck,
                    "config-reference": cmd_config_reference, "metrics-reference": cmd_metrics_reference}
        if args.command == "train":
            from training.torch_train import run_train

            run_train(args)
            return 0
        if args.command == "train-mtp":
            return cmd_train_mtp(args)
        if args.command == "convert-mtp":
            return cmd_convert_mtp(args)
        if args.command == "bench":
            from bench import run_bench

            return run_bench(args)
        return handlers[args.command](args)
    except ConfigError as exc:
        print(f"specsplit: configuration error: {exc}", file=sys.stderr)
        return 2
    except StartFailed as exc:
        return _start_failed(exc.__cause__ or exc, args)
    except SpecsplitError as exc:
        print(f"specsplit: {exc}", file=sys.stderr)
        hint = _tls_hint(exc, args)
        if hint:
            print(f"specsplit: {hint}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return _closed_pipe()
    except FileNotFoundError as exc:                 # e.g. a client's --tls-ca that does not exist
        print(f"specsplit: file: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _start_failed(cause: BaseException, args: argparse.Namespace) -> int:
    """``specsplit: <what>: <why>`` on one line, exit 2; the traceback only under --log-level debug."""
    from core.startup import describe

    if str(getattr(args, "log_level", "")).upper() == "DEBUG":
        import traceback

        traceback.print_exception(cause, file=sys.stderr)
    what, why = describe(cause)
    print(f"specsplit: {what}: {' '.join(why.split())}", file=sys.stderr, flush=True)
    return 2


def _tls_hint(exc: Any, args: argparse.Namespace) -> str | None:
    import grpc

    if getattr(exc, "code", None) != grpc.StatusCode.UNAVAILABLE or not getattr(args, "address", None):
        return None
    from core.tls_hint import tls_mismatch

    return tls_mismatch(args.address, getattr(args, "tls_ca", None), getattr(args, "tls_cert", None),
                        getattr(args, "tls_key", None))


def _closed_pipe() -> int:
    """The reader of stdout went away (``| head``): stop quietly, like a process killed by SIGPIPE."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())       # the interpreter's final flush must not fail again
    except OSError:
        pass
    return 141


if __name__ == "__main__":
    sys.exit(main())
