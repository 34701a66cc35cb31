"""A RECAPTURE's phases per worker, the draft's one-graph Propose kinds on vs off, side by side (GPU).

    python3 scripts/recapture_ab.py [--device cuda:0] [--cycles 3]

Owns: two in-process workers (target and draft) on one device with the config of
tests/gpu/test_reload_gpu.py (d=1024, 8 layers, vocab 32000, bf16, max_len 512, buckets
1/4/8), once with ``graphs.fused_propose`` on and once off; per cycle, each worker's
clear graphs, release weights, load weights and capture graphs, timed on the host
(the worker calls return when the device thread is done). Prints the medians and the
graph counts. Why: RECAPTURE reloads got slower after the propose kinds landed
(docs/gpu.md, session 6); this names which phase and which worker pays.

Must not know: the orchestrator (no reload RPC; the workers' own lifecycle calls).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.reload import write_checkpoints  # noqa: E402
from core.config import ServerConfig  # noqa: E402
from draft_service.worker import DraftWorker  # noqa: E402
from runtime.config import CacheConfig, GraphConfig, ModelConfig, RuntimeConfig, SpecConfig  # noqa: E402
from target_service.worker import TargetWorker  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402

CFG = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024)
PHASES = ("clear", "release", "load", "capture")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--cycles", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_checkpoints(Path(tmp), CFG)[0])
        print(f"recapture A/B: {args.device}, d={CFG.hidden_size} L={CFG.num_hidden_layers} bf16, "
              f"max_len 512, buckets (1, 4, 8), {args.cycles} cycles; median seconds per phase")
        print(f"{'fused_propose':>13s} {'worker':>6s} {'graphs':>6s} " + " ".join(f"{p:>8s}" for p in PHASES))
        for fused in (True, False):
            def cfg(role):
                return WorkerConfig(role=role, target_path=path, weights_version="v1",
                                    runtime=RuntimeConfig(backend="torch", device=args.device, dtype="bfloat16"),
                                    spec=SpecConfig(max_k=3, default_k=3), cache=CacheConfig(max_slots=8, max_len=512),
                                    graphs=GraphConfig(batch_buckets=(1, 4, 8), fused_propose=fused),
                                    server=ServerConfig(port=0))
            workers = {"target": TargetWorker(cfg("target")), "draft": DraftWorker(cfg("draft"))}
            times = {name: {p: [] for p in PHASES} for name in workers}
            for w in workers.values():
                w.load_weights(path, "", "v1")
                w.capture_graphs()
            graphs = {name: len(w.registry.span_keys()) for name, w in workers.items()}
            for c in range(args.cycles):
                for name, w in workers.items():
                    for phase, fn in (("clear", w.clear_graphs), ("release", w.release_weights),
                                      ("load", lambda w=w, c=c: w.load_weights(path, "", f"v{c + 2}")),
                                      ("capture", w.capture_graphs)):
                        t0 = time.perf_counter()
                        fn()
                        times[name][phase].append(time.perf_counter() - t0)
            for name, w in workers.items():
                print(f"{str(fused):>13s} {name:>6s} {graphs[name]:6d} "
                      + " ".join(f"{statistics.median(times[name][p]):8.3f}" for p in PHASES))
                w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
