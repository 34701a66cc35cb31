"""``specsplit bench engine``: in-process speculative vs target-only greedy decoding.

Owns: one process, one model, the same held-out prompts decoded twice at
batch 1 (target-only k=0, then speculative k), timing both side by side and
checking that the outputs are identical. Prints tokens/s of each, the
speedup, acceptance rate, mean accepted length and per-position acceptance.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from core.params import SamplingParams
from runtime.config import CacheConfig, EngineConfig, GraphConfig, RuntimeConfig, SpecConfig
from runtime.engine import GenRequest, SpecEngine
from runtime.round_driver import SeqStats
from runtime.tokenizer import ByteTokenizer
from core.progress import progress

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "models" / "tiny"


def heldout_prompts(n: int, model_dir: Path = TINY) -> list[str]:
    prompts = json.loads((model_dir / "heldout_prompts.json").read_text())
    return prompts[:n]


def decode_all(engine: SpecEngine, prompts: list[list[int]], max_tokens: int, k: int, desc: str | None = None,
               params_for: Callable[[int], SamplingParams] | None = None):
    """Batch-1 decoding of every prompt; returns (outputs, seconds, merged stats). ``desc``: show
    a progress bar (stderr) under that name; ``params_for(i)``: prompt i's sampling parameters
    (default: greedy, ``max_tokens``, EOS ignored)."""
    outs, stats = [], SeqStats()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts if desc is None else progress(prompts, desc=desc, unit="prompt")):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True) if params_for is None else params_for(i)
        res = engine.generate([GenRequest(f"b{i}", tuple(p), params, k)])[0]
        outs.append(res.tokens)
        stats.merge(res.stats)
    return outs, time.perf_counter() - t0, stats


def main(args) -> int:
    model = Path(args.model) if args.model else TINY
    k = args.k
    cfg = EngineConfig(str(model), runtime=RuntimeConfig(backend=args.backend, device=args.device),
                       spec=SpecConfig(max_k=k, default_k=k), cache=CacheConfig(max_slots=4, max_len=1024),
                       graphs=GraphConfig(batch_buckets=(1,)))
    engine = SpecEngine(cfg)
    if args.device.startswith("cuda"):
        engine.capture_graphs()
    tok = ByteTokenizer()
    prompts = [tok.encode(p) for p in heldout_prompts(args.prompts, model)]
    # Warm-up both paths (allocator, kernel selection) outside the timed region.
    decode_all(engine, prompts[:1], 8, 0)
    decode_all(engine, prompts[:1], 8, k)
    ref, t_ref, _ = decode_all(engine, prompts, args.max_tokens, 0, desc="target-only")
    spec, t_spec, stats = decode_all(engine, prompts, args.max_tokens, k, desc=f"speculative k={k}")
    n_tokens = sum(len(o) for o in spec)
    result = {
        "backend": args.backend, "device": args.device, "k": k, "prompts": len(prompts), "max_tokens": args.max_tokens,
        "identical": ref == spec,
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "acceptance_per_position": [round(x, 4) for x in stats.per_position()],
        "tokens_per_s_target": round(sum(len(o) for o in ref) / t_ref, 2),
        "tokens_per_s_spec": round(n_tokens / t_spec, 2),
        "speedup": round(t_ref / t_spec, 3),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"bench engine: backend={args.backend} device={args.device} k={k} prompts={len(prompts)} max_tokens={args.max_tokens}")
    print(f"  target-only   {result['tokens_per_s_target']:8.1f} tokens/s")
    print(f"  speculative   {result['tokens_per_s_spec']:8.1f} tokens/s   speedup x{result['speedup']:.2f}")
    print(f"  acceptance    {result['acceptance_rate']:.3f}   per position {result['acceptance_per_position']}")
    print(f"  tokens/round  {result['mean_accepted_length']:.3f}")
    print(f"  identical     {result['identical']}")
    return 0
