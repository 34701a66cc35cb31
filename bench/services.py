"""``specsplit bench services``: speculative vs target-only decoding through the gRPC services.

Owns: for each variant of the target's round loop (``fixed``: k drafts every
round; ``ahead``: ahead drafting; ``adaptive``: adaptive k; ``ahead+adaptive``;
``micro``: two micro-batches overlapped; ``micro+adaptive``; ``colocated``: the draft in the
target's process, alone or with ``ahead``, ``adaptive`` or ``micro``; ``colocated+host-drafts``:
its drafts through the host, ``colocated_device_drafts`` off; ``colocated+no-round-ahead``: no
round queued ahead, ``graphs.round_ahead`` off), each target
TP size (``--tp``), each orchestrator ``stream_interval`` (``--stream-interval``) and
each workers' ``data_plane_poll_us`` (``--poll-us``)
one stack (draft, target, orchestrator as separate processes on loopback,
metrics on), then for each batch size decoding the same held-out prompts
twice — k=0 (target-only) and k — with that many concurrent clients, side by
side; tokens/s of both, the speedup, identical greedy output (within the
stack and against the first variant's target-only run), how often ahead
drafts were used, how many speculative rounds queued ahead the next round used (the target's
``specsplit_target_queued_ahead_total``), and the per-round time split read from the orchestrator's
Prometheus metrics (draft compute, target compute, everything else — for
the round loop in the target that is the draft exchange's transport and the
host work).
"""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.engine import TINY, heldout_prompts
from orchestrator.client import SpecsplitClient
from specsplit.launcher import Stack, StackOptions
from core.progress import progress

_SAMPLE = re.compile(r'^specsplit_round_seconds_(sum|count)\{part="(\w+)"\} ([0-9.e+-]+)$')
_POSITION = re.compile(r'^specsplit_position_drafted_total\{position="(\d+)"\} ([0-9.e+-]+)$')
_FIRST = re.compile(r'^specsplit_time_to_first_token_seconds_(sum|count) ([0-9.e+-]+)$')
VARIANTS = ("fixed", "ahead", "adaptive", "ahead+adaptive", "micro", "micro+adaptive", "colocated", "colocated+ahead",
            "colocated+adaptive", "colocated+micro", "colocated+host-drafts", "colocated+no-round-ahead")


def _metrics_text(port: int) -> str:
    """A service's Prometheus text (its /metrics on loopback)."""
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def round_split(metrics_port: int) -> dict[str, float]:
    """Cumulative (sum, count) of round time per part from the orchestrator's /metrics, and the
    request-rounds that drafted at each position j (``drafted_j``: at batch 1, the rounds whose k >= j)."""
    text = _metrics_text(metrics_port)
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[f"{m.group(2)}_{m.group(1)}"] = float(m.group(3))
        elif (m := _POSITION.match(line)):
            out[f"drafted_{m.group(1)}"] = float(m.group(2))
        elif (m := _FIRST.match(line)):
            out[f"first_token_{m.group(1)}"] = float(m.group(2))
    return out


_QUEUED = re.compile(r'^specsplit_target_queued_ahead_total\{kind="round",outcome="(\w+)"\} ([0-9.e+]+)$')


def queued_ahead(text: str) -> dict[str, float]:
    """outcome -> count of the speculative rounds queued ahead (launched, used, dropped:
    runtime/round_ahead.py) in a target's Prometheus text."""
    return {m.group(1): float(m.group(2)) for line in text.splitlines() if (m := _QUEUED.match(line))}


def rounds_ahead(metrics_port: int | None) -> dict[str, float]:
    """``queued_ahead`` of the target's /metrics now; {} without a port."""
    return queued_ahead(_metrics_text(metrics_port)) if metrics_port else {}


def _ahead_delta(before: dict[str, float], after: dict[str, float]) -> str:
    """used/launched (dropped) of the rounds queued ahead between two ``rounds_ahead`` readings."""
    d = {k: int(after.get(k, 0) - before.get(k, 0)) for k in ("launched", "used", "dropped")}
    return f"{d['used']}/{d['launched']} ({d['dropped']} dropped)"


def first_token_ms(before: dict[str, float], after: dict[str, float]) -> float:
    """Mean time to first token (ms) of the requests between two ``round_split`` readings."""
    n = after.get("first_token_count", 0) - before.get("first_token_count", 0)
    return round(1e3 * (after.get("first_token_sum", 0) - before.get("first_token_sum", 0)) / n, 2) if n > 0 else 0.0


