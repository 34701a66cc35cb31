"""Target-only decoding one step ahead (runtime/decode_ahead.py) on CPU.

On CPU the registry's graphs are the eager stand-in, so a step queued ahead runs at
once; the bookkeeping (which verify may take it, what drops it) and the tokens are
the same code as on a GPU. Off by default on CPU; these tests switch it on.
"""

from __future__ import annotations

import numpy as np
import pytest

from core.params import SamplingParams
from runtime.engine import GenRequest
from runtime.types import PrefillRequest, VerifyRequest
from tests.unit.test_engine_bundled import _engine, _prompts

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def engine():
    eng = _engine("torch", max_k=3)
    eng.capture_graphs()                 # CPU: the eager stand-in, so steps "replay"
    return eng


def _generate(engine, prompts, ks, max_batch, ahead, max_tokens=24):
    engine.target.decode_ahead = ahead
    before = (engine.target.ahead_stats.used, engine.target.ahead_stats.launched)
    reqs = [GenRequest(f"p{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), k)
            for i, (p, k) in enumerate(zip(prompts, ks))]
    out = [r.tokens for r in engine.generate(reqs, max_batch=max_batch)]
    st = engine.target.ahead_stats
    return out, st.used - before[0], st.launched - before[1]


@pytest.mark.parametrize("max_batch", [1, 3])
def test_target_only_tokens_equal_with_steps_queued_ahead(engine, max_batch):
    prompts = [p[:40] for p in _prompts(4)]
    plain, used0, launched0 = _generate(engine, prompts, [0] * 4, max_batch, ahead=False)
    ahead, used, launched = _generate(engine, prompts, [0] * 4, max_batch, ahead=True)
    assert ahead == plain
    assert (used0, launched0) == (0, 0)
    # Every round but each batch's first takes the step its predecessor queued, except where
    # the batch changed (a request finished or joined) in between. A request's last round (one
    # token left) queues nothing: requests that end by length drop no step (round_driver's chain).
    assert used > 0.7 * 24 * 4 / max_batch and launched == used


def test_drafting_rounds_queue_nothing_and_mixed_batches_stay_exact(engine):
    prompts = [p[:40] for p in _prompts(3)]
    plain, _, _ = _generate(engine, prompts, [0, 3, 0], 3, ahead=False)
    ahead, used, launched = _generate(engine, prompts, [0, 3, 0], 3, ahead=True)
    assert ahead == plain
    # The k=3 request finishes first (more tokens a round); the other two go ahead after it.
    assert 0 < used <= launched
    tgt = engine.target
    _prefill(tgt, "d", prompts[0])
    tgt.verify([VerifyRequest("d", np.asarray([5, 6], dtype=np.int64), None)])
    assert tgt.steps.pending is None                 # a verify with drafts queues nothing
    tgt.release("d")


def test_rounds_without_drafts_run_the_one_position_step(engine, monkeypatch):
    """A verify in which no row drafts runs ``verify1`` (a step queued ahead too), one with drafts
    ``verify4`` (max_k + 1); target-only tokens equal those of the padded max_k + 1 step."""
    prompts = [p[:40] for p in _prompts(3)]
    kinds: list[str] = []
    run = engine.target.registry.run

    def spy(kind, inputs, need=None):
        kinds.append(kind)
        return run(kind, inputs, need=need)
    monkeypatch.setattr(engine.target.registry, "run", spy)
    one, _, _ = _generate(engine, prompts, [0] * 3, 3, ahead=False)
    assert kinds and set(kinds) == {"verify1"}
    kinds.clear()
    _, used, _ = _generate(engine, prompts, [0] * 3, 3, ahead=True)
    assert used > 0 and set(kinds) == {"verify1"}
    kinds.clear()
    _generate(engine, prompts, [0, 3, 0], 3, ahead=False)
    assert set(kinds) == {"verify1", "verify4"}
    monkeypatch.setattr(engine.target, "_decode_kind", "verify4")    # padded, as before verify1
    kinds.clear()
    padded, _, _ = _generate(engine, prompts, [0] * 3, 3, ahead=False)
    assert set(kinds) == {"verify4"} and padded == one


def _prefill(tgt, rid, prompt):
    return tgt.prefill([PrefillRequest(rid, np.asarray(prompt, dtype=np.int64), SamplingParams())])[0]


def test_prefill_release_and_weight_changes_drop_the_pending_step(engine):
    tgt = engine.target
    tgt.decode_ahead = True
    prompt = _prompts(1)[0][:30]
    _prefill(tgt, "a", prompt)
    tgt.verify([VerifyRequest("a", np.zeros(0, dtype=np.int64), None)])
    assert tgt.steps.pending is not None
    dropped = tgt.ahead_stats.dropped
    _prefill(tgt, "b", prompt)                                   # another request joins
    assert tgt.steps.pending is None and tgt.ahead_stats.dropped == dropped + 1
    tgt.verify([VerifyRequest("a", np.zeros(0, dtype=np.int64), None)])
    tgt.drop_pending()                                           # what the worker does before new weights
    assert tgt.steps.pending is None
    used = tgt.ahead_stats.used
    res = tgt.verify([VerifyRequest("a", np.zeros(0, dtype=np.int64), None)])
    assert tgt.ahead_stats.used == used                          # ran afresh, not the dropped step
    assert len(res[0].tokens) == 1
    tgt.release("a")
    tgt.release("b")
    assert tgt.steps.pending is None


def test_a_verify_with_other_rows_or_lengths_does_not_take_the_step(engine):
    tgt = engine.target
    tgt.decode_ahead = True
    prompt = _prompts(1)[0][:30]
    for rid in ("x", "y"):
        _prefill(tgt, rid, prompt)
    none = np.zeros(0, dtype=np.int64)
    tgt.verify([VerifyRequest("x", none, None), VerifyRequest("y", none, None)])
    used, dropped = tgt.ahead_stats.used, tgt.ahead_stats.dropped
    # The same rows in another order: not the queued step (its rows are in the old order).
    swapped = tgt.verify([VerifyRequest("y", none, None), VerifyRequest("x", none, None)])
    assert tgt.ahead_stats.used == used and tgt.ahead_stats.dropped == dropped + 1
    # Both requests have the same prompt and so the same next token either way.
    assert swapped[0].tokens == swapped[1].tokens
    again = tgt.verify([VerifyRequest("y", none, None), VerifyRequest("x", none, None)])
    assert tgt.ahead_stats.used == used + 1 and again[0].tokens == again[1].tokens
    for rid in ("x", "y"):
        tgt.release(rid)


def test_gate_pauses_after_mostly_dropped_steps_then_tries_again():
    from runtime import decode_ahead as da

    gate = da.AheadGate()
    for i in range(da.WINDOW):                       # alternating: half used, half dropped -> goes on
        assert gate.allow()
        gate.record(i % 2 == 0)
    assert gate.pauses == 0
    assert gate.allow()
    gate.record(False)                               # 9 of the last 16 dropped: more than half
    assert gate.pauses == 1
    assert [gate.allow() for _ in range(da.PAUSE)] == [False] * da.PAUSE
    assert gate.allow()                              # the pause is over: queuing again
    for _ in range(da.WINDOW):                       # still mostly dropped: twice the pause
        gate.record(False)
    assert gate.pauses == 2
    assert [gate.allow() for _ in range(2 * da.PAUSE)] == [False] * (2 * da.PAUSE) and gate.allow()
    for _ in range(da.WINDOW):                       # a window of used steps resets the backoff
        gate.record(True)
    for _ in range(da.WINDOW // 2 + 1):
        gate.record(False)
    assert gate.pauses == 3
    assert [gate.allow() for _ in range(da.PAUSE)] == [False] * da.PAUSE and gate.allow()


def test_rounds_that_alternate_with_drafting_stop_queuing_ahead(engine):
    """A target-only round followed by a drafting one drops its queued step every time; after a
    window of mostly drops the engine stops queuing (each drop was a wasted device step)."""
    from runtime import decode_ahead as da

    tgt = engine.target
    tgt.decode_ahead = True
    tgt.steps.gate = da.AheadGate()                 # no history from the other tests
    _prefill(tgt, "alt", _prompts(1)[0][:20])
    launched = tgt.ahead_stats.launched
    none, two = np.zeros(0, dtype=np.int64), np.asarray([3, 4], dtype=np.int64)
    for _ in range(da.WINDOW + 4):
        tgt.verify([VerifyRequest("alt", none, None)])
        tgt.verify([VerifyRequest("alt", two, None)])
    # Queued on the first window's target-only rounds (each dropped by the drafting round after
    # it), then paused: fewer launches than target-only rounds.
    assert tgt.ahead_stats.launched - launched == da.WINDOW
    assert tgt.steps.gate.pauses == 1
    tgt.release("alt")


def test_the_worker_drops_a_queued_step_before_new_weights_and_before_clearing_graphs(tmp_path):
    """The worker's ordering (worker/base.py): an in-place weight copy and ClearGraphs drop the
    step the engine queued ahead first. Regression guard: a step queued before an in-place
    copy read the old weights; taken afterwards, it would serve tokens of the old version."""
    from pathlib import Path

    from core.config import SecurityConfig, ServerConfig
    from runtime.config import CacheConfig, GraphConfig, RuntimeConfig, SpecConfig
    from target_service.worker import TargetWorker
    from worker.config import WorkerConfig

    tiny = Path(__file__).resolve().parents[2] / "models" / "tiny"
    cfg = WorkerConfig(role="target", target_path=str(tiny), weights_version="v1",
                       runtime=RuntimeConfig(backend="torch", device="cpu"), spec=SpecConfig(max_k=3, default_k=3),
                       cache=CacheConfig(max_slots=4, max_len=256), graphs=GraphConfig(batch_buckets=(1, 2)),
                       server=ServerConfig(port=0), security=SecurityConfig())
    w = TargetWorker(cfg)
    w.load_weights(str(tiny), "", "v1")
    w.capture_graphs()
    w.engine.decode_ahead = True                   # CPU: off by default (nothing would overlap)
    prompt = np.asarray(_prompts(1)[0][:20], dtype=np.int64)
    w.prefill([PrefillRequest("q", prompt, SamplingParams())])
    none = np.zeros(0, dtype=np.int64)

    def queued_after_verify():
        w.verify([VerifyRequest("q", none, None)])
        return w.engine.steps.pending is not None

    assert queued_after_verify()
    w.load_weights(str(tiny), "", "v2", in_place=True)
    assert w.engine.steps.pending is None
    assert queued_after_verify()
    w.clear_graphs()
    assert w.engine.steps.pending is None
    w.release(["q"])
    w.release_weights()


def test_a_verify_fetches_hidden_rows_only_for_the_requests_that_ask(engine):
    """A request the draft holds nothing of (target-only) asks for no hidden rows: its result has
    none, its tokens are the same, and a batch where nobody asks copies none to the host."""
    tgt, prompts = engine.target, [p[:30] for p in _prompts(2)]
    got, fetched = {}, []
    fetch = tgt.ops.to_numpy_many_async

    def counted(xs, *a, **kw):
        fetched.append(len(xs))
        return fetch(xs, *a, **kw)
    tgt.ops.to_numpy_many_async = counted
    try:
        for want in (True, False):
            for i, p in enumerate(prompts):
                _prefill(tgt, f"h{want}{i}", p)
            del fetched[len(fetched) - len(prompts):]          # the prefills' read-backs
            rounds = []
            for _ in range(3):
                rounds.append(tgt.verify([VerifyRequest(f"h{want}0", np.zeros(0, dtype=np.int64), None,
                                                        hidden=want),
                                          VerifyRequest(f"h{want}1", np.asarray([7, 8], dtype=np.int64), None,
                                                        hidden=False)]))
            got[want] = rounds
            for i in range(2):
                tgt.release(f"h{want}{i}")
    finally:
        tgt.ops.to_numpy_many_async = fetch
    assert fetched == [2, 2, 2, 1, 1, 1]                  # (hidden, argmax), then the argmax alone
    for with_rows, without in zip(got[True], got[False]):
        assert [(r.num_accepted, r.tokens) for r in with_rows] == [(r.num_accepted, r.tokens) for r in without]
        assert with_rows[0].hidden.shape == (1, tgt.cfg.hidden_size) and with_rows[1].hidden is None
        assert without[0].hidden is None and without[1].hidden is None
