"""``specsplit bench propose-host``: the host's own time per registry step and per greedy Propose.

Owns: timing, on the bundled tiny model (Torch), with graphs captured,
  - ``GraphRegistry.run`` per step kind (draft substep, catch-up, propose{k},
    target verify) at batch 1 and 4,
  - a whole greedy ``DraftEngine.propose`` at k = max_k: the fused path (one
    propose{k} replay) at batch 1 and 8 and the per-substep path (catch-up + k-1
    substeps) at batch 1,
  - a probe: the same propose whose catch-up carries ``PROBE_PAIRS`` skipped pairs
    (adaptive k's first drafting round after a target-only stretch), at batch 1 and 8,
  - a whole greedy ``TargetEngine.verify`` of k drafts at batch 1 and 8 (decode
    ahead does not queue: the call has drafts),
  - on CUDA, the fused propose and the whole verify again without the engines' reused
    read-back buffers (``torch_host.FetchRing``): a pinned allocation per tensor per call,
  - a target-only step (no drafts) at batch 1 and 8 with and without its hidden rows read
    back (``VerifyRequest.hidden``: a request the draft holds nothing of asks for none),
  - the draft registry's capture time with and without the propose kinds,
  - a round's Propose message on the host at batch 1 and 8, its hidden rows a tensor per item
    and one for the round: the target's encode, the draft servicer's decode and answer, the
    target's decode (``_wire_rows``; no replay to stub),
each with every graph replay replaced by a no-op ("stubbed"), so what is left
is the host's Python, numpy and copies (on CPU the eager stand-in graph would
otherwise hide it inside a CPU forward pass). On CUDA it also prints the same
calls with real replays, timed as ``bench graphs`` times host work (queue idle
before each call, not waited on after) and the propose's wall time.
The smallest of ``REPEATS`` means of ``ITERS`` calls each (the machines are shared: the
minimum is the figure least disturbed by other processes).
"""

from __future__ import annotations

import json
import time

import numpy as np

from bench.graphs import _host_us
from runtime.batch_layout import Row, layout_rows
from runtime.config import CacheConfig, EngineConfig, GraphConfig, RuntimeConfig, SpecConfig
from runtime.draft_engine import SUBSTEP
from runtime.engine import SpecEngine
from runtime.types import DraftPrefillRequest, PrefillRequest, ProposeRequest, VerifyRequest
from core.params import SamplingParams

ITERS, REPEATS = 400, 7
BUCKETS = (1, 2, 4, 8)
CONTEXT = 100            # pairs already in the draft cache
PROBE_PAIRS = 48         # a probe's catch-up: the pairs of a target-only stretch (adaptive k)
WHOLE_BATCHES = (1, 8)   # batches of the whole-engine rows


class _NoReplay:
    """A graph whose replay does nothing: what is timed around it is host work only."""

    def __init__(self, graph) -> None:
        self.graph = graph

    def replay(self) -> None:
        pass

    def reset(self) -> None:
        self.graph.reset()


def _stub(reg, on: bool) -> None:
    # Bench-only reach into the registry's captured graphs (the replay is what is left out).
    for cap in reg._captured.values():
        if on and not isinstance(cap.graph, _NoReplay):
            cap.graph = _NoReplay(cap.graph)
        elif not on and isinstance(cap.graph, _NoReplay):
            cap.graph = cap.graph.graph


def _us(fn, sync) -> float:
    """Smallest over REPEATS of the mean host time of ITERS calls (µs), after warm-up."""
    for _ in range(50):
        fn()
    sync()
    runs = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(ITERS):
            fn()
        runs.append((time.perf_counter() - t0) / ITERS * 1e6)
        sync()
    return min(runs)


def _timed(fn, registry, ops, device: str) -> tuple[float, float | None]:
    """(host µs of ``fn`` with every replay of ``registry`` stubbed, its wall µs with the replays
    on CUDA, else None)."""
    _stub(registry, True)
    stubbed = _us(fn, ops.synchronize)
    _stub(registry, False)
    return stubbed, (_us(fn, ops.synchronize) if device.startswith("cuda") else None)


