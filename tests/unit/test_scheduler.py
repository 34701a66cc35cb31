"""Continuous batching in ``rounds.scheduler`` over in-process ports (no gRPC).

The runtime engines (``TargetEngine``/``DraftEngine``) satisfy the round
driver's ports directly; wrappers around them inject per-item and whole-call
failures the way the gRPC clients report them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rounds.scheduler import (ErrorEvent, EventOutbox, FinalEvent, GenerationRequest, ItemFailures, QueueFull,
                                    RequestError, RoundTiming, Scheduler, TokensEvent, WorkerUnavailable)
from core.params import SamplingParams
from runtime.config import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig, SpecConfig
from runtime.engine import GenRequest, SpecEngine
from tests.byte_model import write_byte_model
from tests.waiting import wait_until as wait_for

EVENT_TIMEOUT_S = 30.0
SLOTS = 8


def make_tiny_model(path: Path, seed: int = 0) -> ModelConfig:
    return write_byte_model(path, seed, 512)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny")
    make_tiny_model(d)
    return d


def engine_cfg(model_dir: Path) -> EngineConfig:
    return EngineConfig(target_path=str(model_dir), runtime=RuntimeConfig(backend="paddle"),
                        spec=SpecConfig(max_k=3, default_k=3), cache=CacheConfig(max_slots=SLOTS, max_len=256))


@pytest.fixture(scope="module")
def reference(model_dir):
    eng = SpecEngine(engine_cfg(model_dir), use_draft=False)

    def run(prompt, params):
        return eng.generate([GenRequest("ref", tuple(prompt), params, k=0)])[0].tokens
    return run


@pytest.fixture()
def engines(model_dir):
    return SpecEngine(engine_cfg(model_dir))


class Recorder:
    def __init__(self) -> None:
        self.rounds: list[RoundTiming] = []
        self.outcomes: list[tuple[str | None, str]] = []

    def on_round(self, timing, ks_and_accepts) -> None:
        self.rounds.append(timing)

    def on_outcome(self, finish_reason, code) -> None:
        self.outcomes.append((finish_reason, code))

    def on_load(self, active, queued) -> None:
        pass


def make_scheduler(target, draft, max_batch=3, max_queue=16, observer=None) -> Scheduler:
    return Scheduler(target, draft, max_batch=max_batch, max_queue=max_queue, eos_token_id=257,
                     weights_version="v0", observer=observer).start()


def drain(handle):
    """(tokens streamed, final-or-error event, first round seen)."""
    tokens, first_round = [], None
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while time.monotonic() < deadline:
        ev = handle.next_event(timeout=0.5)
        if isinstance(ev, TokensEvent):
            first_round = ev.round if first_round is None else first_round
            tokens.extend(ev.tokens)
        elif ev is not None:
            return tokens, ev, first_round
    raise AssertionError(f"{handle.request_id}: no final event within {EVENT_TIMEOUT_S}s")


def prompt_of(i: int, n: int) -> tuple[int, ...]:
    rng = np.random.default_rng(100 + i)
    return (256, *(int(x) for x in rng.integers(0, 256, n - 1)))


def slots_free(engines) -> bool:
    return engines.target.cache.free_slots == SLOTS and engines.draft.cache.free_slots == SLOTS


# --- continuous batching ----------------------------------------------------------------------------
def test_continuous_batching_greedy_equals_target_only(engines, reference):
    rec = Recorder()
    sched = make_scheduler(engines.target, engines.draft, max_batch=3, observer=rec)
    try:
        specs = [(3, 30, 0), (17, 5, 1), (9, 40, 3), (1, 12, 3), (25, 22, 1), (6, 3, 0), (12, 35, 3), (4, 1, 3)]
        reqs = [GenerationRequest(f"r{i}", prompt_of(i, n), SamplingParams(max_tokens=m, ignore_eos=True), k)
                for i, (n, m, k) in enumerate(specs)]
        # A stop token cuts one request short (the stop token itself is returned).
        stop_ref = reference(prompt_of(99, 8), SamplingParams(max_tokens=30, ignore_eos=True))
        stop_tok = stop_ref[6]
        reqs.append(GenerationRequest("stop", prompt_of(99, 8),
                                      SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(stop_tok,)), 3))
        handles = [sched.submit(r) for r in reqs]
        results = {h.request_id: drain(h) for h in handles}
    finally:
        sched.stop()
    for r in reqs:
        tokens, final, _ = results[r.request_id]
        assert isinstance(final, FinalEvent), final
        expect = reference(r.prompt, r.params)
        if r.request_id == "stop":
            expect = expect[: expect.index(stop_tok) + 1]
            assert final.finish_reason == "stop"
        else:
            assert final.finish_reason == "length"
        assert tuple(tokens) == expect == final.output, r.request_id
        if r.k == 0 or r.params.max_tokens <= 2:
            assert final.stats.drafted == 0
        else:
            assert final.stats.drafted > 0
    # Joined mid-flight: later requests first produced tokens after earlier rounds ran;
    # the batch never exceeded max_batch.
    assert max(results[r.request_id][2] for r in reqs) > 0
    assert max(t.batch for t in rec.rounds) == 3
    assert all(t.overhead_s >= 0 and t.draft_s >= 0 and t.target_s > 0 for t in rec.rounds)
    assert slots_free(engines)
    assert sum(final.stats.accepted for _, final, _ in results.values()) > 0


def test_request_joining_mid_flight_sees_the_same_tokens(engines, reference):
    sched = make_scheduler(engines.target, engines.draft, max_batch=4)
    try:
        long = sched.submit(GenerationRequest("long", prompt_of(1, 10), SamplingParams(max_tokens=60, ignore_eos=True), 3))
        first = long.next_event(timeout=EVENT_TIMEOUT_S)
        assert isinstance(first, TokensEvent)
        late = sched.submit(GenerationRequest("late", prompt_of(2, 7), SamplingParams(max_tokens=20, ignore_eos=True), 1))
        late_tokens, late_final, late_round = drain(late)
        long_tokens, long_final, _ = drain(long)
    finally:
        sched.stop()
    assert late_round > first.round
    assert tuple(late_tokens) == reference(prompt_of(2, 7), SamplingParams(max_tokens=20, ignore_eos=True))
    assert (*first.tokens, *long_tokens) == reference(prompt_of(1, 10), SamplingParams(max_tokens=60, ignore_eos=True))
    assert isinstance(late_final, FinalEvent) and isinstance(long_final, FinalEvent)


def test_cancel_frees_slots_on_both_engines(engines, reference):
    rec = Recorder()
    sched = make_scheduler(engines.target, engines.draft, max_batch=2, observer=rec)
    try:
        victim = sched.submit(GenerationRequest("victim", prompt_of(3, 9), SamplingParams(max_tokens=200, ignore_eos=True), 3))
        other = sched.submit(GenerationRequest("other", prompt_of(4, 5), SamplingParams(max_tokens=50, ignore_eos=True), 1))
        queued = sched.submit(GenerationRequest("queued", prompt_of(5, 5), SamplingParams(max_tokens=5, ignore_eos=True), 1))
        assert isinstance(victim.next_event(timeout=EVENT_TIMEOUT_S), TokensEvent)
        wait_for(lambda: engines.draft.cache.has("victim"), "victim to hold a draft slot")
        victim.cancel()
        _, final, _ = drain(victim)
        assert isinstance(final, FinalEvent) and final.finish_reason == "cancelled"
        assert not engines.target.cache.has("victim") and not engines.draft.cache.has("victim")
        other_tokens, other_final, _ = drain(other)
        queued_tokens, _, _ = drain(queued)
        # A request cancelled while still waiting never reaches the workers.
        never = sched.submit(GenerationRequest("never", prompt_of(6, 5), SamplingParams(max_tokens=5), 1))
        never.cancel()
        assert isinstance(drain(never)[1], FinalEvent)
    finally:
        sched.stop()
    assert tuple(other_tokens) == reference(prompt_of(4, 5), SamplingParams(max_tokens=50, ignore_eos=True))
    assert tuple(queued_tokens) == reference(prompt_of(5, 5), SamplingParams(max_tokens=5, ignore_eos=True))
    assert ("cancelled", "CANCELLED") in rec.outcomes
    assert slots_free(engines)


class DeferredReleases:
    """A draft port that frees caches the way ``DraftClient`` does: a release waits for the next
    Prefill/Propose (or ``flush_releases``); ``log`` records the flushes, in order with outcomes."""

    def __init__(self, inner, log: list[str]) -> None:
        self.inner, self.log, self.pending = inner, log, []

    def _send_releases(self) -> None:
        ids, self.pending = self.pending, []
        for rid in ids:
            self.inner.release(rid)

    def prefill(self, reqs):
        self._send_releases()
        return self.inner.prefill(reqs)

    def propose(self, reqs):
        self._send_releases()
        return self.inner.propose(reqs)

    def release(self, request_id: str) -> bool:
        self.pending.append(request_id)
        return True

    def flush_releases(self) -> list[str]:
        self.log.append(f"flush {len(self.pending)}")
        ids = list(self.pending)
        self._send_releases()
        return ids


def test_the_last_request_ending_frees_its_deferred_draft_release_before_the_client_is_told(engines, reference):
    log: list[str] = []

    class Outcomes(Recorder):
        def on_outcome(self, finish_reason, code) -> None:
            log.append(f"outcome {code}")

    sched = make_scheduler(engines.target, DeferredReleases(engines.draft, log), max_batch=2, observer=Outcomes())
    try:
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        for rid in ("first", "second"):          # batch 1: each one is the last running when it ends
            tokens, final, _ = drain(sched.submit(GenerationRequest(rid, prompt_of(7, 6), params, 3)))
            assert isinstance(final, FinalEvent) and tuple(tokens) == reference(prompt_of(7, 6), params)
            assert slots_free(engines), rid      # no wait: the slots are free when the stream ends
    finally:
        sched.stop()
    # Regression: the flush came after the client was told (CI saw a draft slot still held).
    assert [e for e in log if e != "flush 0"] == ["flush 1", "outcome OK"] * 2, log


class GatedPrefill:
    """The draft port, with its prefill held until ``go`` is set (everything else passes through)."""

    def __init__(self, port) -> None:
        self.port, self.go, self.entered = port, threading.Event(), threading.Event()

    def prefill(self, reqs):
        self.entered.set()
        assert self.go.wait(EVENT_TIMEOUT_S), "the test never let the draft's prefill go"
        return self.port.prefill(reqs)

    def __getattr__(self, name):
        return getattr(self.port, name)


def test_the_first_token_reaches_the_client_before_the_drafts_prefill(engines, reference):
    """The prefill's token is streamed as soon as the target's prefill returns; the draft's
    prefill (held here) runs after it, and the request then goes on speculatively as usual."""
    draft = GatedPrefill(engines.draft)
    sched = make_scheduler(engines.target, draft)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    try:
        h = sched.submit(GenerationRequest("early", prompt_of(3, 8), params, 3))
        first = h.next_event(timeout=10.0)          # the draft's prefill is still held
        assert isinstance(first, TokensEvent) and len(first.tokens) == 1, first
        wait_for(draft.entered.is_set, "the draft's prefill to start")
        draft.go.set()
        tokens, final, _ = drain(h)
    finally:
        draft.go.set()
        sched.stop()
    assert isinstance(final, FinalEvent) and tuple(first.tokens) + tuple(tokens) == reference(prompt_of(3, 8), params)
    assert final.stats.drafted > 0 and slots_free(engines)


class CountingOutbox(EventOutbox):
    """Records, at every flush that wakes the reader, which requests' events it hands over."""

    def __init__(self) -> None:
        super().__init__()
        self.flushes: list[list[str]] = []

    def flush(self) -> None:
        with self._cv:
            if self._items and not self._flushed:
                self.flushes.append([who.request_id for who, _ in self._items])
        super().flush()


