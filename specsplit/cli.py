"""The ``specsplit`` command line.

Owns: argument parsing for every subcommand (services, ``up``, ``demo``,
``generate``, ``status``, ``reload``, ``push``, ``train``, ``bench``, ``healthcheck``,
``config-reference``) and process-level concerns: logging set-up, the
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

from runtime.config import ConfigError, OrchestratorConfig, WorkerConfig
from specsplit import config_loader

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / "models" / "tiny"
DEFAULT_ADDRESS = "127.0.0.1:50051"
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
        from specsplit.admin_token import default_token_path

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
    from runtime.observability import configure_logging, redact

    overrides = {"role": role}
    cfg = config_loader.build(WorkerConfig, args, overrides=overrides)
    log = configure_logging(f"{role}_service", args.log_level)
    log.info("starting", config=redact(cfg))
    try:
        if role == "draft":
            from draft_service.server import start
        else:
            from target_service.server import start
        # NOTE: `start` (not `create_server`) returns the service with its bound metrics port,
        # so the listening line reports the port actually served.
        service = start(cfg)
    except Exception as exc:  # noqa: BLE001 - every start-up failure becomes one line (main)
        raise StartFailed() from exc
    server, port = service.server, service.port
    announce(role, port, service.metrics_port, cfg.server.host, cfg.security)
    sig = wait_for_signal()
    log.info("stopping", signal=sig)
    # NOTE: the workers hold no client state worth draining: stop with a
    # short grace so in-flight rounds answer, then exit.
    server.stop(grace=SHUTDOWN_GRACE_S).wait(SHUTDOWN_GRACE_S + 1)
    return 0


def cmd_orchestrator(args: argparse.Namespace) -> int:
    from runtime.observability import configure_logging, redact

    try:
        from orchestrator.server import create_server
    except ImportError as exc:
        raise StartFailed() from exc

    cfg = config_loader.build(OrchestratorConfig, args)
    log = configure_logging("orchestrator", args.log_level)
    log.info("starting", config=redact(cfg))
    try:
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
                        allow_insecure=args.allow_insecure, http_port=args.http_port)
    from specsplit.startup import StartupError

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


def _generate_prompt(args: argparse.Namespace):
    """The prompt as text, token ids (``--token-ids 1,2,3``) or chat messages (``--chat``:
    the positional argument is the user message, ``--system`` an optional system message)."""
    if args.token_ids is not None:
        if args.prompt is not None or args.chat:
            raise ConfigError("--token-ids replaces the prompt argument (and --chat)")
        try:
            return [int(t) for t in args.token_ids.replace(",", " ").split()]
        except ValueError:
            raise ConfigError(f"--token-ids={args.token_ids!r} is invalid: must be integers separated by "
                              "commas or spaces") from None
    if args.prompt is None:
        raise ConfigError("give a prompt (or --token-ids)")
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        return system + [{"role": "user", "content": args.prompt}]
    return args.prompt


def cmd_generate(args: argparse.Namespace) -> int:
    k = 0 if args.no_spec else args.k
    prompt = _generate_prompt(args)
    with _client(args) as client:
        if args.json:
            res = client.generate_text(prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                       top_k=args.top_k, top_p=args.top_p, seed=args.seed, k=k, stop=args.stop)
            print(json.dumps({"tokens": list(res.tokens), "text": res.text, "acceptance_rate": res.acceptance_rate,
                              "mean_accepted_length": res.mean_accepted_length,
                              "finish_reason": res.finish_reason}))
            return 0
        final = None
        for event in client.generate(prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                     top_k=args.top_k, top_p=args.top_p, seed=args.seed, k=k, stop=args.stop):
            if event.text is not None and not event.final:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            if event.final:
                final = event
        sys.stdout.write("\n")
        if final is not None:
            print(f"[finish={final.finish_reason} tokens={final.completion_tokens} "
                  f"acceptance={final.acceptance_rate:.2f} tokens/round={final.mean_accepted_length:.2f}]",
                  file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        status = client.status()
    problems = _status_problems(status)
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        for name in ("orchestrator", "draft", "target"):
            part = status.get(name) or {}
            err = status.get(f"{name}_error")
            print(f"{name:13s} " + (f"UNREACHABLE: {err}" if err else
                  " ".join(f"{k}={v}" for k, v in sorted(part.items()) if not isinstance(v, (list, dict)))))
    for p in problems:
        print(f"specsplit status: {p}", file=sys.stderr)
    return 1 if problems else 0


NO_DRAFT = "no draft configured"


def _status_problems(status: dict) -> list[str]:
    """Why the cluster is not fully serving: an unreachable worker, or one not LOADED/READY."""
    out = []
    for name in ("target", "draft"):
        err = status.get(f"{name}_error") or ""
        if name == "draft" and err.startswith(NO_DRAFT):
            continue
        state = (status.get(name) or {}).get("state", "")
        if err:
            out.append(f"{name} unreachable or degraded: {err}")
        elif state not in ("LIFECYCLE_STATE_LOADED", "LIFECYCLE_STATE_READY"):
            out.append(f"{name} is not serving (state {state or 'unknown'})")
    return out


def cmd_reload(args: argparse.Namespace) -> int:
    """Reload the serving weights; prints one line (or JSON object) per progress event."""
    from orchestrator.client import ReloadFailed, SpecsplitClient

    from specsplit.progress import progress

    with _client(args) as client, progress(desc="reload", unit="phase") as bar:
        try:
            for ev in client.reload_events(args.target_path, args.version, draft_path=args.draft_path or "",
                                           mode=args.mode, inflight=args.inflight):
                if args.json:
                    print(json.dumps(ev.__dict__), flush=True)
                else:
                    err = f"  FAILED {ev.error_code}: {ev.error_message}" if ev.error_code else ""
                    print(f"{ev.phase:13s} {ev.service:12s} {ev.seconds:8.3f}s  {ev.message}{err}", flush=True)
                bar.set_postfix_str(f"{ev.phase} {ev.service}", refresh=False)
                bar.update(1)
        except ReloadFailed as exc:
            print(f"specsplit reload: {exc.code.name}: {exc.details}", file=sys.stderr)
            return 1
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    """Send a checkpoint's tensors (the target's, from its index, and the MTP file's) over PushWeights."""
    from orchestrator.client import ReloadFailed
    from runtime.checkpoint import CheckpointError, index_checkpoint, read_tensor
    from specsplit.progress import progress

    root = Path(args.checkpoint)
    try:
        # NOTE: the target's tensors come from its index (model.safetensors or the shards it
        # names), never a glob: a glob also picks up other heads such as mtp_naive.safetensors.
        infos = {**index_checkpoint(root), **index_checkpoint(args.draft_path or root / "mtp.safetensors")}
        config = (root / "config.json").read_text()
    except (CheckpointError, OSError) as exc:
        print(f"specsplit push: cannot read checkpoint {root}: {exc}", file=sys.stderr)
        return 2
    bar = progress(desc="push", total=len(infos), unit="tensor")

    def lazily():
        for name, info in infos.items():
            yield name, read_tensor(info)
            bar.update(1)

    with _client(args) as client:
        try:
            res = client.push_weights(lazily(), config, args.version, mode=args.mode, inflight=args.inflight,
                                      bfloat16=args.bfloat16)
        except ReloadFailed as exc:
            print(f"specsplit push: {exc.code.name}: {exc.details}", file=sys.stderr)
            return 1
        finally:
            bar.close()
    out = {"weights_version": res.weights_version, "staged_path": res.staged_path,
           "bytes_received": res.bytes_received, "num_tensors": res.num_tensors}
    print(json.dumps(out) if args.json else " ".join(f"{k}={v}" for k, v in out.items()))
    return 0


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