def _ring_labels(engine, on: bool = True):
    """Yields the row labels of one timing with the engine's reused read-back buffers
    (``torch_host.FetchRing``) and, where it has them (CUDA), one without: a pinned allocation
    per tensor per call, as before session 24. Bench-only reach into the engine's attribute."""
    ring = engine._fetch_ring
    yield ""
    if on and ring is not None:
        engine._fetch_ring = None
        try:
            yield " (no fetch ring)"
        finally:
            engine._fetch_ring = ring


def _engine(device: str, k: int, fused: bool) -> SpecEngine:
    cfg = EngineConfig("models/tiny", runtime=RuntimeConfig(backend="torch", device=device),
                       spec=SpecConfig(max_k=k, default_k=k), cache=CacheConfig(max_slots=8, max_len=1024),
                       graphs=GraphConfig(batch_buckets=BUCKETS))
    return SpecEngine(cfg) if fused else SpecEngine(cfg, fused_propose=False)


class _Captured:
    """A data plane that keeps the sent frame and answers with a given response."""

    usable = True

    def __init__(self) -> None:
        self.body, self.response = b"", None

    def send(self, msg):
        self.body = msg.SerializeToString()
        return lambda what: self.response


class _CannedDraft:
    """A draft worker that answers every Propose with the proposals it was given (no model): what
    the servicer does around it is the message work timed."""

    class cfg:
        class security:
            max_tensor_bytes = 1 << 26

    def __init__(self, proposals) -> None:
        self.proposals = proposals

    def propose(self, items, round_):
        return self.proposals


def _wire_rows(d: int, k: int, rng) -> list[dict]:
    """A round's Propose message on the host, both sides, at batch 1 and 8 (hidden rows [k+1, d]
    float32 per item), each item's rows in its own tensor ("each") and the round's rows in one
    (``ProposeRequest.hidden_rows``, "one"): the target's encode (``DraftClient.propose_async`` up
    to the bytes), the draft's side (``DraftServicer.propose_frame``: parse, item decode, answer
    encode, with a worker that proposes at once), the target's parse and collect."""
    from draft_service.server import DraftServicer
    from rounds.draft_client import DraftClient
    from runtime.types import Proposal

    rows = []
    for b in WHOLE_BATCHES:
        reqs = [ProposeRequest(f"w{i}", CONTEXT, rng.integers(0, 256, k + 1),
                               rng.standard_normal((k + 1, d)).astype(np.float32), k) for i in range(b)]
        props = [Proposal(r.request_id, rng.integers(0, 256, k), None) for r in reqs]
        servicer = DraftServicer(_CannedDraft(props), None)
        for joined in (False, True):
            client = DraftClient.__new__(DraftClient)   # the message path only: no channel, no socket
            client._data, client._pending_release, client._next_round = _Captured(), [], lambda: 1
            client._hidden_rows = joined
            collect = client.propose_async(reqs)
            body = client._data.body
            answer = servicer.propose_frame(body)

            def target_decode(answer=answer, collect=collect, client=client):
                from specsplit.v1 import draft_pb2
                client._data.response = draft_pb2.ProposeResponse.FromString(answer)
                return collect()
            assert [p.drafts.tolist() for p in target_decode()] == [p.drafts.tolist() for p in props]
            how = "one tensor" if joined else "each item"
            rows += [{"what": f"propose message ({how}): target encode", "batch": b,
                      "host_us_stubbed": round(_us(lambda reqs=reqs, c=client: c.propose_async(reqs), lambda: None), 1)},
                     {"what": f"propose message ({how}): draft side", "batch": b,
                      "host_us_stubbed": round(_us(lambda body=body: servicer.propose_frame(body), lambda: None), 1)},
                     {"what": f"propose message ({how}): target decode", "batch": b,
                      "host_us_stubbed": round(_us(target_decode, lambda: None), 1)}]
    return rows