def test_an_outbox_gets_one_flush_per_round_with_every_requests_events(engines, reference):
    """Requests sharing an outbox (a DecodeStream) wake their reader once per round boundary for
    all of them, and the first token (prefill) is flushed before the draft's prefill runs."""
    draft = GatedPrefill(engines.draft)
    sched = make_scheduler(engines.target, draft, max_batch=3)
    box = CountingOutbox()
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    events: dict[str, list] = {}
    try:
        sched.pause_admission()
        handles = [sched.submit(GenerationRequest(f"o{i}", prompt_of(i, 6 + i), params, 3), box) for i in range(3)]
        sched.resume_admission()
        first = box.take(10.0)                     # the draft's prefill is still held
        assert box.flushes, "the first tokens were not flushed before the draft's prefill"
        assert sorted(who.request_id for who, _ in first) == ["o0", "o1", "o2"], first
        assert all(isinstance(ev, TokensEvent) and len(ev.tokens) == 1 for _, ev in first)
        for who, ev in first:
            events.setdefault(who.request_id, []).append(ev)
        wait_for(draft.entered.is_set, "the draft's prefill to start")
        draft.go.set()
        for _ in range(200):
            for who, ev in box.take(10.0):
                events.setdefault(who.request_id, []).append(ev)
            if all(evs and isinstance(evs[-1], FinalEvent) for evs in events.values()) and len(events) == 3:
                break
        assert all(h.next_event(0) is None for h in handles)     # nothing on the handles' own queues
    finally:
        draft.go.set()
        sched.stop()
    for i in range(3):
        *chunks, final = events[f"o{i}"]
        assert isinstance(final, FinalEvent)
        assert tuple(t for c in chunks for t in c.tokens) == reference(prompt_of(i, 6 + i), params)
    # One flush per boundary: after the admission's, every flush carried all three requests' events
    # until the first of them finished.
    rounds = box.flushes[1:]
    assert len(rounds) >= 3 and all(sorted(set(f)) == ["o0", "o1", "o2"] for f in rounds[:2]), box.flushes


