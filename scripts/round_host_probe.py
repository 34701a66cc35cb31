"""The target's round host in one process, no gRPC: what waking the readers of a round's events costs.

Owns: a ``TargetWorker`` (graphs captured) under a ``RoundHost`` with no draft, BATCH client
threads each running target-only requests of MAX_TOKENS tokens one after another, and how
their events reach them:
  per-request  each reader waits on its request's own queue, woken per event (as the target's
               Decode handlers were, one per request);
  --outbox     the requests share one ``EventOutbox`` and one reader thread, woken once per
               round boundary (as a DecodeStream is);
  --late       nobody is woken before a request ends (a floor: no reader work during rounds).
With ``--draft DEVICE``: a draft service process on that device (as the launcher starts it) and
k=3 requests, the target's round loop exchanging with it as in serving; ``--draft-profile N`` also
prints the draft process's cProfile of its round messages (top N by own time, the whole run:
scripts/draft_profile).
With ``--colocated``: the draft worker in this process on DEVICE (``colocated_draft``: the round loop
calls it directly; graphs of both captured) and k=3 requests; the Torch profiler pass then sees the
draft's kernels too. ``--host-drafts``: its drafts through the host (``colocated_device_drafts`` off);
``--no-round-ahead``: no greedy round queued ahead (``graphs.round_ahead`` off; ``--round-ahead``: on,
on any device, e.g. a CPU profile of the GPU's host path). ``--switch-interval
S``: the interpreter's thread switch interval for the run.
With ``--adaptive``: adaptive k on (spec.adaptive_k, its default probes); ``--random-prompt [SEED:LEN]``:
a prompt of seeded random byte tokens (with ``1:200`` the bundled model's draft rarely matches: adaptive k
then runs mostly target-only rounds with the draft holding the request; with the default ``0:48`` it
drafted most rounds on the 2-core CPU, 92 rounds for 256 tokens).
Prints tokens/s and the scheduler's round wall / draft / target / overhead per round and the
steps queued ahead (and the gate's pauses); with --profile N, the scheduler thread's cProfile (top N
by own time); with --torch-profile N, a Torch profiler pass over the run (GPU busy and host gap
per round, the top N kernels per round). Each phase also prints the process's CPU time per round
and the threads that used most of it (a thread busy beside the round loop takes the interpreter
from it).

Usage: python scripts/round_host_probe.py MODEL DEVICE BATCH MAX_TOKENS [--outbox | --late] [--draft DEVICE]
                                          [--adaptive] [--k K] [--random-prompt [SEED:LEN]] [--profile N]
                                          [--torch-profile N] [--verify-split] [--draft-profile N]
                                          [--colocated [--host-drafts] [--no-round-ahead | --round-ahead]]
                                          [--switch-interval S] [--host-only]
With ``--host-only`` (a device without CUDA graphs, e.g. the CPU): each phase also prints the round
loop's host time a round outside the graphs' eager stand-ins (median and p10 of its rounds): the
Python, numpy and copies around the steps, which on a GPU host set the pace once the steps are
queued ahead (docs/performance.md § Session 30).

Diagnostic only (docs/performance.md § Session 10); nothing imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.config import SecurityConfig, ServerConfig  # noqa: E402
from core.params import SamplingParams  # noqa: E402
from draft_service.worker import DraftWorker, chains_rounds  # noqa: E402
from rounds.local_draft import LocalDraft  # noqa: E402
from rounds import scheduler as scheduler_mod  # noqa: E402
from rounds import scheduler_types  # noqa: E402
from rounds.scheduler_types import ErrorEvent, EventOutbox, FinalEvent, GenerationRequest  # noqa: E402
from specsplit.launcher import Child, StackOptions, worker_argv  # noqa: E402
from runtime.config import CacheConfig, GraphConfig, RuntimeConfig, SpecConfig  # noqa: E402
from target_service.rounds import RoundHost, local_draft  # noqa: E402
from target_service.worker import TargetWorker  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402

PROMPT = tuple(range(1, 33))


def random_prompt(seed: int = 0, n: int = 48) -> tuple[int, ...]:
    """n seeded random byte tokens (32..255)."""
    return tuple(int(x) for x in np.random.default_rng(seed).integers(32, 256, n))
WAIT_S = 120.0


class _WakeAtEnd(queue.Queue):
    """A handle's queue that wakes its reader only for the request's last event (--late)."""

    def __init__(self) -> None:
        super().__init__()
        self.done = threading.Event()

    def put(self, item, block=True, timeout=None) -> None:
        with self.mutex:
            self.queue.append(item)
        if isinstance(item, (FinalEvent, ErrorEvent)):
            self.done.set()


def _late_handles() -> None:
    init = scheduler_types.RequestHandle.__init__

    def handle_init(self, req, wake, outbox=None):
        init(self, req, wake, outbox)
        self.events = _WakeAtEnd()
    scheduler_types.RequestHandle.__init__ = handle_init


def _split_verify(engine) -> list:
    """Wrap the engine's verify and its host-copy wait: per verify (drafted, ahead used, ms before
    the wait, ms waiting, ms after)."""
    rows: list = []
    verify, fetch_async = engine.verify, engine.ops.to_numpy_many_async
    mark: dict = {}

    def timed_fetch(*args, **kw):
        fetch = fetch_async(*args, **kw)

        def wait():
            mark["wait0"] = time.perf_counter()
            try:
                return fetch()
            finally:
                mark["wait1"] = time.perf_counter()
        return wait

    def timed_verify(reqs):
        used0, t0 = engine.ahead_stats.used, time.perf_counter()
        mark.clear()
        try:
            return verify(reqs)
        finally:
            t1 = time.perf_counter()
            w0, w1 = mark.get("wait0", t1), mark.get("wait1", t1)
            rows.append((any(len(r.drafts) for r in reqs), engine.ahead_stats.used > used0,
                         1e3 * (w0 - t0), 1e3 * (w1 - w0), 1e3 * (t1 - w1)))
    engine.verify, engine.ops.to_numpy_many_async = timed_verify, timed_fetch
    return rows


def _print_split(rows: list) -> None:
    import statistics
    groups: dict = {}
    for drafted, used, *parts in rows[len(rows) // 3:]:          # after the warm-up
        groups.setdefault((drafted, used), []).append(parts)
    for (drafted, used), xs in sorted(groups.items()):
        med = [statistics.median(x[i] for x in xs) for i in range(3)]
        print(f"  verify drafted={drafted!s:5s} ahead used={used!s:5s} {len(xs):5d} calls: before the wait "
              f"{med[0]:.3f} ms, waiting {med[1]:.3f}, after {med[2]:.3f} (medians)")


def _thread_cpu() -> dict[str, float]:
    """CPU seconds each live thread has used (its name and id -> seconds; Linux thread clocks)."""
    out = {}
    for th in threading.enumerate():
        try:
            out[f"{th.name}#{th.ident}"] = time.clock_gettime(time.pthread_getcpuclockid(th.ident))
        except (OSError, TypeError, AttributeError):
            pass
    return out


def _print_cpu(before: dict[str, float], after: dict[str, float], p0, p1, rounds: int) -> None:
    """The process's CPU time per round and the threads that used the most of it in the phase: a
    thread that burns CPU beside the round loop competes with it for the interpreter."""
    used = sorted(((after[n] - before.get(n, 0.0), n) for n in after), reverse=True)
    proc = (p1.user + p1.system) - (p0.user + p0.system)
    top = ", ".join(f"{n.split('#')[0]} {1e3 * s / rounds:.3f}" for s, n in used[:5] if s > 0)
    print(f"  cpu ms a round: process {1e3 * proc / rounds:.3f}; threads {top}")


def _torch_profiler():
    from torch.profiler import ProfilerActivity, profile
    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def _profile_scheduler(rows: int) -> None:
    import cProfile
    import pstats

    loop = scheduler_mod.Scheduler._loop

    def profiled(self):
        pr = cProfile.Profile()
        pr.enable()
        try:
            loop(self)
        finally:
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(rows)
    scheduler_mod.Scheduler._loop = profiled


class _OutboxReader:
    """One thread reading a shared outbox; sets each request's event when its last event came."""

    def __init__(self, box: EventOutbox) -> None:
        self.box, self.tokens, self.done = box, {}, {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def expect(self, rid: str) -> threading.Event:
        with self._lock:
            self.tokens[rid], self.done[rid] = 0, threading.Event()
            return self.done[rid]

    def _run(self) -> None:
        while not self._stop.is_set():
            for who, ev in self.box.take(0.25):
                with self._lock:
                    if isinstance(ev, (FinalEvent, ErrorEvent)):
                        self.done[who.request_id].set()
                    else:
                        self.tokens[who.request_id] += len(ev.tokens)

    def stop(self) -> None:
        self._stop.set()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("device")
    ap.add_argument("batch", type=int)
    ap.add_argument("max_tokens", type=int)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--outbox", action="store_true")
    mode.add_argument("--late", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--draft", default="", metavar="DEVICE")
    ap.add_argument("--adaptive", action="store_true")
    ap.add_argument("--k", type=int, default=None, help="the requests' k (default: 3 with --draft, else 0)")
    ap.add_argument("--random-prompt", nargs="?", const="0:48", default=None, metavar="SEED:LEN",
                    help="a prompt of LEN seeded random byte tokens (default 0:48; the bundled model's draft "
                         "rarely matches 1:200)")
    ap.add_argument("--torch-profile", type=int, default=0, metavar="N")
    ap.add_argument("--verify-split", action="store_true",
                    help="time each target verify in parts: before the host copy's wait, the wait, after")
    ap.add_argument("--draft-profile", type=int, default=0, metavar="N",
                    help="with --draft: the draft process's cProfile of its round messages, top N")
    ap.add_argument("--colocated", action="store_true",
                    help="the draft worker in this process, on DEVICE (colocated_draft); not with --draft")
    ahead = ap.add_mutually_exclusive_group()
    ahead.add_argument("--no-round-ahead", action="store_true",
                       help="with --colocated: no greedy round queued ahead (graphs.round_ahead off)")
    ahead.add_argument("--round-ahead", action="store_true",
                       help="with --colocated: rounds queued ahead on any device (graphs.round_ahead on; "
                            "the CPU's host profile of the GPU's path)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval seconds for the run (the interpreter's default 0.005): does a "
                         "round loop that rarely blocks starve the client threads of the interpreter?")
    ap.add_argument("--host-only", action="store_true",
                    help="on a device without CUDA graphs: also print the round loop's host time a round "
                         "outside the graphs' eager stand-ins")
    ap.add_argument("--host-drafts", action="store_true",
                    help="with --colocated: drafts through the host (colocated_device_drafts off)")
    a = ap.parse_args()
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    if a.colocated and a.draft:
        ap.error("--colocated and --draft: one draft or the other")
    if a.host_only and a.device.startswith("cuda"):
        ap.error("--host-only: a device without CUDA graphs (on CUDA the replays are asynchronous: "
                 "use --torch-profile)")
    if not a.draft:
        return probe(a, None)
    opts = StackOptions(model=a.model, backend="torch", k=3, max_slots=max(a.batch, 8))
    env, out = dict(os.environ), None
    if a.draft_profile:
        out = Path(tempfile.mkdtemp()) / "draft-profile.txt"
        here = str(Path(__file__).resolve().parent / "draft_profile")
        env.update(PYTHONPATH=os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p),
                   DRAFT_PROFILE_OUT=str(out), DRAFT_PROFILE_TOP=str(a.draft_profile))
    draft = Child("draft", worker_argv("draft", opts, a.draft), env)
    try:
        draft.wait_listening()
        rc = probe(a, draft)
        if out is not None:
            _print_draft_profile(out, time.time())
        return rc
    finally:
        draft.stop()


def _print_draft_profile(path: Path, since: float) -> None:
    """The draft's profile file once it was written after ``since`` (it is rewritten every second)."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and not (path.exists() and path.stat().st_mtime > since):
        time.sleep(0.1)
    print("draft process, its round messages (scripts/draft_profile):")
    print(path.read_text() if path.exists() else "  (no profile written)")


def probe(a: argparse.Namespace, draft: Child | None) -> int:
    if a.late:
        _late_handles()
    if a.profile:
        _profile_scheduler(a.profile)
    ahead = False if a.no_round_ahead else (True if a.round_ahead else None)   # None: the device's default
    cfg = WorkerConfig(role="target", target_path=a.model, weights_version="v1",
                       runtime=RuntimeConfig(backend="torch", device=a.device, dtype="float32"),
                       spec=SpecConfig(max_k=3, default_k=3, adaptive_k=a.adaptive),
                       cache=CacheConfig(max_slots=max(a.batch, 8), max_len=1024),
                       graphs=GraphConfig(batch_buckets=(1, 2, 4, 8), round_ahead=ahead),
                       capture_on_start=True,
                       server=ServerConfig(host="127.0.0.1", port=0), security=SecurityConfig(),
                       colocated_draft=a.colocated, colocated_device_drafts=not a.host_drafts)
    worker = TargetWorker(cfg)
    worker.load_weights(a.model, "", "v1")
    worker.capture_graphs()
    split = _split_verify(worker.engine) if a.verify_split else None
    local = _colocated_draft(cfg) if a.colocated else None
    host = RoundHost(worker, cfg, local_draft=local)
    if local is not None:
        # No server here to ask for the draft's instance id: the probe hands its draft over as is.
        host._draft_client = lambda _address: local
    host.configure("in-process" if local is not None else draft.address if draft else "", a.batch, 64, 30.0)
    clock = _HostClock() if a.host_only else None
    box = EventOutbox() if a.outbox else None
    reader = _OutboxReader(box) if box is not None else None
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    prompt = random_prompt(*map(int, a.random_prompt.split(":"))) if a.random_prompt else PROMPT
    k = a.k if a.k is not None else (3 if draft or local else 0)

    def one(rid: str) -> int:
        done = reader.expect(rid) if reader is not None else None
        h = host.submit(GenerationRequest(rid, prompt, params, k), box)
        if reader is not None:
            done.wait(WAIT_S)
            return reader.tokens[rid]
        if a.late:
            h.events.done.wait(WAIT_S)
        tokens = 0
        for _ in range(100_000):
            ev = h.next_event(WAIT_S)
            if ev is None or isinstance(ev, (FinalEvent, ErrorEvent)):
                return tokens
            tokens += len(ev.tokens)
        return tokens

    phases = [(1, "warm-up"), (2, "run")] + ([(2, "profiled")] if a.torch_profile else [])
    for reps, label in phases:
        counts = [0] * a.batch

        def client(i: int) -> None:
            for n in range(reps):
                counts[i] += one(f"q{label}{i}-{n}")
        tm = host.scheduler.timing
        r0, w0, t0s, d0, o0 = tm.rounds, tm.wall_s, tm.target_s, tm.draft_s, tm.overhead_s
        cpu0, proc0 = _thread_cpu(), os.times()
        if clock is not None:
            clock.rounds.clear()
        prof = _torch_profiler() if label == "profiled" else contextlib.nullcontext()
        t0 = time.perf_counter()
        with prof:
            threads = [threading.Thread(target=client, args=(i,)) for i in range(a.batch)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        dt = time.perf_counter() - t0
        r = max(tm.rounds - r0, 1)
        print(f"{label}: batch {a.batch} {sum(counts) / dt:.1f} tok/s; {r} rounds, round wall "
              f"{1e3 * (tm.wall_s - w0) / r:.3f} ms, draft {1e3 * (tm.draft_s - d0) / r:.3f}, target "
              f"{1e3 * (tm.target_s - t0s) / r:.3f}, overhead {1e3 * (tm.overhead_s - o0) / r:.3f} ms; "
              f"queued ahead {worker.engine.ahead_stats}, gate pauses {worker.engine.steps.gate.pauses}; "
              f"rounds queued ahead {worker.engine.round_stats}")
        _print_cpu(cpu0, _thread_cpu(), proc0, os.times(), r)
        if clock is not None:
            clock.report()
        if label == "profiled":
            from bench.profile_round import _host_summary, _kernel_summary
            got = _kernel_summary(prof, dt, a.torch_profile)
            seen = "the draft in this process: its kernels included" if local else "a draft process's not seen"
            print(f"  gpu busy {got['gpu_busy_ms'] / r:.3f} ms a round, host gap {got['host_gap_ms'] / r:.3f}, "
                  f"{got['kernels'] / r:.1f} kernels a round ({seen})")
            for t in got["top"]:
                print(f"    {t['calls'] / r:6.2f} {t['total_us'] / r:8.1f} us/round  {t['name'][:80]}")
            print("  host: own CPU time per round of every thread's CUDA calls (nested calls overlap)")
            for t in _host_summary(prof, a.torch_profile):
                print(f"    {t['calls'] / r:6.2f} {t['self_us'] / r:8.1f} us/round  {t['name'][:80]}")
    if split is not None:
        _print_split(split)
    if reader is not None:
        reader.stop()
    host.close()
    if local is not None:
        local.worker.close()
    worker.close()
    return 0


class _HostClock:
    """--host-only: the scheduler's rounds timed less the time spent in the graphs' eager
    stand-ins (``_EagerGraph.replay``) and eager steps (``GraphRegistry._eager``): what is left is
    the round loop's host work (on a CPU the steps' compute is synchronous and hides it)."""

    def __init__(self) -> None:
        from runtime import graphs

        self.rounds: list[float] = []
        self._in_steps = 0.0
        replay, eager, run_round = graphs._EagerGraph.replay, graphs.GraphRegistry._eager, \
            scheduler_mod.Scheduler._run_round
        clock = self

        def timed_replay(graph) -> None:
            t = time.perf_counter()
            try:
                replay(graph)
            finally:
                clock._in_steps += time.perf_counter() - t

        def timed_eager(registry, kind, inputs):
            t = time.perf_counter()
            try:
                return eager(registry, kind, inputs)
            finally:
                clock._in_steps += time.perf_counter() - t

        def timed_round(sched, live) -> None:
            clock._in_steps = 0.0
            t = time.perf_counter()
            run_round(sched, live)
            clock.rounds.append(time.perf_counter() - t - clock._in_steps)
        graphs._EagerGraph.replay, graphs.GraphRegistry._eager = timed_replay, timed_eager
        scheduler_mod.Scheduler._run_round = timed_round

    def report(self) -> None:
        xs = sorted(self.rounds)
        if xs:
            print(f"  host outside the steps: median {1e6 * xs[len(xs) // 2]:.0f} us a round, p10 "
                  f"{1e6 * xs[len(xs) // 10]:.0f} us ({len(xs)} rounds)")


def _colocated_draft(cfg: WorkerConfig) -> LocalDraft:
    """The draft worker of a ``colocated_draft`` target (loaded, graphs captured) as the round
    loop's draft port, as ``target_service.server.start`` wires it."""
    dw = DraftWorker(cfg.colocated_draft_config())
    dw.chain_rounds = chains_rounds(cfg)
    dw.load_weights(cfg.target_path, "", "v1")
    dw.capture_graphs()
    return local_draft(dw, cfg.runtime.device)


if __name__ == "__main__":
    raise SystemExit(main())
