"""The target's round host in one process, no gRPC: B target-only clients drain their events (diagnostic).

Usage: python scripts/round_host_probe.py MODEL DEVICE BATCH MAX_TOKENS [PROFILE_ROWS]
"""
import sys, time, threading
import numpy as np
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1]))
from core.config import SecurityConfig, ServerConfig
from core.params import SamplingParams
from runtime.config import CacheConfig, GraphConfig, RuntimeConfig, SpecConfig
from worker.config import WorkerConfig
from rounds.scheduler_types import GenerationRequest, FinalEvent, ErrorEvent
from target_service.rounds import RoundHost
from target_service.worker import TargetWorker
model, dev, B, N = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
LATE = "--late" in sys.argv                  # clients read their events only when the request ends
sys.argv = [a for a in sys.argv if a != "--late"]
if LATE:
    import queue
    import rounds.scheduler_types as ST

    class _Quiet(queue.Queue):
        """put() wakes the reader only for the last event (no wake-up per round)."""
        def __init__(self):
            super().__init__(); self.done = threading.Event()
        def put(self, item, block=True, timeout=None):
            with self.mutex:
                self.queue.append(item)
            if isinstance(item, (FinalEvent, ErrorEvent)):
                self.done.set()
    _init = ST.RequestHandle.__init__
    def _handle_init(self, req, wake):
        _init(self, req, wake); self.events = _Quiet()
    ST.RequestHandle.__init__ = _handle_init
cfg = WorkerConfig(role="target", target_path=model, weights_version="v1",
    runtime=RuntimeConfig(backend="torch", device=dev, dtype="float32"),
    spec=SpecConfig(max_k=3, default_k=3), cache=CacheConfig(max_slots=max(B, 8), max_len=1024),
    graphs=GraphConfig(batch_buckets=(1, 2, 4, 8)), capture_on_start=True,
    server=ServerConfig(host="127.0.0.1", port=0), security=SecurityConfig())
PROFILE = len(sys.argv) > 5
if PROFILE:                      # the scheduler thread's profile, printed when it stops
    import cProfile, pstats
    import rounds.scheduler as S
    _loop = S.Scheduler._loop
    def _profiled(self):
        pr = cProfile.Profile(); pr.enable()
        try:
            _loop(self)
        finally:
            pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(int(sys.argv[5]))
    S.Scheduler._loop = _profiled
t = TargetWorker(cfg); t.load_weights(model, "", "v1"); t.capture_graphs()
host = RoundHost(t, cfg)
host.configure("", B, 64, 30.0)
def one(i, n):
    h = host.submit(GenerationRequest(f"q{i}-{n}", tuple(range(1, 33)), SamplingParams(max_tokens=N, ignore_eos=True), 0))
    toks = 0
    if LATE:
        h.events.done.wait(60)
    while True:
        ev = h.next_event(1.0)
        if isinstance(ev, (FinalEvent, ErrorEvent)):
            return toks
        if ev is not None:
            toks += len(ev.tokens)
def client(i, reps, out):
    for n in range(reps):
        out[i] += one(i, n)
for reps, label in ((1, "warm"), (2, "run")):
    out = [0] * B
    tm0 = host.scheduler.timing; r0, w0, t0s = tm0.rounds, tm0.wall_s, tm0.target_s
    t0 = time.perf_counter()
    th = [threading.Thread(target=client, args=(i, reps, out)) for i in range(B)]
    [x.start() for x in th]; [x.join() for x in th]
    dt = time.perf_counter() - t0
    tm = host.scheduler.timing
    r = tm.rounds - r0
    print(f"{label}: B={B} {sum(out)/dt:.1f} tok/s; rounds {r}, round wall {1e3*(tm.wall_s-w0)/max(r,1):.3f} ms, target {1e3*(tm.target_s-t0s)/max(r,1):.3f} ms; eng ahead {t.engine.ahead_stats}")
host.close(); t.close()