# --- failures ----------------------------------------------------------------------------------------
class FailingItem:
    """Wraps an engine port; ``method`` fails for ``victim`` on its ``after``-th call
    (an ItemError of the worker), the other items run on the engine as usual."""

    def __init__(self, port, method: str, victim: str, after: int = 2) -> None:
        self.port, self.method, self.victim, self.after = port, method, victim, after
        self.calls = 0
        for name in ("prefill", "propose", "verify"):
            if hasattr(port, name) and name != method:
                setattr(self, name, getattr(port, name))
        setattr(self, method, self._maybe_fail)

    def _maybe_fail(self, reqs):
        self.calls += 1
        fail = self.calls >= self.after and any(r.request_id == self.victim for r in reqs)
        if not fail:
            return getattr(self.port, self.method)(reqs)
        rest = [r for r in reqs if r.request_id != self.victim]
        got = getattr(self.port, self.method)(rest) if rest else []
        out = iter(got if got is not None else [None] * len(rest))   # DraftEngine.prefill returns None
        results = [None if r.request_id == self.victim else next(out) for r in reqs]
        raise ItemFailures(results, {self.victim: RequestError("NOT_FOUND", f"request_id {self.victim!r} is unknown")})

    def release(self, request_id):
        return self.port.release(request_id)


