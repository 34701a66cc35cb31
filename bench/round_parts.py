"""``specsplit bench round-parts``: where one round's time goes in the services, part by part (GPU host or ``--device cpu``).

Owns: on the bundled model, batch 1, k=3, graphs captured, the median time of
  - the draft engine's propose on its device thread (no gRPC),
  - the same propose through the draft service (DraftClient), over the data
    plane and over the persistent gRPC stream, each split into the draft's
    reported compute and the rest (transport, encode/decode, thread hand-offs),
  - the target engine's verify, and the same verify through the target
    worker (validation, device-thread hop, metrics) as the round loop calls it,
side by side in one run. It names what the round loop's overhead is made of.

Must not know: scheduling (it calls the engines and clients directly).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from bench.engine import TINY

N = 200


def _median_ms(fn, n: int = N) -> float:
    for _ in range(10):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return float(np.median(out) * 1e3)


def main(args) -> int:
    from draft_service import server as draft_server
    from rounds.draft_client import DraftClient
    from core.config import SecurityConfig, ServerConfig
    from core.params import SamplingParams
    from runtime.config import CacheConfig, GraphConfig, RuntimeConfig, SpecConfig
    from worker.config import WorkerConfig
    from runtime.types import DraftPrefillRequest, PrefillRequest, ProposeRequest, VerifyRequest
    from target_service.rounds import LocalTarget
    from target_service.worker import TargetWorker

    model = Path(args.model) if args.model else TINY
    dev = args.device
    draft_dev = getattr(args, "draft_device", None) or dev

    def cfg(role: str, device: str) -> WorkerConfig:
        return WorkerConfig(role=role, target_path=str(model), weights_version="v1",
                            runtime=RuntimeConfig(backend="torch", device=device,
                                                  dtype=getattr(args, "dtype", None) or "float32"),
                            spec=SpecConfig(max_k=3, default_k=3), cache=CacheConfig(max_slots=8, max_len=4096),
                            graphs=GraphConfig(batch_buckets=(1, 2, 4, 8)), capture_on_start=True,
                            server=ServerConfig(host="127.0.0.1", port=0), security=SecurityConfig())

    draft = draft_server.start(cfg("draft", draft_dev))
    address = f"127.0.0.1:{draft.port}"
    # NOTE: both clients talk to the same draft service; GetStatus tells the first where the
    # data plane listens, the second keeps Propose on the gRPC stream.
    clients = {"data plane": DraftClient(address, timeout_s=60, max_message_bytes=1 << 26),
               "gRPC stream": DraftClient(address, timeout_s=60, max_message_bytes=1 << 26, data_plane=False)}
    for c in clients.values():
        c.get_status()
    if not clients["data plane"].uses_data_plane:
        raise SystemExit("specsplit: bench round-parts: the draft service advertises no data plane")
    client = clients["gRPC stream"]
    target = TargetWorker(cfg("target", dev))
    target.load_weights(str(model), "", "v1")
    target.capture_graphs()
    prompt = np.arange(1, 33, dtype=np.int64)
    res = target.prefill([PrefillRequest("x", prompt, SamplingParams())])[0]
    client.prefill([DraftPrefillRequest("x", prompt[1:], res.hidden[:-1], SamplingParams())])
    pairs = len(prompt) - 1
    hid = res.hidden[-1:]
    eng = draft.worker
    draft_cache = eng.engine.cache.get("x")

    # NOTE: every call starts from the same draft context (the cache is set back after it),
    # so the engine and the service are timed on equal work.
    def propose_engine():
        eng.device.run(lambda: eng.engine.propose([ProposeRequest("x", pairs, np.array([7]), hid, 3)]))
        draft_cache.length = pairs

    def through(c):
        comp: list[float] = []

        def propose():
            c.propose([ProposeRequest("x", pairs, np.array([7]), hid, 3)])
            draft_cache.length = pairs
            comp.append(c.last_compute_seconds)
        return propose, comp

    rows = [("draft propose, engine on its device thread", _median_ms(propose_engine))]
    for name, c in clients.items():
        fn, comp = through(c)
        total = _median_ms(fn)
        compute = float(np.median(comp[10:]) * 1e3)
        rows += [(f"draft propose through the service, {name}", total),
                 ("  of which the draft's reported compute", compute),
                 ("  of which transport + encode/decode + hand-offs", total - compute)]
    local = LocalTarget(target)

    start = target.engine.cache.get("x").length

    def verify_engine():
        target.device.run(lambda: target.engine.verify([VerifyRequest("x", np.array([1, 2, 3]), None)]))
        target.engine.cache.get("x").length = start              # stay at the same context

    def verify_worker():
        local.verify([VerifyRequest("x", np.array([1, 2, 3]), None)])
        target.engine.cache.get("x").length = start
    rows += [("target verify, engine on its device thread", _median_ms(verify_engine)),
             ("target verify through the worker (LocalTarget)", _median_ms(verify_worker))]
    print(f"bench round-parts: bundled model, batch 1, k=3, target {dev}, draft {draft_dev}, graphs, median of {N}")
    for name, ms in rows:
        print(f"{name:52s} {ms:8.3f} ms")
    for c in clients.values():
        c.close()
    draft.stop(grace=None)
    target.close()
    return 0
