"""Two micro-batches overlapped (runtime.micro_batch) on the bundled model, in-process ports.

The draft drafts one micro-batch on its own thread while the target verifies the
other. Each sequence still goes propose -> verify -> commit with the same drafts for
the same prefix, so greedy output equals target-only decoding token for token, and
coupled sampling with a seed equals the seeded target-only output; the overlap must
actually happen (drafts sent before a verify, collected after it), and every slot is
freed at the end. A draft call that fails mid-round leaves its micro-batch a
target-only step, the draft is treated as lost, and the output stays exact.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from core.params import SamplingParams
from rounds.scheduler import FinalEvent, GenerationRequest, Scheduler, WorkerUnavailable
from runtime.config import ConfigError, SpecConfig
from runtime.engine import GenRequest
from tests.unit.test_ahead import _drain
from tests.unit.test_engine_bundled import _engine, _prompts

MAX_TOKENS = 40


class ThreadedDraft:
    """The in-process draft with ``propose_async``: the Propose runs on another thread (while
    the scheduler's thread verifies); ``sent`` counts those calls; after ``fail_after`` of them
    every call fails as a dead draft would."""

    def __init__(self, draft, fail_after: int | None = None) -> None:
        self.draft = draft
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="test-draft")
        self.sent = 0
        self.fail_after = fail_after

    def prefill(self, reqs):
        return self.draft.prefill(reqs)

    def propose(self, reqs):
        return self.draft.propose(reqs)

    def release(self, request_id):
        return self.draft.release(request_id)

    def propose_async(self, reqs):
        self.sent += 1
        if self.fail_after is not None and self.sent > self.fail_after:
            fut = self.pool.submit(lambda: (_ for _ in ()).throw(WorkerUnavailable("draft gone (test)")))
        else:
            fut = self.pool.submit(self.draft.propose, reqs)
        return lambda: fut.result(timeout=60)


def _serve(eng, draft, reqs, **kw):
    sched = Scheduler(eng.target, draft, max_batch=4, max_queue=8, eos_token_id=257, micro_batches=True, **kw)
    sched.start()
    try:
        handles = [sched.submit(r) for r in reqs]
        return [_drain(h) for h in handles], sched
    finally:
        sched.stop()


@pytest.fixture(scope="module")
def eng():
    return _engine("torch", max_k=3)


def test_micro_batches_are_exact_and_overlap(eng):
    prompts = _prompts(5)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    coupled = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.0, seed=11,
                             sampling_mode="coupled")
    ref = [eng.generate([GenRequest(f"r{i}", p, greedy if i % 2 == 0 else coupled, 0)])[0].tokens
           for i, p in enumerate(prompts)]
    draft = ThreadedDraft(eng.draft)
    reqs = [GenerationRequest(f"m{i}", p, greedy if i % 2 == 0 else coupled, 3) for i, p in enumerate(prompts)]
    results, sched = _serve(eng, draft, reqs)
    for i, (tokens, final) in enumerate(results):
        assert isinstance(final, FinalEvent) and tuple(tokens) == ref[i] == final.output, i
        assert final.stats.drafted > 0 and final.stats.accepted > 0, i
    assert draft.sent >= 2 * MAX_TOKENS // 4                        # the draft was asked ahead of verifies
    assert eng.target.cache.used_slots == 0 and eng.draft.cache.used_slots == 0


def test_a_failed_overlapped_draft_call_loses_the_draft_not_the_output(eng):
    prompts = _prompts(4)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    ref = [eng.generate([GenRequest(f"r{i}", p, greedy, 0)])[0].tokens for i, p in enumerate(prompts)]
    draft = ThreadedDraft(eng.draft, fail_after=3)
    lost = []
    reqs = [GenerationRequest(f"f{i}", p, greedy, 3) for i, p in enumerate(prompts)]
    sched = Scheduler(eng.target, draft, max_batch=4, max_queue=8, eos_token_id=257, micro_batches=True)
    sched.on_draft_lost = lost.append
    sched.start()
    try:
        handles = [sched.submit(r) for r in reqs]
        results = [_drain(h) for h in handles]
    finally:
        sched.stop()
    for i, (tokens, final) in enumerate(results):
        assert isinstance(final, FinalEvent) and tuple(tokens) == ref[i], i
    assert lost and "draft gone" in lost[0].message                    # went on target-only
    assert eng.target.cache.used_slots == 0


def test_micro_batches_and_ahead_drafting_are_one_or_the_other():
    with pytest.raises(ConfigError, match="spec.micro_batches"):
        SpecConfig(micro_batches=True, ahead_drafting=True)