@pytest.mark.parametrize("where", ["target.verify", "draft.propose", "target.prefill", "draft.prefill"])
def test_item_failure_ends_only_that_request(engines, reference, where):
    role, method = where.split(".")
    target, draft = engines.target, engines.draft
    after = 1 if method == "prefill" else 3
    if role == "target":
        target = FailingItem(target, method, "bad", after)
    else:
        draft = FailingItem(draft, method, "bad", after)
    sched = make_scheduler(target, draft, max_batch=4)
    try:
        params = SamplingParams(max_tokens=25, ignore_eos=True)
        handles = [sched.submit(GenerationRequest(rid, prompt_of(i, 6 + i), params, 3))
                   for i, rid in enumerate(["a", "bad", "b"])]
        results = {h.request_id: drain(h) for h in handles}
    finally:
        sched.stop()
    tokens, err, _ = results["bad"]
    assert isinstance(err, ErrorEvent) and err.code == "NOT_FOUND" and "bad" in err.message
    assert tuple(err.output) == tuple(tokens)
    for i, rid in enumerate(["a", "bad", "b"]):
        if rid != "bad":
            assert isinstance(results[rid][1], FinalEvent)
            assert tuple(results[rid][0]) == reference(prompt_of(i, 6 + i), params)
    assert slots_free(engines)


class DiesOnce:
    """Wraps the target; one verify call raises WorkerUnavailable (a broken stream)."""

    def __init__(self, port, on_call: int = 3) -> None:
        self.port, self.on_call, self.calls = port, on_call, 0
        self.prefill, self.release = port.prefill, port.release

    def verify(self, reqs):
        self.calls += 1
        if self.calls == self.on_call:
            raise WorkerUnavailable("target stream broken (injected)")
        return self.port.verify(reqs)


