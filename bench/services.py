"""``specsplit bench services``: speculative vs target-only decoding through the gRPC services.

Owns: starting one stack (draft, target, orchestrator as separate processes
on loopback, metrics on), then for each batch size decoding the same
held-out prompts twice — k=0 (target-only) and k — with that many concurrent
clients, side by side; tokens/s of both, the speedup, identical greedy
output, and the per-round time split read from the orchestrator's
Prometheus metrics (draft compute, target compute, everything else).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.engine import TINY, heldout_prompts
from orchestrator.client import SpecsplitClient
from specsplit.launcher import Stack, StackOptions
from specsplit.progress import progress

_SAMPLE = re.compile(r'^specsplit_round_seconds_(sum|count)\{part="(\w+)"\} ([0-9.e+-]+)$')


def round_split(metrics_port: int) -> dict[str, float]:
    """Cumulative (sum, count) of round time per part from the orchestrator's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[f"{m.group(2)}_{m.group(1)}"] = float(m.group(3))
    return out


def _decode(address: str, prompts: list[str], max_tokens: int, k: int, concurrency: int):
    def one(p: str):
        with SpecsplitClient(address, timeout=600) as c:
            return c.generate_text(p, max_tokens=max_tokens, k=k, ignore_eos=True)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    return results, time.perf_counter() - t0


def _per_round_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    rounds = after.get("total_count", 0) - before.get("total_count", 0)
    if rounds <= 0:
        return {}
    return {part: round(1e3 * (after.get(f"{part}_sum", 0) - before.get(f"{part}_sum", 0)) / rounds, 3)
            for part in ("draft", "target", "overhead", "total")} | {"rounds": int(rounds)}


def main(args) -> int:
    model = Path(args.model) if args.model else TINY
    batches = args.batch or [1, 16]
    opts = StackOptions(model=str(model), backend=args.backend, draft_device=args.device, target_device=args.device,
                        k=args.k, max_batch=max(batches), metrics=True, log_level="WARNING")
    rows = []
    with Stack(opts) as stack:
        address = stack.orchestrator_address
        mport = stack.children["orchestrator"].metrics_port
        for batch in progress(batches, desc="bench services", unit="batch size"):
            n = max(batch, args.prompts) if batch > 1 else args.prompts
            prompts = (heldout_prompts(64, model) * 4)[:n]
            _decode(address, prompts[:batch], 8, args.k, batch)            # warm-up
            m0 = round_split(mport)
            ref, t_ref = _decode(address, prompts, args.max_tokens, 0, batch)
            m1 = round_split(mport)
            spec, t_spec = _decode(address, prompts, args.max_tokens, args.k, batch)
            m2 = round_split(mport)
            toks_ref = sum(len(r.tokens) for r in ref)
            toks_spec = sum(len(r.tokens) for r in spec)
            drafted = sum(r.drafted for r in spec)
            rows.append({
                "batch": batch, "requests": n, "k": args.k,
                "tokens_per_s_target": round(toks_ref / t_ref, 2), "tokens_per_s_spec": round(toks_spec / t_spec, 2),
                "speedup": round((toks_spec / t_spec) / (toks_ref / t_ref), 3),
                "identical": [r.tokens for r in ref] == [r.tokens for r in spec],
                "acceptance_rate": round(sum(r.accepted for r in spec) / drafted, 4) if drafted else 0.0,
                "round_ms_target_only": _per_round_ms(m0, m1), "round_ms_spec": _per_round_ms(m1, m2),
            })
    result = {"backend": args.backend, "device": args.device, "max_tokens": args.max_tokens, "rows": rows}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"bench services: backend={args.backend} device={args.device} k={args.k} max_tokens={args.max_tokens} "
          f"(three processes on loopback)")
    print(f"{'batch':>5s} {'spec tok/s':>10s} {'target tok/s':>12s} {'speedup':>8s} {'identical':>9s} {'accept':>7s}  "
          f"round ms spec: draft / target / overhead / total")
    for r in rows:
        s = r["round_ms_spec"]
        print(f"{r['batch']:5d} {r['tokens_per_s_spec']:10.1f} {r['tokens_per_s_target']:12.1f} {r['speedup']:8.2f} "
              f"{str(r['identical']):>9s} {r['acceptance_rate']:7.3f}  "
              f"{s.get('draft', 0):.2f} / {s.get('target', 0):.2f} / {s.get('overhead', 0):.2f} / {s.get('total', 0):.2f}")
        t = r["round_ms_target_only"]
        print(f"{'':5s} target-only round ms: target / overhead / total = "
              f"{t.get('target', 0):.2f} / {t.get('overhead', 0):.2f} / {t.get('total', 0):.2f}")
    return 0
