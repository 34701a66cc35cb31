"""Flags, TOML files and ``SPECSPLIT_*`` environment variables -> the frozen config tree.

Owns: deriving every command-line flag, TOML key and environment variable
from the dataclass fields of a config tree (so the three cannot drift
from the code), their precedence (flag > env > TOML > default), and the
generated configuration reference (``docs/configuration.md``).

Naming: the field ``cache.max_slots`` of a worker is the flag
``--cache-max-slots``, the env var ``SPECSPLIT_CACHE_MAX_SLOTS`` and the TOML
key ``max_slots`` in table ``[cache]``.

Must not know: what the services do with the values. Only ``__main__`` /
the CLI call this module.

Strict: an unknown TOML table or key, or an unknown ``SPECSPLIT_*`` variable,
is a ``ConfigError`` naming it and the closest valid one.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import ConfigError

HELP: dict[str, str] = {
    "role": "worker role (set by the subcommand)",
    "target_path": "target checkpoint directory (Hugging Face layout) loaded at start; unset = start EMPTY",
    "draft_path": "MTP file (default: mtp.safetensors inside target_path)",
    "weights_version": "version tag of the start-up weights (default: the path)",
    "capture_on_start": "capture CUDA graphs after the start-up load",
    "tp": "target: tensor-parallel ranks, one process per device (rank r on cuda:N+r for runtime.device "
          "cuda:N; gloo on the CPU); torch backend only",
    "runtime.backend": "tensor framework: paddle | torch",
    "runtime.device": "cpu | cuda:N",
    "runtime.dtype": "float32 | float16 | bfloat16",
    "runtime.cpu_threads": "intra-op CPU threads of this process (Torch; Paddle follows OMP_NUM_THREADS)",
    "runtime.compile": "torch.compile the step functions before CUDA-graph capture (Torch on CUDA only)",
    "runtime.fused_kernels": "the decoder layer's fused Triton kernels (Torch on CUDA with Triton; plain ops elsewhere)",
    "runtime.batch_invariant": "target: decode and verify steps whose per-request bits do not depend on the batch "
                               "(greedy speculation == target-only in bf16 too; prefills one request at a time); "
                               "Torch on CUDA with runtime.fused_kernels, tp 1",
    "spec.max_k": "largest number of drafts per round a request may ask for",
    "spec.default_k": "drafts per round when a request does not say",
    "spec.adaptive_k": "target: each round's k follows the requests' acceptance and the measured round costs "
                       "(0..the request's k; runtime/adaptive_k.py); a request with fixed_k drafts its k every round",
    "spec.watch_probes": "target, with spec.adaptive_k: probes are watch probes where requests' drafts are greedy "
                         "or coupled (the draft drafts beside a target-only step; its drafts are judged against the "
                         "target's next tokens, never verified; spec.micro_batches rounds probe by drafting); off: "
                         "probes draft and verify",
    "spec.ahead_drafting": "target: while verifying, ask the draft for k+1 drafts past d_k; used next round when "
                           "all k were accepted and the bonus matches (exact either way); draft: also capture "
                           "the catch-up width that follows such a round (set it on both)",
    "draft_tls_ca": "target: CA that verifies the draft's certificate (TLS to the draft); unset with mTLS "
                    "serving = security.tls_client_ca",
    "draft_client_cert": "target: client certificate shown to an mTLS draft (default with mTLS serving: "
                         "security.tls_cert)",
    "draft_client_key": "target: key of draft_client_cert",
    "colocated_draft": "target: host the draft worker in this process and serve its DraftService on this port "
                       "(point the orchestrator's draft_address here): rounds call it directly, no exchange over "
                       "the network; one GPU for both, or draft_device",
    "draft_device": "target, with colocated_draft: the draft's device (empty = runtime.device)",
    "colocated_device_drafts": "target, with colocated_draft on the target's device: greedy drafts go from the "
                               "draft's propose to the verify on the device, one host synchronisation a round "
                               "(false: through the host, two)",
    "data_plane_port": "draft: TCP port of the per-round data plane beside gRPC, on server.host, with gRPC's TLS "
                       "settings (0 = pick a free one, advertised in GetStatus; -1 = off: rounds use the gRPC "
                       "stream)",
    "data_plane_poll_us": "draft and target: microseconds a data-plane reader polls for the next frame (the "
                          "draft: the next round; the target: the draft's answer) before it blocks; 0 = block at "
                          "once; -1 = auto: 2000 where the process may use 8 or more CPUs (its affinity, capped by a cgroup CPU "
                          "limit), else 0. Polling keeps a "
                          "core busy while it waits and spares each exchange the wake-up of a blocked thread",
    "cache.max_slots": "KV-cache request slots (concurrent requests)",
    "cache.max_len": "KV-cache positions per request (prompt + output + k)",
    "graphs.enabled": "allow CUDA-graph capture",
    "graphs.batch_buckets": "comma-separated ascending batch buckets captured as graphs",
    "graphs.prefill_graphs": "capture prefill graphs per prompt width (unset = on CUDA only; true = every "
                             "device; false = off; prompts are padded to the width)",
    "graphs.prefill_widths": "comma-separated ascending prompt widths captured as prefill graphs (longer prompts "
                             "run eagerly)",
    "graphs.round_ahead": "greedy speculative rounds whose drafts stay on the target's device (colocated_draft) "
                          "queue their next round before the host reads this one (unset = on CUDA only; true = "
                          "every device; false = off)",
    "graphs.prefill_tokens": "rows of the largest prefill graph: a width is captured at the batch buckets with "
                             "bucket x width <= this",
    "server.host": "listen address",
    "server.port": "listen port (0 = pick a free one; printed at start)",
    "server.metrics_port": "Prometheus HTTP port (unset = off, 0 = pick)",
    "server.max_message_bytes": "largest gRPC message accepted or sent",
    "server.max_workers": "gRPC handler threads",
    "security.tls_cert": "server certificate (PEM); enables TLS",
    "security.tls_key": "server private key (PEM)",
    "security.tls_client_ca": "CA bundle; require client certificates signed by it (mTLS)",
    "security.admin_token": "token required for admin/lifecycle RPCs (prefer the env var)",
    "security.checkpoint_roots": "comma-separated directories checkpoint paths must lie under",
    "security.generate_token": "generation-only token: Generate needs it (or the admin token); admin RPCs "
                               "presented with it get PERMISSION_DENIED (prefer the env var)",
    "security.admin_client_cns": "mTLS: comma-separated client-certificate common names allowed to call admin RPCs",
    "security.max_tensor_bytes": "largest tensor (data bytes) a request may carry",
    "security.admin_token_file": "where the admin token generated at start (no admin token or admin CNs set) is "
                                 "written, mode 0600 (unset = <runtime dir>/admin-<port>.token)",
    "security.allow_insecure": "serve plaintext on a non-loopback address (refused otherwise; warned at every "
                               "start; --allow-insecure)",
    "tls_client_cert": "client certificate shown to mTLS workers (default: security.tls_cert)",
    "tls_client_key": "private key of tls_client_cert (default: security.tls_key)",
    "draft_address_file": "file holding the draft's host:port, re-read every second; a new address there moves "
                          "the orchestrator to that draft",
    "shutdown_grace_s": "SIGTERM: seconds in-flight requests may take to finish before the orchestrator exits",
    "draft_address": "draft service host:port (unset = target-only serving)",
    "target_address": "target service host:port",
    "default_k": "drafts per round when a request does not say",
    "max_k": "largest k a request may ask for",
    "default_sampling_mode": "speculative rule of sampled requests that leave sampling_mode unset: rejection "
                             "(Leviathan, best acceptance) | coupled (a seed's tokens equal target-only decoding's)",
    "max_batch": "sequences per speculative round",
    "max_queue": "requests waiting for a batch slot before RESOURCE_EXHAUSTED",
    "stream_interval": "tokens a request's stream holds back before sending them (1: every round; larger: fewer, "
                       "bigger chunks and less host work per token; the first tokens and the last never wait)",
    "max_tokens_limit": "largest max_tokens a request may ask for",
    "max_prompt_tokens": "longest prompt accepted",
    "worker_timeout_s": "deadline (seconds) of every call to a worker",
    "tokenizer": "tokenizer: 'byte' or a model directory with tokenizer.json",
    "tls_ca": "CA bundle used to verify the workers' TLS certificates",
    "worker_admin_token": "admin token presented to the workers' lifecycle RPCs",
    "reload_call_timeout_s": "deadline (seconds) of each worker lifecycle call during a weight reload",
    "reload_wait_timeout_s": "WAIT policy: longest drain (seconds) of in-flight requests before the reload fails",
    "reload_rollback_wait_s": "rollback: seconds to wait for an unreachable (restarting) worker",
    "generate_wait_during_reload_s": "a Generate during a reload waits this long (seconds), then UNAVAILABLE with "
                                     "retry info; 0 = refuse at once",
    "push_staging_dir": "PushWeights staging root (workers must read it at the same path); unset = PushWeights off",
    "push_max_bytes": "largest PushWeights payload in tensor bytes",
    "push_keep_versions": "staged pushes kept on disk (the serving one and those a rollback may return to)",
    "http_port": "OpenAI-compatible HTTP API port on server.host (unset = off, 0 = pick; printed at start)",
    "http_model_name": "model id of the HTTP API (/v1/models; requests must name it in `model`)",
}


@dataclass(frozen=True)
class Option:
    key: str            # dotted path, e.g. "cache.max_slots"
    kind: str           # int | float | str | bool | ints | strs
    optional: bool
    default: Any

    @property
    def flag(self) -> str:
        return "--" + self.key.replace(".", "-").replace("_", "-")

    @property
    def env(self) -> str:
        return "SPECSPLIT_" + self.key.replace(".", "_").upper()

    @property
    def dest(self) -> str:
        return "cfg__" + self.key.replace(".", "__")


def _kind(type_str: str) -> tuple[str, bool]:
    t = type_str.replace(" ", "")
    optional = "None" in t
    t = t.replace("|None", "").replace("None|", "")
    kinds = {"int": "int", "float": "float", "str": "str", "bool": "bool",
             "tuple[int,...]": "ints", "tuple[str,...]": "strs"}
    if t not in kinds:
        raise TypeError(f"unsupported config field type {type_str!r}")
    return kinds[t], optional


def options(cls: type, prefix: str = "") -> list[Option]:
    """Every leaf field of a config dataclass tree, depth first."""
    out = []
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        nested = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if nested is not None and dataclasses.is_dataclass(nested):
            out.extend(options(nested, key + "."))
            continue
        kind, optional = _kind(str(f.type))
        default = f.default if f.default is not dataclasses.MISSING else None
        out.append(Option(key, kind, optional, default))
    return out


def _parse(opt: Option, raw: Any) -> Any:
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none") and opt.optional):
        return None
    try:
        if opt.kind == "bool":
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if s not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(raw)
            return s in ("1", "true", "yes", "on")
        if opt.kind == "int":
            return int(raw)
        if opt.kind == "float":
            return float(raw)
        if opt.kind == "str":
            return str(raw)
        items = raw if isinstance(raw, (list, tuple)) else [x for x in str(raw).split(",") if x.strip()]
        return tuple(int(x) for x in items) if opt.kind == "ints" else tuple(str(x).strip() for x in items)
    except (TypeError, ValueError):
        raise ConfigError(f"{opt.key}={raw!r} is invalid: expected {opt.kind}") from None


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per config field (default None so unset flags fall through to env/TOML)."""
    parser.add_argument("--config", type=Path, help="TOML configuration file")
    group = parser.add_argument_group("configuration (flag > SPECSPLIT_* env var > TOML > default)")
    for opt in options(cls):
        if opt.key in skip:
            continue
        helptext = f"{HELP.get(opt.key, opt.key)} [env {opt.env}; default {opt.default!r}]"
        if opt.kind == "bool":
            group.add_argument(opt.flag, dest=opt.dest, default=None, action=argparse.BooleanOptionalAction, help=helptext)
        else:
            metavar = {"int": "N", "float": "X", "str": "TEXT", "ints": "N,N,...", "strs": "A,B,..."}[opt.kind]
            group.add_argument(opt.flag, dest=opt.dest, default=None, metavar=metavar, help=helptext)