def test_whole_call_failure_ends_the_round_and_the_scheduler_keeps_serving(engines, reference):
    sched = make_scheduler(DiesOnce(engines.target), engines.draft, max_batch=4)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    try:
        hs = [sched.submit(GenerationRequest(f"x{i}", prompt_of(i, 5), params, 1)) for i in range(2)]
        for h in hs:
            _, ev, _ = drain(h)
            assert isinstance(ev, ErrorEvent) and ev.code == "UNAVAILABLE"
        after = sched.submit(GenerationRequest("after", prompt_of(7, 5), params, 3))
        tokens, final, _ = drain(after)
    finally:
        sched.stop()
    assert isinstance(final, FinalEvent) and tuple(tokens) == reference(prompt_of(7, 5), params)
    assert slots_free(engines)


class ProposeDiesOnce:
    """Wraps the draft; one propose call raises WorkerUnavailable."""

    def __init__(self, port, on_call: int = 3) -> None:
        self.port, self.on_call, self.calls = port, on_call, 0
        self.prefill, self.release = port.prefill, port.release

    def propose(self, reqs):
        self.calls += 1
        if self.calls == self.on_call:
            raise WorkerUnavailable("draft stream broken (injected)")
        return self.port.propose(reqs)


def test_failed_propose_ends_only_the_drafting_requests(engines, reference):
    sched = make_scheduler(engines.target, ProposeDiesOnce(engines.draft), max_batch=4)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    try:
        spec = sched.submit(GenerationRequest("spec", prompt_of(1, 5), params, 3))
        plain = sched.submit(GenerationRequest("plain", prompt_of(2, 5), params, 0))
        _, spec_ev, _ = drain(spec)
        plain_tokens, plain_ev, _ = drain(plain)
    finally:
        sched.stop()
    assert isinstance(spec_ev, ErrorEvent) and spec_ev.code == "UNAVAILABLE"
    assert isinstance(plain_ev, FinalEvent) and tuple(plain_tokens) == reference(prompt_of(2, 5), params)
    assert slots_free(engines)


def test_queue_full_is_refused_and_stop_ends_waiting_requests(engines):
    sched = Scheduler(engines.target, engines.draft, max_batch=1, max_queue=2, eos_token_id=257)
    # Not started: nothing leaves the queue, so the bound is exact.
    params = SamplingParams(max_tokens=5)
    handles = [sched.submit(GenerationRequest(f"q{i}", (256, 1), params, 1)) for i in range(3)]
    with pytest.raises(QueueFull, match="max_queue=2"):
        sched.submit(GenerationRequest("over", (256, 1), params, 1))
    assert sched.snapshot() == (0, 3)
    sched.start()
    sched.stop()
    for h in handles:
        ev = h.next_event(timeout=5)
        while isinstance(ev, TokensEvent):
            ev = h.next_event(timeout=5)
        assert isinstance(ev, (FinalEvent, ErrorEvent))
    assert slots_free(engines)


def test_at_round_boundary_runs_on_the_scheduler_thread(engines):
    sched = make_scheduler(engines.target, engines.draft)
    try:
        h = sched.submit(GenerationRequest("c", prompt_of(8, 5), SamplingParams(max_tokens=30, ignore_eos=True), 3))
        fut = sched.at_round_boundary(lambda: sched.snapshot())
        assert fut.result(timeout=EVENT_TIMEOUT_S)[0] in (0, 1)
        assert isinstance(drain(h)[1], FinalEvent)
    finally:
        sched.stop()


def test_no_draft_runs_target_only(engines, reference):
    sched = make_scheduler(engines.target, None)
    params = SamplingParams(max_tokens=15, ignore_eos=True)
    try:
        tokens, final, _ = drain(sched.submit(GenerationRequest("t", prompt_of(9, 6), params, 3)))
    finally:
        sched.stop()
    assert tuple(tokens) == reference(prompt_of(9, 6), params)
    assert final.stats.drafted == 0 and not sched.speculation_available


