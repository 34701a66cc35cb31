"""``specsplit bench peer``: specsplit next to what a user has without it, same weights, one run (GPU).

Owns: for each model (the bundled tiny model in float32; a ~1B random
bf16 config — ``bench graphs``' d=2048, 16 layers — written to a temporary
checkpoint) and each batch size (1 and 8), greedy decoding of the same
prompts (equal length, no padding) by
  - the peer: transformers ``generate`` with ``cache_implementation="static"``
    (transformers compiles the decode step itself for a static cache),
  - the in-process engine (graphs captured): target-only and k drafts,
  - the services (draft, target, orchestrator as processes on loopback,
    through the public client): target-only and k drafts, with the round
    split (draft / target / overhead) from the orchestrator's metrics; with
    ``--colocated-draft`` also k drafts with the draft in the target's process,
  - the memory-bandwidth floor: weight bytes / measured device copy rate
    (bytes read + written), times the batch (one weight pass per step),
and prints tokens/s and ratios to the peer. ``ident``: speculative output
equals target-only output within the engine and within the services (the
lossless check); the services' target-only output is also compared with the
engine's (``services_equal_engine``: equal in fp32; in bf16 different batch
shapes may round a near-tie of a random model differently).

transformers is installed (pip) only when missing; it is never a serving
dependency. Our checkpoints use the Hugging Face Llama names, so the peer is
a ``LlamaForCausalLM`` built from a ``LlamaConfig`` made from our
``ModelConfig`` with our tensors loaded into it.

Must not know: the services' internals (it starts them with the launcher
and talks to the orchestrator's public API only).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.engine import TINY, heldout_prompts
from bench.graphs import BIG
from runtime.checkpoint import save_safetensors, save_target
from core.params import SamplingParams
from runtime.config import CacheConfig, EngineConfig, GraphConfig, ModelConfig, RuntimeConfig, SpecConfig
from runtime.model import mtp_tensor_shapes, target_tensor_shapes
from runtime.tokenizer import ByteTokenizer
from runtime.weights import check_target, read_arrays

PROMPT_LEN = 32


def _ensure_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "transformers"], check=True)
    import transformers

    return transformers


def write_random_1b(root: Path, cfg: ModelConfig = BIG) -> Path:
    """A random ~1B target + MTP in bf16 (timing only)."""
    rng = np.random.default_rng(0)
    shapes = {**target_tensor_shapes(cfg), **mtp_tensor_shapes(cfg)}
    tensors = {n: (np.ones(s, np.float32) if len(s) == 1 else rng.standard_normal(s, dtype=np.float32) * 0.02)
               for n, s in shapes.items()}
    save_target(root, cfg, {n: t for n, t in tensors.items() if not n.startswith("mtp.")}, dtype="bfloat16")
    save_safetensors(root / "mtp.safetensors", {n: t for n, t in tensors.items() if n.startswith("mtp.")},
                     dtype="bfloat16")
    return root


def _prompts(model_dir: Path, cfg: ModelConfig, n: int) -> list[list[int]]:
    if model_dir == TINY:
        tok = ByteTokenizer()
        texts = (heldout_prompts(64, model_dir) * 4)[:n]
        return [(tok.encode(t) * 8)[:PROMPT_LEN] for t in texts]
    rng = np.random.default_rng(1)
    return [rng.integers(0, cfg.vocab_size, PROMPT_LEN).tolist() for _ in range(n)]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _copy_rate(device: str) -> float:
    """Device-to-device copy, bytes read + written per second (median of 20 over 1 GiB)."""
    import torch

    x = torch.empty(1 << 30 if device.startswith("cuda") else 1 << 26, dtype=torch.uint8, device=device).random_(0, 255)
    y = torch.empty_like(x)
    times = []
    for _ in range(23):
        _sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        _sync(device)
        times.append(time.perf_counter() - t0)
    n = x.numel()
    del x, y
    return 2 * n / float(np.median(times[3:]))


def run_peer(model_dir: Path, cfg: ModelConfig, dtype: str, device: str, prompts, max_new: int, batch: int):
    """transformers static-cache greedy generate; returns (outputs, seconds of the timed run)."""
    _ensure_transformers()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    hf = {k: v for k, v in cfg.to_hf_dict().items() if k != "torch_dtype"}
    model = LlamaForCausalLM(LlamaConfig(**hf)).to(dtype=tdt)
    state = {n: torch.from_numpy(a) for n, a in read_arrays(check_target(model_dir)).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"peer weights: missing {missing}, unexpected {unexpected}")
    model = model.to(device).eval()
    outs, seconds = [], 0.0
    kw = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, cache_implementation="static",
              pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        ids = torch.tensor(prompts[:batch], device=device)
        model.generate(ids, attention_mask=torch.ones_like(ids), **kw)         # warm-up: compiles the decode step
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i: i + batch], device=device)
            _sync(device)
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            _sync(device)
            seconds += time.perf_counter() - t0
            outs += [tuple(int(t) for t in row[ids.shape[1]:]) for row in out.tolist()]
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return outs, seconds


def run_engine(model_dir: Path, dtype: str, device: str, prompts, max_new: int, batch: int, k: int,
               compile_steps: bool = False):
    """In-process engine with graphs; returns {k_value: (outputs, seconds, stats)} for 0 and k."""
    from runtime.engine import GenRequest, SpecEngine
    from runtime.round_driver import SeqStats

    engine = SpecEngine(EngineConfig(str(model_dir), runtime=RuntimeConfig(backend="torch", device=device, dtype=dtype,
                                                                        compile=compile_steps),
                                     spec=SpecConfig(max_k=k, default_k=k),
                                     cache=CacheConfig(max_slots=batch, max_len=PROMPT_LEN + max_new + k + 8),
                                     graphs=GraphConfig(batch_buckets=tuple(sorted({1, batch})))))
    if device.startswith("cuda"):
        engine.capture_graphs()
    res = {}
    for kk in (0, k):
        params = SamplingParams(max_tokens=max_new, ignore_eos=True)
        engine.generate([GenRequest("w", tuple(prompts[0]), SamplingParams(max_tokens=8, ignore_eos=True), kk)])
        outs, stats, seconds = [], SeqStats(), 0.0
        for i in range(0, len(prompts), batch):
            reqs = [GenRequest(f"r{i + j}", tuple(p), params, kk) for j, p in enumerate(prompts[i: i + batch])]
            engine.ops.synchronize()
            t0 = time.perf_counter()
            got = engine.generate(reqs, max_batch=batch)
            seconds += time.perf_counter() - t0
            outs += [g.tokens for g in got]
            for g in got:
                stats.merge(g.stats)
        res[kk] = (outs, seconds, stats)
    return res


def run_services(model_dir: Path, dtype: str, device: str, draft_device: str, prompts, max_new: int, batch: int,
                 k: int, compile_steps: bool = False, colocated: bool = False, ks: tuple[int, ...] | None = None):
    """The three services on loopback through the public client (``colocated``: two, the draft in the
    target's process): {k_value: (outputs, seconds, split, acceptance)} for ``ks`` (default 0 and k)."""
    from bench.services import _decode, _per_round_ms, round_split
    from specsplit.launcher import Stack, StackOptions

    opts = StackOptions(model=str(model_dir), backend="torch", draft_device=draft_device, target_device=device, k=k,
                        max_batch=batch, metrics=True, log_level="WARNING", max_slots=batch,
                        max_len=PROMPT_LEN + max_new + k + 8, extra_env={"SPECSPLIT_RUNTIME_DTYPE": dtype,
                                               "SPECSPLIT_RUNTIME_COMPILE": "1" if compile_steps else "0"},
                        colocated_draft=colocated)
    res = {}
    with Stack(opts) as stack:
        address, mport = stack.orchestrator_address, stack.children["orchestrator"].metrics_port
        for kk in ks or (0, k):
            _decode(address, prompts[:batch], 8, kk, batch)                              # warm-up
            m0 = round_split(mport)
            got, seconds = _decode(address, prompts, max_new, kk, batch)
            res[kk] = ([tuple(g.tokens) for g in got], seconds, _per_round_ms(m0, round_split(mport)),
                       sum(g.accepted for g in got) / max(1, sum(g.drafted for g in got)))
    return res


def bench_model(name: str, model_dir: Path, dtype: str, device: str, draft_device: str, batches, n_prompts: int,
                max_new: int, k: int, skip_peer: bool, compile_steps: bool = False,
                colocated: bool = False) -> list[dict]:
    import torch
    from bench.services import in_rounds

    cfg = check_target(model_dir).cfg
    weight_bytes = sum(int(np.prod(s)) for s in target_tensor_shapes(cfg).values()) * (2 if dtype == "bfloat16" else 4)
    rate = _copy_rate(device)
    rows = []
    for batch in batches:
        prompts = _prompts(model_dir, cfg, max(n_prompts, batch) // batch * batch)
        n_tokens = len(prompts) * max_new
        row = {"model": name, "dtype": dtype, "batch": batch, "k": k, "prompts": len(prompts), "max_new": max_new,
               "floor_tok_s": round(batch * rate / weight_bytes, 1), "copy_rate_TBps": round(rate / 1e12, 3)}
        eng = run_engine(model_dir, dtype, device, prompts, max_new, batch, k, compile_steps)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        ref = eng[0][0]
        row["engine_target_tok_s"] = round(n_tokens / eng[0][1], 1)
        row["engine_spec_tok_s"] = round(n_tokens / eng[k][1], 1)
        row["engine_acceptance"] = round(eng[k][2].acceptance_rate, 4)
        row["engine_identical"] = eng[k][0] == ref
        svc = run_services(model_dir, dtype, device, draft_device, prompts, max_new, batch, k, compile_steps)
        row["services_target_tok_s"] = round(n_tokens / svc[0][1], 1)
        row["services_spec_tok_s"] = round(n_tokens / svc[k][1], 1)
        row["services_acceptance"] = round(svc[k][3], 4)
        # Lossless check within the services (spec == target-only), and the services'
        # target-only against the engine's: the latter compares different batch
        # shapes (requests join one by one there), so in bf16 it can differ at
        # near-ties of a random model without any loss of exactness.
        row["services_identical"] = svc[k][0] == svc[0][0]
        row["services_equal_engine"] = svc[0][0] == ref
        row["round_ms_spec"] = svc[k][2]
        row["services_spec_in_rounds"] = in_rounds(svc[k][2], svc[k][1])     # the rest: between rounds
        row["round_ms_target_only"] = svc[0][2]
        if colocated:                   # the same services, the draft in the target's process
            col = run_services(model_dir, dtype, device, draft_device, prompts, max_new, batch, k, compile_steps,
                               colocated=True, ks=(k,))
            row["colocated_spec_tok_s"] = round(n_tokens / col[k][1], 1)
            row["colocated_identical"] = col[k][0] == svc[0][0]
            row["round_ms_colocated"] = col[k][2]
        if not skip_peer:
            outs, seconds = run_peer(model_dir, cfg, dtype, device, prompts, max_new, batch)
            row["peer_tok_s"] = round(n_tokens / seconds, 1)
            row["peer_token_match"] = round(float(np.mean([a == b for o, r in zip(outs, ref)
                                                           for a, b in zip(o, r)])), 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _ratio(x, y) -> str:
    return f"x{x / y:.2f}" if x and y else "-"


def main(args) -> int:
    import torch

    device = args.device
    draft_device = "cuda:1" if device.startswith("cuda") and torch.cuda.device_count() > 1 else device
    batches = args.batch or [1, 8]
    rows = []
    if args.small and args.large:
        raise SystemExit("bench peer: --small (the bundled model only) and --large (the ~1B config only) exclude each other")
    which = [] if args.large else [("tiny", TINY, "float32")]
    if not args.small:
        which.append(("1b", None, "bfloat16"))
    with tempfile.TemporaryDirectory() as tmp:
        for name, path, dtype in which:
            if path is None:
                path = write_random_1b(Path(tmp) / "1b")
            rows += bench_model(name, path, dtype, device, draft_device, batches, args.prompts, args.max_tokens,
                                args.k, skip_peer=False, compile_steps=args.compile,
                                colocated=getattr(args, "colocated_draft", False))
    if args.json:
        print(json.dumps({"device": device, "draft_device": draft_device, "rows": rows}))
        return 0
    print(f"\nbench peer: target {device}, draft {draft_device}, k={args.k}, {args.max_tokens} new tokens per prompt, "
          f"prompts of {PROMPT_LEN} tokens; runtime.compile {'on' if args.compile else 'off'}; "
          "tokens/s (ratio to the transformers static-cache peer)")
    print(f"{'model':5s} {'B':>2s} {'peer':>8s} {'eng k=0':>15s} {'eng k':>15s} {'svc k=0':>15s} {'svc k':>15s} "
          f"{'floor':>16s} {'accept':>6s} {'ident':>5s}  svc round ms draft/target/overhead, in rounds")
    for r in rows:
        p = r.get("peer_tok_s", 0)
        s = r["round_ms_spec"]
        print(f"{r['model']:5s} {r['batch']:2d} {p:8.1f} "
              + " ".join(f"{r[c]:8.1f} {_ratio(r[c], p):>6s}" for c in ("engine_target_tok_s", "engine_spec_tok_s",
                                                                         "services_target_tok_s", "services_spec_tok_s"))
              + f" {r['floor_tok_s']:9.1f} {_ratio(r['floor_tok_s'], p):>6s} {r['engine_acceptance']:6.3f} "
              f"{str(r['engine_identical'] and r['services_identical']):>5s}  "
              f"{s.get('draft', 0):.2f}/{s.get('target', 0):.2f}/{s.get('overhead', 0):.2f}, "
              f"{r['services_spec_in_rounds']:.2f}")
        if "colocated_spec_tok_s" in r:
            c, colo = r["round_ms_colocated"], r["colocated_spec_tok_s"]
            print(f"{'':5s} {'':2s} {'':8s} svc k, draft in the target's process: {colo:8.1f} {_ratio(colo, p):>6s} "
                  f"({_ratio(colo, r['services_spec_tok_s'])} the draft service), "
                  f"identical {r['colocated_identical']}, round ms "
                  f"{c.get('draft', 0):.2f}/{c.get('target', 0):.2f}/{c.get('overhead', 0):.2f}")
    return 0