def _decode(address: str, prompts: list[str], max_tokens: int, k: int, concurrency: int, fixed_k: bool = False):
    """Decode ``prompts`` with ``concurrency`` clients at once. Each client keeps its channel for
    all the requests it sends, as a serving client does (a channel opened per request cost
    ~1–3 ms a request on the 2-core CPU, a cost the in-process peer never pays). ``fixed_k``: the
    requests draft k every round where the server adapts k."""
    clients = [SpecsplitClient(address, timeout=600).wait_ready(60) for _ in range(concurrency)]
    free: queue.SimpleQueue = queue.SimpleQueue()
    for c in clients:
        free.put(c)

    def one(p: str):
        c = free.get()
        try:
            return c.generate_text(p, max_tokens=max_tokens, k=k, ignore_eos=True, fixed_k=fixed_k)
        finally:
            free.put(c)

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, prompts))
        return results, time.perf_counter() - t0
    finally:
        for c in clients:
            c.close()


def _per_round_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    rounds = after.get("total_count", 0) - before.get("total_count", 0)
    if rounds <= 0:
        return {}
    return {part: round(1e3 * (after.get(f"{part}_sum", 0) - before.get(f"{part}_sum", 0)) / rounds, 3)
            for part in ("draft", "target", "overhead", "total")} | {"rounds": int(rounds)}


def in_rounds(split: dict, seconds: float) -> float:
    """The share of a decode's wall time spent inside rounds (the rest: admission, prefill, the
    requests' start and end, the loop's work between rounds)."""
    return round(split.get("rounds", 0) * split.get("total", 0) / 1e3 / seconds, 3) if seconds > 0 else 0.0


def _stack_options(args, model: Path, batches: list[int], variant: str, tp: int = 1,
                   stream_interval: int = 1, poll_us: int | None = None, draft_dtype: str | None = None) -> StackOptions:
    draft_device = getattr(args, "draft_device", None) or args.device
    extra = ("--runtime-dtype", args.dtype) if getattr(args, "dtype", None) else ()
    if getattr(args, "batch_invariant", False):
        extra += ("--runtime-batch-invariant",)
    if poll_us is not None:                      # None: the workers' default (auto)
        extra += ("--data-plane-poll-us", str(poll_us))
    parts = variant.split("+")                   # e.g. colocated+no-round-ahead: its parts, whole
    if "host-drafts" in parts:                   # the colocated draft's drafts through the host
        extra += ("--no-colocated-device-drafts",)
    if "no-round-ahead" in parts:                # no greedy round queued ahead (runtime/round_ahead.py)
        extra += ("--no-graphs-round-ahead",)
    return StackOptions(model=str(model), backend=args.backend, draft_device=draft_device, target_device=args.device,
                        k=args.k, max_batch=max(batches), metrics=True, log_level="WARNING",
                        ahead_drafting="ahead" in parts, adaptive_k="adaptive" in parts,
                        micro_batches="micro" in parts, colocated_draft="colocated" in parts,
                        worker_args=extra, target_tp=tp,
                        draft_args=("--runtime-dtype", draft_dtype) if draft_dtype else (),
                        stream_interval=stream_interval)


def target_tps(args) -> list[int]:
    """The target's tensor-parallel rank counts to run side by side: ``--tp``, else [1]."""
    tps = list(dict.fromkeys(int(t) for t in (getattr(args, "tp", None) or [1])))
    if min(tps) < 1:
        raise SystemExit(f"specsplit: bench services: --tp: rank counts >= 1, got {tps}")
    return tps