# SPECSPLIT_* variables that are not config fields: read by the CLI (client commands, logging),
# or by deploy/docker-compose.yml's interpolation. Everything else SPECSPLIT_* must be a field.
EXTRA_ENV = frozenset({"SPECSPLIT_CONFIG", "SPECSPLIT_LOG_LEVEL", "SPECSPLIT_ADDRESS", "SPECSPLIT_TOKEN",
                       "SPECSPLIT_ENV_FILE", "SPECSPLIT_IMAGE", "SPECSPLIT_PORT", "SPECSPLIT_METRICS_PORT",
                       # where generated admin-token files live / which one the CLI reads (core.admin_token)
                       "SPECSPLIT_RUNTIME_DIR", "SPECSPLIT_TOKEN_FILE",
                       # deploy/docker-compose.yml: the target's --tp (tensor-parallel ranks)
                       "SPECSPLIT_TARGET_TP"})


def _closest(name: str, candidates: dict[str, str]) -> str:
    """' (did you mean X?)' for the candidate form nearest to ``name``; candidates: form -> shown text."""
    hit = difflib.get_close_matches(name.lower(), list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {candidates[hit[0]]}?)" if hit else ""


def known_env(trees: tuple[type, ...]) -> frozenset[str]:
    """Every SPECSPLIT_* variable the given config trees read, + EXTRA_ENV. The caller names all
    the services' trees (``specsplit.configs.SERVICE_CONFIGS``), not only its own: ``specsplit up``
    and compose share one environment. (This module sits below the services and cannot list them.)"""
    return EXTRA_ENV | {o.env for cls in trees for o in options(cls)}