@pytest.mark.parametrize("loop_prior,watch", [(None, True), (0.0, True), (0.0, False)])
def test_adaptive_k_changes_only_the_speed_never_the_tokens(engines, reference, loop_prior, watch):
    """With adaptive k, each round's k follows the request's acceptance (0..k); greedy output stays exact.
    With a loop prior of 0 every request starts with a probe: a watch probe (the draft drafts beside
    a target-only step, nothing verified), or without them a newcomer probe (it drafts while the
    others in its batch do not)."""
    sched = Scheduler(engines.target, engines.draft, max_batch=3, max_queue=16, eos_token_id=257,
                      weights_version="v0", adaptive_k=True, watch_probes=watch).start()
    if loop_prior is not None:
        sched.costs.loop.successes, sched.costs.loop.trials = loop_prior * 100.0, 100.0
    try:
        reqs = [GenerationRequest(f"a{i}", prompt_of(40 + i, 9), SamplingParams(max_tokens=40, ignore_eos=True), 3)
                for i in range(4)]
        results = {h.request_id: drain(h) for h in [sched.submit(r) for r in reqs]}
    finally:
        sched.stop()
    assert sched.costs is not None and sched.costs.t_verify > 0
    for r in reqs:
        tokens, final, _ = results[r.request_id]
        assert isinstance(final, FinalEvent) and tuple(tokens) == reference(r.prompt, r.params), r.request_id
        assert final.stats.rounds >= final.stats.spec_rounds
        if loop_prior == 0.0:       # the first round of each is its probe, a watch or a drafting round
            assert final.stats.watch_probes > 0 or final.stats.spec_rounds > 0, r.request_id
    watched = [results[r.request_id][1].stats.watch_probes for r in reqs]
    # In process a watch's draft runs inside its round: once one was timed it costs a whole draft,
    # and the loop's later probes draft instead (AdaptiveLoop.watching_pays).
    assert (watched[0] > 0) == watch and (sum(watched) == 0) == (not watch)
    assert slots_free(engines)


class _OffByOneDrafts:
    """The draft engine with every draft moved off what it proposed ((d + 1) mod 256): the target
    rejects nearly all of them. Its drafts are changed on the host, so none may stay on the device.

    Each propose also costs ``DRAFT_COST`` seconds (a remote draft's round trip): on this model a
    draft is nearly free beside the target's step, and on a loaded 2-core CPU the loop measured a
    k = 1 round at about its target-only one (8 ms each); an acceptance estimate decaying toward 0
    from its prior then still paid for k = 1, and the loop rightly kept drafting (28 of 39 rounds).
    With a draft that costs something, drafting stops paying after a few rejected rounds."""

    DRAFT_COST = 5e-3

    drafts_on_device = False

    def __init__(self, draft) -> None:
        self.draft = draft

    def __getattr__(self, name):
        return getattr(self.draft, name)

    def propose(self, reqs):
        time.sleep(self.DRAFT_COST)        # the draft's cost, not a wait on anything
        return [dataclasses.replace(p, drafts=(p.drafts + 1) % 256) for p in self.draft.propose(reqs)]


def test_fixed_k_drafts_every_round_where_the_adaptive_loop_stops_drafting(engines, reference):
    """GenerationRequest.fixed_k takes a request out of adaptive k: it drafts its k every round (but a
    last one with a single token left), where an adaptive request on the same prompt soon drafts only
    in probes; both give the target-only tokens."""
    sched = Scheduler(engines.target, _OffByOneDrafts(engines.draft), max_batch=3, max_queue=16,
                      eos_token_id=257, weights_version="v0", adaptive_k=True, watch_probes=False).start()
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    try:
        adaptive = drain(sched.submit(GenerationRequest("ad", prompt_of(50, 9), params, 3)))
        fixed = drain(sched.submit(GenerationRequest("fx", prompt_of(50, 9), params, 3, fixed_k=True)))
    finally:
        sched.stop()
    want = reference(prompt_of(50, 9), params)
    assert tuple(adaptive[0]) == tuple(fixed[0]) == want
    a, f = adaptive[1].stats, fixed[1].stats
    assert f.spec_rounds >= f.rounds - 1 and f.rounds >= 30, f           # nearly every draft rejected
    assert a.spec_rounds <= a.rounds // 2, a
    assert slots_free(engines)
