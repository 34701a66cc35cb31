"""The client commands of the ``specsplit`` command line: they talk to a running stack.

Owns: ``generate``, ``status``, ``reload``, ``push`` and ``healthcheck`` — their
arguments, the prompt forms (text, token ids, chat), what ``status`` counts as
not serving (its exit code), the client's address / TLS / token flags, and the
default address (where ``specsplit up`` listens by default).

Must not know: how the services work inside, or how they are started (``specsplit/cli.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from core.config import ConfigError

DEFAULT_ADDRESS = "127.0.0.1:50051"


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
                                       top_k=args.top_k, top_p=args.top_p, seed=args.seed, k=k, stop=args.stop,
                                       fixed_k=args.fixed_k)
            print(json.dumps({"tokens": list(res.tokens), "text": res.text, "acceptance_rate": res.acceptance_rate,
                              "mean_accepted_length": res.mean_accepted_length,
                              "finish_reason": res.finish_reason}))
            return 0
        final = None
        for event in client.generate(prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                     top_k=args.top_k, top_p=args.top_p, seed=args.seed, k=k, stop=args.stop,
                                     fixed_k=args.fixed_k):
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
    from orchestrator.client import ReloadFailed

    from core.progress import progress

    with _client(args) as client, progress(desc="reload", unit="phase") as bar:
        try:
            for ev in client.reload_events(args.target_path, args.version, draft_path=args.draft_path or "",
                                           mode=args.mode, inflight=args.inflight, preload=args.preload):
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
    from core.progress import progress

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
            from core.tls_hint import tls_mismatch

            hint = tls_mismatch(args.address, args.tls_ca, args.tls_cert, args.tls_key)
            if hint:
                print(f"unhealthy: {hint}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(status)
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


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
    from core.admin_token import find_admin_token, read_token_file

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


def add_client_parsers(sub: Any) -> None:
    """The client commands' subparsers (``generate`` ... ``healthcheck``), in ``specsplit --help`` order."""
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
    p.add_argument("--fixed-k", action="store_true", help="draft k every round even where the server adapts k")
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
    p.add_argument("--preload", action="store_true",
                   help="workers read the new tensors into host memory before admission pauses (shorter pause, "
                        "one checkpoint of host memory per worker)")
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