def check_env(env: dict[str, str] | os._Environ, trees: tuple[type, ...]) -> None:
    """An unknown SPECSPLIT_* variable is a ConfigError naming it and the closest valid one."""
    known = known_env(trees)
    for name in sorted(env):
        if name.startswith("SPECSPLIT_") and name not in known:
            raise ConfigError(f"unknown environment variable {name}"
                              f"{_closest(name[10:], {k[10:].lower(): k for k in known})}")


def check_toml(data: dict[str, Any], cls: type, path: Any) -> None:
    """An unknown table or key in a TOML file is a ConfigError naming it and the closest valid one."""
    keys = {o.key for o in options(cls)}
    tables = {k.rpartition(".")[0] for k in keys if "." in k}
    shown = {**{k: (f"[{k.rpartition('.')[0]}] {k.rpartition('.')[2]}" if "." in k else k) for k in keys},
             **{t: f"[{t}]" for t in tables}}
    forms = {**{k.lower(): shown[k] for k in shown}, **{k.replace(".", "_"): shown[k] for k in keys}}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for name, value in node.items():
            full = prefix + name
            if full in tables and isinstance(value, dict):
                walk(value, full + ".")
            elif full not in keys:
                what = f"table [{full}]" if isinstance(value, dict) else (
                    f"key {name!r} in table [{prefix[:-1]}]" if prefix else f"key {name!r}")
                raise ConfigError(f"unknown {what} in config file {path}{_closest(full, forms)}")

    walk(data, "")