def main(args) -> int:
    model = Path(args.model) if args.model else TINY
    batches = args.batch or [1, 16]
    variants = getattr(args, "variants", None) or ["fixed"]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"specsplit: bench services: --variants: {v!r} is not one of {', '.join(VARIANTS)}")
    rows = []
    first_ref: dict[int, list] = {}
    intervals = list(dict.fromkeys(getattr(args, "stream_interval", None) or [1]))
    polls = list(dict.fromkeys(getattr(args, "poll_us", None) or [None]))
    dtypes = list(dict.fromkeys(getattr(args, "draft_dtype", None) or [None]))
    runs = [(tp, variant, si, poll, dt) for tp in target_tps(args) for variant in variants for si in intervals
            for poll in polls for dt in dtypes]
    for tp, variant, si, poll, draft_dtype in runs:
        with Stack(_stack_options(args, model, batches, variant, tp, si, poll, draft_dtype)) as stack:
            address = stack.orchestrator_address
            mport = stack.children["orchestrator"].metrics_port
            tport = stack.children["target"].metrics_port
            desc = f"bench services ({variant}, TP={tp}, SI={si}, poll={poll} us, draft {draft_dtype or 'as-is'})"
            for batch in progress(batches, desc=desc, unit="batch size"):
                n = max(batch, args.prompts) if batch > 1 else args.prompts
                prompts = (heldout_prompts(64, model) * 4)[:n]
                _decode(address, prompts[:batch], 8, args.k, batch)            # warm-up
                m0 = round_split(mport)
                ref, t_ref = _decode(address, prompts, args.max_tokens, 0, batch)
                m1, q1 = round_split(mport), rounds_ahead(tport)
                spec, t_spec = _decode(address, prompts, args.max_tokens, args.k, batch)
                m2, q2 = round_split(mport), rounds_ahead(tport)
                toks_ref = sum(len(r.tokens) for r in ref)
                toks_spec = sum(len(r.tokens) for r in spec)
                drafted = sum(r.drafted for r in spec)
                first_ref.setdefault(batch, [r.tokens for r in ref])      # across variants and TP sizes
                rows.append({
                    "variant": variant, "tp": tp, "stream_interval": si, "poll_us": poll, "draft_dtype": draft_dtype,
                    "batch": batch, "requests": n, "k": args.k,
                    "tokens_per_s_target": round(toks_ref / t_ref, 2),
                    "tokens_per_s_spec": round(toks_spec / t_spec, 2),
                    "speedup": round((toks_spec / t_spec) / (toks_ref / t_ref), 3),
                    "identical": [r.tokens for r in ref] == [r.tokens for r in spec] == first_ref[batch],
                    "acceptance_rate": round(sum(r.accepted for r in spec) / drafted, 4) if drafted else 0.0,
                    "tokens_per_round": round(toks_spec / max(1, sum(r.rounds for r in spec)), 3),
                    "ahead_used": f"{sum(r.ahead_used for r in spec)}/{sum(r.ahead_asked for r in spec)}",
                    "rounds_queued_ahead": _ahead_delta(q1, q2),
                    "round_ms_target_only": _per_round_ms(m0, m1), "round_ms_spec": _per_round_ms(m1, m2),
                    "in_rounds_spec": in_rounds(_per_round_ms(m1, m2), t_spec),
                    "first_token_ms_spec": first_token_ms(m1, m2), "first_token_ms_target": first_token_ms(m0, m1),
                })
    result = {"backend": args.backend, "device": args.device, "draft_device": getattr(args, "draft_device", None)
              or args.device, "target_tp": target_tps(args), "max_tokens": args.max_tokens, "rows": rows}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"bench services: backend={args.backend} target={args.device} draft={result['draft_device']} k={args.k} "
          f"max_tokens={args.max_tokens} (three processes on loopback; round loop in the target)")
    print(f"{'variant':>24s} {'TP':>2s} {'SI':>3s} {'poll':>5s} {'draft':>8s} {'batch':>5s} {'spec tok/s':>10s} {'target tok/s':>12s} {'speedup':>8s} "
          f"{'identical':>9s} {'accept':>7s} {'tok/rnd':>7s} {'ahead':>9s}  round ms spec: draft / target / overhead "
          f"/ total, share of wall time in rounds, ms to the first token")
    for r in rows:
        s = r["round_ms_spec"]
        print(f"{r['variant']:>24s} {r['tp']:2d} {r['stream_interval']:3d} {'auto' if r['poll_us'] is None else r['poll_us']:>5} {r['draft_dtype'] or 'as-is':>8s} {r['batch']:5d} {r['tokens_per_s_spec']:10.1f} {r['tokens_per_s_target']:12.1f} "
              f"{r['speedup']:8.2f} {str(r['identical']):>9s} {r['acceptance_rate']:7.3f} {r['tokens_per_round']:7.2f} "
              f"{r['ahead_used']:>9s}  {s.get('draft', 0):.2f} / {s.get('target', 0):.2f} / "
              f"{s.get('overhead', 0):.2f} / {s.get('total', 0):.2f}, {r['in_rounds_spec']:.2f}, "
              f"{r['first_token_ms_spec']:.2f}")
        t = r["round_ms_target_only"]
        print(f"{'':>24s} {'':2s} {'':3s} {'':5s} {'':8s} {'':5s} target-only round ms: target / overhead / total = "
              f"{t.get('target', 0):.2f} / {t.get('overhead', 0):.2f} / {t.get('total', 0):.2f}, first token "
              f"{r['first_token_ms_target']:.2f} ms; spec rounds queued ahead used/launched "
              f"{r['rounds_queued_ahead']}")
    if any(v.startswith("colocated") and not {"host-drafts", "ahead"} & set(v.split("+")) for v in variants):
        print("colocated rows: greedy drafts reach the verify on the device (colocated_device_drafts): on a GPU a "
              "round's draft part is the host's share of the propose, its kernels are timed in the target part")
    return 0