def cmd_healthcheck(args: argparse.Namespace) -> int:
    """Exit 0 when the service at ADDRESS reports SERVING over grpc.health.v1."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if args.tls_ca:
        creds = grpc.ssl_channel_credentials(
            Path(args.tls_ca).read_bytes(), Path(args.tls_key).read_bytes() if args.tls_key else None,
            Path(args.tls_cert).read_bytes() if args.tls_cert else None)
        channel = grpc.secure_channel(args.address, creds)
    else:
        channel = grpc.insecure_channel(args.address)
    try:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                         timeout=args.timeout)
    except grpc.RpcError as exc:
        print(f"unhealthy: {exc.code().name}: {exc.details()}", file=sys.stderr)
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            from specsplit.tls_hint import tls_mismatch

            hint = tls_mismatch(args.address, args.tls_ca, args.tls_cert, args.tls_key)
            if hint:
                print(f"unhealthy: {hint}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(status)
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_config_reference(_args: argparse.Namespace) -> int:
    print(config_loader.reference_markdown([("Draft and target workers (`specsplit draft`, `specsplit target`)", WorkerConfig),
                                            ("Orchestrator (`specsplit orchestrator`)", OrchestratorConfig)]))
    return 0


def cmd_metrics_reference(_args: argparse.Namespace) -> int:
    from specsplit.metrics_reference import reference_markdown

    print(reference_markdown())
    return 0


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=os.environ.get("SPECSPLIT_ADDRESS", DEFAULT_ADDRESS),
                   help="orchestrator host:port [env SPECSPLIT_ADDRESS]")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of the call in seconds")
    p.add_argument("--tls-ca", default=None, help="CA bundle to verify the server (enables TLS)")
    p.add_argument("--tls-cert", default=None, help="client certificate (PEM) for mutual TLS (with --tls-ca)")
    p.add_argument("--tls-key", default=None, help="private key of --tls-cert")
    p.add_argument("--token", default=os.environ.get("SPECSPLIT_TOKEN"), help="bearer token [env SPECSPLIT_TOKEN]")
    p.add_argument("--token-file", default=os.environ.get("SPECSPLIT_TOKEN_FILE"),
                   help="file holding the bearer token [env SPECSPLIT_TOKEN_FILE] (default for a loopback "
                        "--address: the token file the service wrote, see docs/hardening.md)")


def client_token(args: argparse.Namespace) -> str | None:
    """--token, else --token-file, else the token file of a local service at --address (or None)."""
    from specsplit.admin_token import find_admin_token, read_token_file

    if args.token:
        return args.token
    if args.token_file:
        try:
            return read_token_file(args.token_file)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--token-file {args.token_file}: {getattr(exc, 'strerror', None) or exc}") from None
    return find_admin_token(args.address)


def _client(args: argparse.Namespace):
    from orchestrator.client import SpecsplitClient

    for flag, path in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path and not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such file")
    return SpecsplitClient(args.address, timeout=args.timeout, tls_ca=args.tls_ca, token=client_token(args),
                           tls_cert=args.tls_cert, tls_key=args.tls_key)


def _stack_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="target checkpoint dir (with mtp.safetensors)")
    p.add_argument("--backend", default="paddle", choices=("paddle", "torch"))
    p.add_argument("--draft-device", default="cpu", help="cpu | cuda:N")
    p.add_argument("--target-device", default="cpu", help="cpu | cuda:N")
    p.add_argument("--port", type=int, default=0, help="orchestrator port (0 = pick)")
    p.add_argument("--host", default="127.0.0.1", help="orchestrator listen address (the workers always listen on "
                                                       "127.0.0.1); a non-loopback one needs --allow-insecure")
    p.add_argument("--allow-insecure", action="store_true",
                   help="let the orchestrator serve plaintext on a non-loopback --host (warned at every start)")
    p.add_argument("--k", type=int, default=3, help="default drafts per round")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--no-draft", action="store_true", help="run target-only (no draft service)")
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
    _stack_args(p)
    p = sub.add_parser("demo", help="bring the stack up, stream one generation with acceptance statistics")
    _stack_args(p)
    p.add_argument("--prompt", default=None, help="prompt text (default: a held-out prompt of the bundled model)")
    p.add_argument("--max-tokens", type=int, default=160)

    p = sub.add_parser("generate", help="stream a generation from a running orchestrator")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text (the user message with --chat)")
    p.add_argument("--token-ids", default=None, help="prompt as token ids, e.g. '1,15043,3186' (no tokenizer)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat message (model's chat template)")
    p.add_argument("--system", default=None, help="with --chat: a system message before the user message")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    _client_args(p)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--k", type=int, default=None, help="drafts per round (default: server's)")
    p.add_argument("--no-spec", action="store_true", help="target-only decoding")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")

    p = sub.add_parser("status", help="state of the orchestrator and both workers")
    _client_args(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("reload", help="reload the serving weights on both workers (admin token)")
    p.add_argument("target_path", help="new target checkpoint dir (under the workers' checkpoint roots)")
    p.add_argument("--version", required=True, help="version tag of the new weights")
    p.add_argument("--draft-path", default=None, help="MTP file (default: mtp.safetensors inside target_path)")
    p.add_argument("--mode", default="recapture", choices=("recapture", "in_place"))
    p.add_argument("--inflight", default="wait", choices=("wait", "abort", "recompute"))
    _client_args(p)
    p.add_argument("--json", action="store_true", help="one JSON object per event")

    p = sub.add_parser("push", help="send a checkpoint's tensors to the orchestrator (PushWeights, admin token)")
    p.add_argument("checkpoint", help="target checkpoint dir (config.json and model.safetensors or its shards)")
    p.add_argument("--version", required=True, help="version tag of the new weights")
    p.add_argument("--draft-path", default=None, help="MTP file (default: mtp.safetensors inside checkpoint)")
    p.add_argument("--mode", default="recapture", choices=("recapture", "in_place"))
    p.add_argument("--inflight", default="wait", choices=("wait", "abort", "recompute"))
    p.add_argument("--bfloat16", action="store_true", help="send floats as bfloat16 (half the bytes)")
    _client_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("healthcheck", help="grpc.health.v1 check; exit 0 when SERVING (for containers)")
    p.add_argument("address")
    p.add_argument("--service", default="")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--tls-ca", default=None)
    p.add_argument("--tls-cert", default=None, help="client certificate for mutual TLS")
    p.add_argument("--tls-key", default=None)

    p = sub.add_parser("train", help="train the tiny target and its MTP head (Torch)")
    if train_args:
        # NOTE: imported only for `train`: it loads Torch, which the other
        # commands (and Paddle workers) must not pay for.
        from runtime.backends.torch_train import add_train_args

        add_train_args(p)

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
                    "status": cmd_status, "reload": cmd_reload, "push": cmd_push, "healthcheck": cmd_healthcheck, "config-reference": cmd_config_reference, "metrics-reference": cmd_metrics_reference}
        if args.command == "train":
            from runtime.backends.torch_train import run_train

            run_train(args)
            return 0
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
    from specsplit.startup import describe

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
    from specsplit.tls_hint import tls_mismatch

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