def main(args) -> int:
    device, k = args.device, args.k
    rng = np.random.default_rng(0)
    engines, capture_s = {}, {}
    for fused in (True, False):
        eng = engines[fused] = _engine(device, k, fused)
        t0 = time.perf_counter()
        eng.draft_registry.capture_all()
        capture_s[fused] = time.perf_counter() - t0
        eng.target_registry.capture_all()
    eng = engines[True]
    ops, draft, target = eng.ops, eng.draft, eng.target
    d, scratch, max_len = eng.model_cfg.hidden_size, draft.cache.scratch_slot, draft.cache.max_len
    fused_kinds = f"propose{k}" in draft.registry.kinds

    def step_inputs(kind: str, b: int) -> tuple:
        width = 1 if kind == SUBSTEP else k + 1
        rows = [Row(i, CONTEXT, rng.integers(0, 256, width)) for i in range(b)]
        lay = layout_rows(rows, width, scratch, max_len)
        base = {"tokens": lay.tokens, "write_slots": lay.write_slots, "positions": lay.positions,
                "read_slots": lay.read_slots}
        if kind == "verify":
            return target.registry, target._verify_kind, base
        base["last_index"] = lay.last_index
        if kind == SUBSTEP:          # as in a propose: g and the argmax come from the previous step
            base.update(prev_hidden=ops.zeros((b, 1, d)), tokens=ops.zeros((b, 1), "int64"))
            return draft.registry, SUBSTEP, base
        base["prev_hidden"] = rng.standard_normal((b, width, d)).astype(np.float32)
        if kind == "catchup":
            return draft.registry, draft._catchup_kind, base
        base["sub_write_slots"] = np.repeat(np.arange(b)[:, None], k - 1, 1)
        base["sub_positions"] = CONTEXT + width + np.arange(k - 1)[None, :].repeat(b, 0)
        return draft.registry, f"propose{k}", base

    rows = []
    kinds = [SUBSTEP, "catchup", "verify"] + (["propose"] if fused_kinds and k > 1 else [])
    for kind in kinds:
        for b in (1, 4):
            reg, name, inp = step_inputs(kind, b)
            assert reg.run(name, inp)[1], f"{name}@{b} did not replay"
            _stub(reg, True)
            stubbed = _us(lambda: reg.run(name, inp), ops.synchronize)
            _stub(reg, False)
            real = _host_us(lambda: reg.run(name, inp), 200, ops.synchronize) if device.startswith("cuda") else None
            rows.append({"what": f"run {name}", "batch": b, "host_us_stubbed": round(stubbed, 1),
                         "host_us_with_replay": None if real is None else round(real, 1)})

    # Whole greedy proposes at batch 1 and 8, k = max_k: each call continues every request by
    # k+1 pairs and is then rolled back (the draft's pair count), so every call is the same propose.
    for fused in (True, False):
        if fused and not fused_kinds:
            continue
        dr = engines[fused].draft
        for b in WHOLE_BATCHES if fused else (1,):
            ids = [f"b{fused:d}-{b}-{i}" for i in range(b)]
            dr.prefill([DraftPrefillRequest(r, rng.integers(0, 256, CONTEXT),
                                            rng.standard_normal((CONTEXT, d)).astype(np.float32), SamplingParams())
                        for r in ids])
            states = [dr.cache.get(r) for r in ids]
            news = [ProposeRequest(r, CONTEXT, rng.integers(0, 256, k + 1),
                                   rng.standard_normal((k + 1, d)).astype(np.float32), k) for r in ids]

            def one(dr=dr, states=states, news=news):
                dr.propose(news)
                for st in states:
                    st.length = CONTEXT

            before = dr.fused_proposes if fused else None
            one()
            assert (dr.fused_proposes > before) if fused else True
            for label in _ring_labels(dr, fused):
                stubbed, wall = _timed(one, dr.registry, ops, device)
                rows.append({"what": f"propose k={k} " + ("fused" if fused else "per-substep") + label, "batch": b,
                             "host_us_stubbed": round(stubbed, 1), "wall_us": None if wall is None else round(wall, 1)})
            for r in ids:
                dr.release(r)

    # A probe: the first greedy propose after PROBE_PAIRS target-only rounds, whose catch-up
    # carries every skipped pair (its head in catchup{4(k+1)} passes, then the fused propose).
    dr = engines[True].draft
    for b in WHOLE_BATCHES:
        ids = [f"p-{b}-{i}" for i in range(b)]
        dr.prefill([DraftPrefillRequest(r, rng.integers(0, 256, CONTEXT),
                                        rng.standard_normal((CONTEXT, d)).astype(np.float32), SamplingParams())
                    for r in ids])
        states = [dr.cache.get(r) for r in ids]
        news = [ProposeRequest(r, CONTEXT, rng.integers(0, 256, PROBE_PAIRS),
                               rng.standard_normal((PROBE_PAIRS, d)).astype(np.float32), k) for r in ids]

        def probe(dr=dr, states=states, news=news):
            dr.propose(news)
            for st in states:
                st.length = CONTEXT

        probe()
        stubbed, wall = _timed(probe, dr.registry, ops, device)
        rows.append({"what": f"propose k={k} probe ({PROBE_PAIRS} pairs)", "batch": b,
                     "host_us_stubbed": round(stubbed, 1), "wall_us": None if wall is None else round(wall, 1)})
        for r in ids:
            dr.release(r)

    # A whole greedy TargetEngine.verify of k drafts at batch 1 and 8, rolled back the same way
    # (each request's length and last token), so every call is the same verify.
    tgt = engines[True].target
    for b in WHOLE_BATCHES:
        ids = [f"v{b}-{i}" for i in range(b)]
        tgt.prefill([PrefillRequest(r, rng.integers(0, 256, CONTEXT), SamplingParams()) for r in ids])
        saved = [(tgt.cache.get(r), tgt.requests[r], tgt.cache.get(r).length, tgt.requests[r].last_token)
                 for r in ids]
        verifies = [VerifyRequest(r, rng.integers(0, 256, k), None) for r in ids]

        def check(tgt=tgt, saved=saved, verifies=verifies):
            tgt.verify(verifies)
            for st, req, length, last in saved:
                st.length, req.last_token = length, last

        for label in _ring_labels(tgt):
            stubbed, wall = _timed(check, tgt.registry, ops, device)
            rows.append({"what": f"verify k={k} (whole engine call){label}", "batch": b,
                         "host_us_stubbed": round(stubbed, 1), "wall_us": None if wall is None else round(wall, 1)})
        # A target-only step (no drafts) with and without the hidden rows read back: a request
        # the draft holds nothing of asks for none (VerifyRequest.hidden). Nothing queued ahead
        # here (each call is rolled back, so a queued step would never be taken).
        ahead, tgt.decode_ahead = tgt.decode_ahead, False
        for want in (True, False):
            steps = [VerifyRequest(r, np.zeros(0, dtype=np.int64), None, hidden=want) for r in ids]

            def step(tgt=tgt, saved=saved, steps=steps):
                tgt.verify(steps)
                for st, req, length, last in saved:
                    st.length, req.last_token = length, last

            stubbed, wall = _timed(step, tgt.registry, ops, device)
            rows.append({"what": "verify k=0 (target-only), hidden rows " + ("read" if want else "not read"),
                         "batch": b, "host_us_stubbed": round(stubbed, 1),
                         "wall_us": None if wall is None else round(wall, 1)})
        tgt.decode_ahead = ahead
        for r in ids:
            tgt.release(r)

    rows += _wire_rows(d, k, rng)

    out = {"device": device, "k": k, "buckets": BUCKETS, "context": CONTEXT, "rows": rows,
           "draft_capture_s": {"with propose kinds": round(capture_s[True], 3),
                               "catch-up + substep only": round(capture_s[False], 3)},
           "draft_graphs": {"with propose kinds": len(engines[True].draft_registry.span_keys()),
                            "catch-up + substep only": len(engines[False].draft_registry.span_keys())}}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"bench propose-host: torch {device}, bundled tiny model, k={k}, buckets {BUCKETS}, context {CONTEXT}; "
          f"best of {REPEATS} x {ITERS} calls; 'stubbed' = every graph replay a no-op")
    print(f"{'what':46s} {'batch':>5s} {'host us (stubbed)':>18s} {'with replay':>12s}")
    for r in rows:
        other = r.get("host_us_with_replay", r.get("wall_us"))
        print(f"{r['what']:46s} {r['batch']:5d} {r['host_us_stubbed']:18.1f} {'-' if other is None else other:>12}")
    print(f"draft capture: {out['draft_capture_s']} s, graphs {out['draft_graphs']}")
    return 0
