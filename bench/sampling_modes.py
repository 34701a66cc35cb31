"""``specsplit bench sampling-modes``: acceptance of rejection vs coupled speculative sampling.

Owns: one in-process engine, the held-out prompts decoded at batch 1 with
seeded sampling at each temperature in ``--temperatures`` and each of
rejection (greedy drafts), rejection (sampled drafts: ``draft_sampling``) and
coupled; prints acceptance rate, tokens per round and tokens/s of each, and
checks that the coupled tokens equal target-only (k=0) decoding of the same
seeds. The in-process engine runs the same round driver and engines as the
services, so the acceptance figures are the services' too.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.engine import TINY, decode_all, heldout_prompts
from core.params import SamplingParams
from runtime.config import CacheConfig, EngineConfig, GraphConfig, RuntimeConfig, SpecConfig
from runtime.engine import SpecEngine
from runtime.tokenizer import ByteTokenizer

MODES = {"rejection (greedy draft)": dict(sampling_mode="rejection"),
         "rejection (sampled draft)": dict(sampling_mode="rejection", draft_sampling=True),
         "coupled": dict(sampling_mode="coupled")}


def _decode(engine: SpecEngine, prompts, max_tokens: int, k: int, temperature: float, mode: dict):
    """Every prompt at batch 1, prompt i seeded 1000 + i: (outputs, seconds, merged stats)."""
    return decode_all(engine, prompts, max_tokens, k, params_for=lambda i: SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=temperature, seed=1000 + i, **mode))


def main(args) -> int:
    model = Path(args.model) if args.model else TINY
    k = args.k
    engine = SpecEngine(EngineConfig(str(model), runtime=RuntimeConfig(backend=args.backend, device=args.device),
                                     spec=SpecConfig(max_k=k, default_k=k), cache=CacheConfig(max_slots=4, max_len=1024),
                                     graphs=GraphConfig(batch_buckets=(1,))))
    tok = ByteTokenizer()
    prompts = [tok.encode(p) for p in heldout_prompts(args.prompts, model)]
    _decode(engine, prompts[:1], 8, k, 1.0, MODES["coupled"])                  # warm-up
    rows = []
    for temperature in args.temperatures:
        alone, _, _ = _decode(engine, prompts, args.max_tokens, 0, temperature, MODES["coupled"])
        for name, mode in MODES.items():
            outs, secs, st = _decode(engine, prompts, args.max_tokens, k, temperature, mode)
            rows.append({"temperature": temperature, "mode": name, "k": k,
                         "acceptance": round(st.acceptance_rate, 3),
                         "tokens_per_round": round(st.mean_accepted_length, 3),
                         "per_position": [round(x, 3) for x in st.per_position()],
                         "tok_s": round(sum(len(o) for o in outs) / secs, 1),
                         "same_as_target_only": (outs == alone) if name == "coupled" else None})
    if args.json:
        print(json.dumps({"backend": args.backend, "device": args.device, "prompts": len(prompts),
                          "max_tokens": args.max_tokens, "rows": rows}))
    else:
        print(f"{args.backend} {args.device}, {len(prompts)} prompts x {args.max_tokens} tokens, k={k}, batch 1")
        print(f"{'T':>4}  {'mode':<26} {'acceptance':>10} {'tokens/round':>12} {'tok/s':>7}  coupled == k=0")
        for r in rows:
            same = "" if r["same_as_target_only"] is None else str(r["same_as_target_only"])
            print(f"{r['temperature']:>4}  {r['mode']:<26} {r['acceptance']:>10.3f} {r['tokens_per_round']:>12.3f} "
                  f"{r['tok_s']:>7.1f}  {same}")
    return 0 if all(r["same_as_target_only"] is not False for r in rows) else 1
