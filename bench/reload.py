"""``specsplit bench reload``: weight reload phase by phase, IN_PLACE vs RECAPTURE, vs reading the checkpoint.

Owns: writing two random bf16 checkpoints of one config (target in Hugging
Face layout + ``mtp.safetensors``; versions v1 and v2) to a temporary
directory, starting the draft and target services (Torch, in this process, on
one device) and an orchestrator on loopback, then timing through the real
``ReloadWeights`` path:
  - RECAPTURE reloads: validate, clear, release, load, capture (per worker,
    from the reload's own progress events; the workers run each phase
    concurrently, so a phase's wall time is the slower worker's);
  - IN_PLACE reloads: validate, load (copy into the live tensors), also with
    ``preload`` (the workers read the tensors at prepare, before the pause);
  - how long admission stays paused (everything after the prepare);
  - the floor: reading the checkpoint files from disk (raw bytes; page cache
    warm, as for the reloads), and reading them into host arrays the way the
    workers do (target + the draft's share).
Medians over REPS (3) reloads per mode after one warm-up reload.
The issue's goal is IN_PLACE <= 1.2x the read time; the ratio is printed.

``--small`` uses a small config (runs on CPU in seconds); the default is the
~1B config of ``bench graphs`` and needs a GPU (``--device cuda:0``).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.graphs import BIG
from runtime.checkpoint import save_safetensors, save_target
from core.config import ServerConfig
from orchestrator.config import OrchestratorConfig
from runtime.config import CacheConfig, GraphConfig, ModelConfig, RuntimeConfig, SpecConfig
from worker.config import WorkerConfig
from runtime.model import mtp_tensor_shapes, target_tensor_shapes
from runtime.weights import (CheckpointArrays, check_draft, check_target, copy_in_place, read_arrays,
                             resolve_draft_path)
from core.progress import progress

SMALL = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
PHASES = ("validate", "clear_graphs", "release", "load", "capture")
REPS = 3                       # timed reloads per variant (after one warm-up), medians reported
VARIANTS = ("recapture", "in_place", "in_place+preload")
ROWS = (*PHASES, "paused", "total")


def write_checkpoints(root: Path, cfg: ModelConfig) -> list[Path]:
    """v1 (random) and v2 (v1 negated: different bits, same shapes) as bf16 checkpoints."""
    rng = np.random.default_rng(0)
    shapes = {**target_tensor_shapes(cfg), **mtp_tensor_shapes(cfg)}
    tensors = {n: (np.ones(s, np.float32) if len(s) == 1 else rng.standard_normal(s, dtype=np.float32) * 0.02)
               for n, s in shapes.items()}
    paths = []
    for version in ("v1", "v2"):
        d = root / version
        save_target(d, cfg, {n: t for n, t in tensors.items() if not n.startswith("mtp.")}, dtype="bfloat16")
        save_safetensors(d / "mtp.safetensors", {n: t for n, t in tensors.items() if n.startswith("mtp.")},
                         dtype="bfloat16")
        paths.append(d)
        for t in tensors.values():
            np.negative(t, out=t)
    return paths


def read_times(path: Path, bf16_bits: bool) -> tuple[float, float, int]:
    """(raw read seconds, read as the workers do seconds, bytes) of one checkpoint: target files + MTP
    file. The workers' read keeps bf16 as raw bits for bf16 Torch workers, else decodes to float32."""
    files = sorted(path.glob("*.safetensors"))
    t0 = time.perf_counter()
    nbytes = 0
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(64 << 20):
                nbytes += len(chunk)
    raw = time.perf_counter() - t0
    t0 = time.perf_counter()
    target = check_target(path)
    read_arrays(target, bf16_bits)
    read_arrays(check_draft(target, resolve_draft_path(path, None)), bf16_bits)   # the draft's (MTP + embed/head)
    return raw, time.perf_counter() - t0, nbytes


def stream_time(worker, path: Path) -> float:
    """Seconds to stream the target checkpoint at ``path`` into the target worker's live tensors
    (``copy_in_place`` from ``CheckpointArrays``: pinned chunks on CUDA), alone, outside any reload."""
    checked = check_target(path)
    t0 = time.perf_counter()
    worker.device.run(lambda: copy_in_place(worker.ops, worker.engine.params, CheckpointArrays(checked)))
    return time.perf_counter() - t0


def _phase_walls(events) -> dict[str, float]:
    """Per phase: the slowest worker (they run concurrently)."""
    out: dict[str, float] = {}
    per: dict[tuple[str, str], float] = {}
    for ev in events:
        if ev.service in ("draft", "target") and ev.phase in PHASES:
            per[(ev.phase, ev.service)] = per.get((ev.phase, ev.service), 0.0) + ev.seconds
    for (phase, _), s in per.items():
        out[phase] = max(out.get(phase, 0.0), s)
    out["total"] = events[-1].seconds
    # Admission is paused from the drain on: everything after the prepare ("validate").
    out["paused"] = out["total"] - out.get("validate", 0.0)
    return out


