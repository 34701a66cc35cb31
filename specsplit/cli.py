"""The ``specsplit`` command line.

Owns: argument parsing for every subcommand (services, ``up``, ``demo``,
``generate``, ``status``, ``reload``, ``train``, ``bench``, ``healthcheck``,
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

from runtime.config import ConfigError, OrchestratorConfig, WorkerConfig
from specsplit import config_loader

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / "models" / "tiny"
DEFAULT_ADDRESS = "127.0.0.1:50051"
SHUTDOWN_GRACE_S = 10.0


def announce(service: str, port: int, metrics_port: int | None, host: str) -> None:
    """One JSON line on stdout telling a parent process where the service listens."""
    print(json.dumps({"event": "listening", "service": service, "address": f"{host}:{port}",
                      "metrics_port": metrics_port}), flush=True)


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
    if role == "draft":
        from draft_service.server import create_server
    else:
        from target_service.server import create_server
    server, port = create_server(cfg)
    announce(role, port, getattr(server, "metrics_port", None), cfg.server.host)
    sig = wait_for_signal()
    log.info("stopping", signal=sig)
    # NOTE: the workers hold no client state worth draining: stop with a
    # short grace so in-flight rounds answer, then exit.
    server.stop(grace=SHUTDOWN_GRACE_S).wait(SHUTDOWN_GRACE_S + 1)
    return 0


def cmd_orchestrator(args: argparse.Namespace) -> int:
    from orchestrator.server import create_server
    from runtime.observability import configure_logging, redact

    cfg = config_loader.build(OrchestratorConfig, args)
    log = configure_logging("orchestrator", args.log_level)
    log.info("starting", config=redact(cfg))
    server, port = create_server(cfg)
    announce("orchestrator", port, getattr(server, "metrics_port", None), cfg.server.host)
    sig = wait_for_signal()
    log.info("stopping", signal=sig)
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
    if not args.no_draft and not mtp.is_file():
        print(f"specsplit {args.command}: no MTP draft head at {mtp}; serve target-only with --no-draft",
              file=sys.stderr)
        return 2

    opts = StackOptions(model=str(args.model), backend=args.backend, draft_device=args.draft_device,
                        target_device=args.target_device, port=args.port, k=args.k, max_batch=args.max_batch,
                        no_draft=args.no_draft, capture_graphs=args.capture_graphs, metrics=args.metrics,
                        log_level=args.log_level, extra_env={})
    with Stack(opts) as stack:
        print(json.dumps(stack.addresses()), flush=True)
        if then is not None:
            return then(stack)
        sig = wait_for_signal()
        print(json.dumps({"event": "stopping", "signal": sig}), file=sys.stderr, flush=True)
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

    with _client(args) as client:
        try:
            for ev in client.reload_events(args.target_path, args.version, draft_path=args.draft_path or "",
                                           mode=args.mode, inflight=args.inflight):
                if args.json:
                    print(json.dumps(ev.__dict__), flush=True)
                else:
                    err = f"  FAILED {ev.error_code}: {ev.error_message}" if ev.error_code else ""
                    print(f"{ev.phase:13s} {ev.service:12s} {ev.seconds:8.3f}s  {ev.message}{err}", flush=True)
        except ReloadFailed as exc:
            print(f"specsplit reload: {exc.code.name}: {exc.details}", file=sys.stderr)
            return 1
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


def _client(args: argparse.Namespace):
    from orchestrator.client import SpecsplitClient

    return SpecsplitClient(args.address, timeout=args.timeout, tls_ca=args.tls_ca, token=args.token,
                           tls_cert=args.tls_cert, tls_key=args.tls_key)


def _stack_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="target checkpoint dir (with mtp.safetensors)")
    p.add_argument("--backend", default="paddle", choices=("paddle", "torch"))
    p.add_argument("--draft-device", default="cpu", help="cpu | cuda:N")
    p.add_argument("--target-device", default="cpu", help="cpu | cuda:N")
    p.add_argument("--port", type=int, default=0, help="orchestrator port (0 = pick)")
    p.add_argument("--k", type=int, default=3, help="default drafts per round")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--no-draft", action="store_true", help="run target-only (no draft service)")
    p.add_argument("--capture-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="capture CUDA graphs at start (default: on for cuda devices)")
    p.add_argument("--metrics", action="store_true", help="serve Prometheus metrics (ports printed)")


def build_parser(train_args: bool = True) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specsplit", description="Speculative decoding split into gRPC services.")
    ap.add_argument("--log-level", default=os.environ.get("SPECSPLIT_LOG_LEVEL", "INFO"))
    sub = ap.add_subparsers(dest="command", required=True)

    for role in ("draft", "target"):
        p = sub.add_parser(role, help=f"run the {role} service")
        config_loader.add_arguments(p, WorkerConfig, skip=("role",))
    p = sub.add_parser("orchestrator", help="run the orchestrator")
    config_loader.add_arguments(p, OrchestratorConfig)

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
    from orchestrator.client import SpecsplitError

    try:
        if args.command in ("draft", "target"):
            return cmd_worker(args.command, args)
        handlers = {"orchestrator": cmd_orchestrator, "up": cmd_up, "demo": cmd_demo, "generate": cmd_generate,
                    "status": cmd_status, "reload": cmd_reload, "healthcheck": cmd_healthcheck, "config-reference": cmd_config_reference, "metrics-reference": cmd_metrics_reference}
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
    except SpecsplitError as exc:
        print(f"specsplit: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