def _toml_lookup(data: dict[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def build(cls: type, args: argparse.Namespace | None, env: dict[str, str] | None = None,
          overrides: dict[str, Any] | None = None, *, trees: tuple[type, ...] = ()) -> Any:
    """Construct ``cls`` from overrides > flags > env > TOML > defaults. ``trees``: the other
    config trees sharing the environment (their SPECSPLIT_* variables are not unknown here)."""
    env = os.environ if env is None else env
    toml: dict[str, Any] = {}
    path = getattr(args, "config", None) if args is not None else None
    if path is None and env.get("SPECSPLIT_CONFIG"):
        path = Path(env["SPECSPLIT_CONFIG"])
    if path is not None:
        try:
            toml = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        check_toml(toml, cls, path)
    check_env(env, (cls, *trees))
    values: dict[str, Any] = {}
    for opt in options(cls):
        raw: Any = None
        if overrides and opt.key in overrides:
            values[opt.key] = overrides[opt.key]
            continue
        flag_val = getattr(args, opt.dest, None) if args is not None else None
        if flag_val is not None:
            raw = flag_val
        elif opt.env in env:
            raw = env[opt.env]
        else:
            raw = _toml_lookup(toml, opt.key)
        if raw is not None:
            values[opt.key] = _parse(opt, raw)
    return _construct(cls, values, "")


def _construct(cls: type, values: dict[str, Any], prefix: str) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        nested = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if nested is not None and dataclasses.is_dataclass(nested):
            kwargs[f.name] = _construct(nested, values, key + ".")
        elif key in values:
            kwargs[f.name] = values[key]
        elif f.default is dataclasses.MISSING:
            kwargs[f.name] = None
    return cls(**kwargs)


def reference_markdown(sections: list[tuple[str, type]]) -> str:
    """The configuration reference, generated from the dataclasses (docs/configuration.md)."""
    lines = ["# Configuration reference", "",
             "Generated by `specsplit config-reference` from the config dataclasses (`worker/config.py`, "
             "`orchestrator/config.py`, `runtime/config.py`, `core/config.py`); do not edit by hand.",
             "Every setting can be given as a flag, a `SPECSPLIT_*` environment variable or a key in the",
             "TOML file named by `--config` (or `SPECSPLIT_CONFIG`). Precedence: flag > env > TOML > default.",
             "Lists are comma-separated in flags and env vars, arrays in TOML. An unknown TOML table or key,",
             "or an unknown `SPECSPLIT_*` variable, stops the service with an error naming the closest valid one.",
             ""]
    for title, cls in sections:
        lines += [f"## {title}", "", "| flag | env var | TOML key | default | meaning |", "| --- | --- | --- | --- | --- |"]
        for opt in options(cls):
            table, _, leaf = opt.key.rpartition(".")
            toml_key = f"[{table}] {leaf}" if table else leaf
            lines.append(f"| `{opt.flag}` | `{opt.env}` | `{toml_key}` | `{opt.default!r}` | {HELP.get(opt.key, '')} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `specsplit config-reference`")