def main(args) -> int:
    from draft_service.server import start as start_draft
    from orchestrator.client import SpecsplitClient
    from orchestrator.server import create_server
    from core.observability import configure_logging
    from target_service.server import start as start_target

    configure_logging("bench-reload", "WARNING")             # service logs to stderr, warnings only
    cfg = SMALL if args.small else BIG
    device = args.device
    if device == "cpu" and not args.small:
        print("bench reload: the ~1B config needs a GPU (--device cuda:0); use --small on CPU")
        return 2
    reps = REPS
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    buckets = (1, 8, 32) if not args.small else (1, 4)
    with tempfile.TemporaryDirectory(prefix="specsplit-bench-reload-") as tmp:
        t0 = time.perf_counter()
        v1, v2 = write_checkpoints(Path(tmp), cfg)
        write_s = time.perf_counter() - t0

        def wcfg(role: str) -> WorkerConfig:
            return WorkerConfig(role=role, target_path=str(v1), weights_version="v1", capture_on_start=True,
                                runtime=RuntimeConfig(backend="torch", device=device, dtype=dtype),
                                spec=SpecConfig(max_k=args.k, default_k=args.k),
                                cache=CacheConfig(max_slots=max(buckets), max_len=512),
                                graphs=GraphConfig(batch_buckets=buckets), server=ServerConfig(port=0))
        target, draft = start_target(wcfg("target")), start_draft(wcfg("draft"))
        server, port = create_server(OrchestratorConfig(
            draft_address=f"127.0.0.1:{draft.port}", target_address=f"127.0.0.1:{target.port}", max_k=args.k,
            default_k=args.k, worker_timeout_s=600, reload_call_timeout_s=3600, server=ServerConfig(port=0)))
        client = SpecsplitClient(f"127.0.0.1:{port}", timeout=3600)
        try:
            paths, n = [v2, v1], 0

            def reload(variant: str) -> dict[str, float]:
                nonlocal n
                path = paths[n % 2]
                n += 1
                mode, preload = variant.split("+")[0], variant.endswith("+preload")
                return _phase_walls(client.reload(str(path), f"{path.name}-{n}", mode=mode, inflight="wait",
                                                  preload=preload))
            reload("recapture")                                            # warm-up (first capture, caches)
            bar = progress(desc="bench reload", total=len(VARIANTS) * reps, unit="reload")
            runs = {}
            for variant in VARIANTS:
                runs[variant] = []
                for _ in range(reps):
                    runs[variant].append(reload(variant))
                    bar.update(1)
            bar.close()
            reads = [read_times(p, dtype == "bfloat16") for p in (v1, v2, v1)]
            streams = [stream_time(target.worker, p) for p in (v2, v1, v2)] if device.startswith("cuda") else []
            target_gib = sum(i.end - i.start for i in check_target(v1).infos.values()) / 2**30
        finally:
            client.close()
            server.stop(0).wait(10)
            target.stop(grace=None)
            draft.stop(grace=None)
    raw = statistics.median(r[0] for r in reads)
    decode = statistics.median(r[1] for r in reads)
    gib = reads[0][2] / 2**30
    med = {mode: {ph: statistics.median(r.get(ph, 0.0) for r in rs) for ph in ROWS}
           for mode, rs in runs.items()}
    result = {
        "model": "small d256 L4" if args.small else "llama-1b-shaped d2048 L16", "device": device, "dtype": dtype,
        "checkpoint_gib": round(gib, 3), "write_s": round(write_s, 2), "repetitions": reps,
        "read_s": round(raw, 4), "workers_read_s": round(decode, 4),
        "recapture": {k: round(v, 4) for k, v in med["recapture"].items()},
        "in_place": {k: round(v, 4) for k, v in med["in_place"].items()},
        "in_place_preload": {k: round(v, 4) for k, v in med["in_place+preload"].items()},
        "in_place_over_read": round(med["in_place"]["total"] / raw, 3),
        "recapture_over_read": round(med["recapture"]["total"] / raw, 3),
        "in_place_over_workers_read": round(med["in_place"]["total"] / decode, 3),
        "stream_target_s": round(statistics.median(streams), 4) if streams else None,
        "goal_in_place_over_read": 1.2,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"bench reload: {result['model']}, torch {device} {dtype}, checkpoint {gib:.2f} GiB (target + MTP files), "
          f"median of {reps}, page cache warm")
    print(f"{'phase (s, slower worker)':26s} {'RECAPTURE':>10s} {'IN_PLACE':>10s} {'IN_PLACE+preload':>17s}")
    for ph in ROWS:
        print(f"{ph:26s} {med['recapture'][ph]:10.3f} {med['in_place'][ph]:10.3f} "
              f"{med['in_place+preload'][ph]:17.3f}")
    print(f"{'read checkpoint (raw)':26s} {raw:10.3f}")
    print(f"{'read as the workers do':26s} {decode:10.3f}")
    if streams:
        st = statistics.median(streams)
        print(f"{'stream target into tensors':26s} {st:10.3f}  ({target_gib / st:.2f} GiB/s, target only, pinned "
              f"chunks; raw read {gib / raw:.2f} GiB/s)")
    print(f"IN_PLACE / read = {result['in_place_over_read']:.2f} (goal <= 1.2), RECAPTURE / read = "
          f"{result['recapture_over_read']:.2f}, IN_PLACE / workers' read = {result['in_place_over_workers_read']:.2f}")
    return 0
