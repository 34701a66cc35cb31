"""``specsplit bench load``: N concurrent clients for T seconds against a stack on loopback.

Owns: starting one stack (draft, target, orchestrator as separate processes,
``specsplit.launcher.Stack``), a short warm-up, then N client threads that
each send generations back to back (held-out prompts, alternating greedy and
seeded sampling, k drafts) until T seconds are up, and the report: requests,
errors by status code (zero expected), p50/p99 time to first token, p50/p99
per-token latency (the gap between chunks divided by the tokens they carry,
weighted per token), tokens/s over the run, and each service's resident
memory (VmRSS) before and after. Exits 1 when any request failed.

Arguments (``specsplit bench load``): ``--batch N`` clients (first value;
default 8), ``--seconds T`` (default 40), ``--max-tokens``, ``--k``,
``--model``, ``--backend``, ``--device``, ``--json``. The defaults finish in
about a minute on a 2-core machine.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

from bench.engine import TINY
from orchestrator.client import SpecsplitClient, SpecsplitError
from specsplit.launcher import Stack, StackOptions
from core.progress import progress

DEFAULT_CLIENTS = 8
REQUEST_TIMEOUT_S = 120.0


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS), 0 when it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _prompts(model: Path) -> list[str]:
    path = model / "heldout_prompts.json"
    if path.exists():
        return json.loads(path.read_text())[:32]
    return [f"Load test prompt number {i}: the quick brown fox jumps over the lazy dog." for i in range(32)]


class _Client(threading.Thread):
    """One client: generations back to back until ``deadline``; records latencies and errors."""

    def __init__(self, index: int, address: str, prompts: list[str], deadline: float, max_tokens: int, k: int,
                 once: bool = False) -> None:
        super().__init__(name=f"load-client-{index}", daemon=True)
        self.index, self.address, self.prompts, self.once = index, address, prompts, once
        self.deadline, self.max_tokens, self.k = deadline, max_tokens, k
        self.ttft: list[float] = []
        self.per_token: list[float] = []        # one entry per token after the first chunk
        self.tokens = 0
        self.requests = 0
        self.errors: Counter[str] = Counter()

    def run(self) -> None:
        n = 0
        with SpecsplitClient(self.address, timeout=REQUEST_TIMEOUT_S) as client:
            while n == 0 and self.once or time.monotonic() < self.deadline:
                prompt = self.prompts[(self.index * 7 + n) % len(self.prompts)]
                sampled = (self.index + n) % 2 == 1
                t0 = time.perf_counter()
                last = None
                try:
                    for ev in client.generate(prompt, self.max_tokens, k=self.k, ignore_eos=True,
                                              temperature=0.8 if sampled else 0.0,
                                              seed=1000 * self.index + n if sampled else None):
                        if ev.final or not ev.tokens:
                            continue
                        now = time.perf_counter()
                        if last is None:
                            self.ttft.append(now - t0)
                        else:
                            self.per_token.extend([(now - last) / len(ev.tokens)] * len(ev.tokens))
                        last = now
                        self.tokens += len(ev.tokens)
                    self.requests += 1
                except SpecsplitError as exc:
                    self.errors[exc.code.name] += 1
                n += 1


def _pct(values: list[float], q: float) -> float:
    return round(1e3 * float(np.percentile(values, q)), 3) if values else 0.0


def main(args) -> int:
    model = Path(args.model) if args.model else TINY
    if not (model / "config.json").exists():
        raise SystemExit(f"bench load: no model at {model} (train one with `specsplit train`, or pass --model)")
    clients = (args.batch or [DEFAULT_CLIENTS])[0]
    seconds, max_tokens, k = float(args.seconds), int(args.max_tokens), int(args.k)
    opts = StackOptions(model=str(model), backend=args.backend, draft_device=args.device, target_device=args.device,
                        k=k, max_batch=max(1, clients), log_level="WARNING")
    prompts = _prompts(model)
    t_start = time.perf_counter()
    with Stack(opts) as stack:
        pids = {name: c.proc.pid for name, c in stack.children.items()}
        address = stack.orchestrator_address
        warm = [_Client(i, address, prompts, 0.0, 8, k, once=True) for i in range(clients)]
        for c in warm:                          # one short request each, concurrently
            c.start()
        for c in warm:
            c.join(REQUEST_TIMEOUT_S)
        rss_before = {name: rss_bytes(pid) for name, pid in pids.items()}
        deadline = time.monotonic() + seconds
        t0 = time.perf_counter()
        workers = [_Client(i, address, prompts, deadline, max_tokens, k) for i in range(clients)]
        for c in workers:
            c.start()
        bar = progress(desc="bench load", total=round(seconds), unit="s")
        for c in workers:
            while c.is_alive() and time.monotonic() < deadline + REQUEST_TIMEOUT_S:
                c.join(1.0)
                bar.n = min(round(seconds), round(seconds - max(0.0, deadline - time.monotonic())))
                bar.refresh()
        bar.close()
        wall = time.perf_counter() - t0
        rss_after = {name: rss_bytes(pid) for name, pid in pids.items()}
    errors = sum((c.errors for c in workers + warm), Counter())
    ttft = [x for c in workers for x in c.ttft]
    per_token = [x for c in workers for x in c.per_token]
    tokens = sum(c.tokens for c in workers)
    result = {
        "backend": args.backend, "device": args.device, "clients": clients, "seconds": seconds,
        "max_tokens": max_tokens, "k": k, "requests": sum(c.requests for c in workers),
        "errors": sum(errors.values()), "errors_by_code": dict(errors),
        "ttft_ms": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99)},
        "per_token_ms": {"p50": _pct(per_token, 50), "p99": _pct(per_token, 99)},
        "tokens": tokens, "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
        "rss_mib": {name: {"before": round(rss_before[name] / 2**20, 1), "after": round(rss_after[name] / 2**20, 1)}
                    for name in pids},
        "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"bench load: {clients} clients x {seconds:g}s, max_tokens={max_tokens} k={k} "
              f"backend={args.backend} device={args.device} (three processes on loopback)")
        print(f"  requests       {result['requests']}   errors {result['errors']} {dict(errors) or ''}")
        print(f"  TTFT ms        p50 {result['ttft_ms']['p50']:.1f}   p99 {result['ttft_ms']['p99']:.1f}")
        print(f"  per-token ms   p50 {result['per_token_ms']['p50']:.2f}   p99 {result['per_token_ms']['p99']:.2f}")
        print(f"  throughput     {result['tokens_per_s']:.1f} tokens/s ({tokens} tokens)")
        for name, r in result["rss_mib"].items():
            print(f"  RSS {name:13s} {r['before']:7.1f} MiB -> {r['after']:7.1f} MiB")
        print(f"  total          {result['total_seconds']:.1f}s including start-up")
    return 1 if result["errors"] else 0
