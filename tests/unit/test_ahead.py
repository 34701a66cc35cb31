"""Ahead drafting (runtime.round_driver.run_round ``ahead``) on the bundled model, in-process ports.

While the target verifies round r, the draft drafts k+1 past d_k; round r+1 uses
them only when all of round r was accepted and the bonus equals the first. The
target still verifies every committed token, so greedy output must equal
target-only decoding token for token, and the ahead drafts must actually be used.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from rounds.scheduler import FinalEvent, GenerationRequest, Scheduler, TokensEvent
from core.params import SamplingParams
from runtime.engine import GenRequest
from runtime.types import ProposeRequest
from tests.unit.test_engine_bundled import _engine, _prompts

MAX_TOKENS = 48


def _drain(handle, timeout=60.0):
    tokens = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = handle.next_event(timeout=0.5)
        if isinstance(ev, TokensEvent):
            tokens.extend(ev.tokens)
        elif ev is not None:
            return tokens, ev
    raise AssertionError(f"{handle.request_id}: no final event within {timeout}s")


@pytest.mark.parametrize("graphs", [False, True])
def test_ahead_drafting_is_exact_and_used(graphs):
    """graphs: captured (the eager stand-in on CPU), so the proposals whose ends the ahead calls
    continue come from one fused propose{k} replay (runtime/fused_propose.py)."""
    # Torch only: the ahead path is backend-agnostic code over Ops, and Paddle's CPU steps are the
    # slowest part of the suite (both backends' substeps are covered by test_engine_bundled).
    eng = _engine("torch", max_k=3)
    if graphs:
        eng.capture_graphs()
    fused_before = _fused_replays(eng)
    prompts = _prompts(4)
    ref = {}
    for i, p in enumerate(prompts):
        ref[i] = eng.generate([GenRequest(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                                          0)])[0].tokens
    sched = Scheduler(eng.target, eng.draft, max_batch=3, max_queue=8, eos_token_id=257, ahead=True).start()
    try:
        handles = [sched.submit(GenerationRequest(f"a{i}", p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                                                  3)) for i, p in enumerate(prompts)]
        results = [_drain(h) for h in handles]
    finally:
        sched.stop()
    asked = used = 0
    for i, (tokens, final) in enumerate(results):
        assert isinstance(final, FinalEvent) and tuple(tokens) == ref[i] == final.output, i
        asked += final.stats.ahead_asked
        used += final.stats.ahead_used
    assert asked > 0 and 0 < used <= asked
    assert eng.target.cache.used_slots == 0 and eng.draft.cache.used_slots == 0
    assert (_fused_replays(eng) > fused_before) == graphs


def _fused_replays(eng):
    """Propose calls of the draft that took the fused path (one propose{k} replay each)."""
    return eng.draft.fused_proposes


def test_ahead_needs_a_kept_end():
    eng = _engine("torch", max_k=3)
    with pytest.raises(ValueError, match="no kept proposal end"):
        eng.draft.propose([ProposeRequest("nobody", 0, np.zeros(0, dtype=np.int64), np.zeros((0, 0), np.float32),
                                          2, ahead=True)])
