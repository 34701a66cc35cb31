"""The colocated draft's pieces without a server: ``rounds.local_draft.LocalDraft`` over a recording
worker (releases before the next prefill or propose, per-item and whole-call errors as a remote
draft's), the ``colocated_draft`` / ``draft_device`` config rules, and the launcher's command line."""

from __future__ import annotations

import numpy as np
import pytest

from core.config import ConfigError
from core.params import SamplingParams
from core.wire import item_error_for
from rounds.guards import GuardedDraft
from rounds.local_draft import LocalDraft
from rounds.scheduler_types import ItemFailures, RequestError
from runtime.config import RuntimeConfig
from runtime.lifecycle import LifecycleError
from runtime.types import DraftPrefillRequest, Proposal, ProposeRequest
from specsplit.launcher import StackOptions, target_argv
from worker.config import WorkerConfig


class _Worker:
    """What LocalDraft calls on a draft worker, recorded in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail: Exception | None = None          # raised by the next prefill / propose (a whole call)
        self.refuse: set[str] = set()               # request ids answered with an ItemError

    def _answer(self, items: list, result) -> list:
        if self.fail is not None:
            raise self.fail
        return [item_error_for(ValueError(f"bad {q.request_id}")) if q.request_id in self.refuse else result(q)
                for q in items]

    def release(self, ids: list[str], inline: bool = False) -> list[str]:
        self.calls.append(("release", tuple(ids), inline))
        return list(ids)

    def prefill(self, items: list, inline: bool | None = None) -> list:
        self.calls.append(("prefill", tuple(q.request_id for q in items), inline))
        return self._answer(items, lambda q: None)

    def propose(self, items: list, round_: int = 0, inline: bool | None = None) -> list:
        self.calls.append(("propose", tuple(q.request_id for q in items), inline))
        return self._answer(items, lambda q: Proposal(q.request_id, np.arange(q.k, dtype=np.int64), None))

    def propose_async(self, items: list, round_: int = 0):
        self.calls.append(("propose_async", tuple(q.request_id for q in items)))
        return lambda: self.propose(items, round_, inline=False)


def _prefill(rid: str) -> DraftPrefillRequest:
    return DraftPrefillRequest(rid, np.array([5], dtype=np.int64), np.zeros((1, 8), np.float32), SamplingParams())


def _propose(rid: str, k: int = 2) -> ProposeRequest:
    return ProposeRequest(rid, 4, np.array([1], dtype=np.int64), np.zeros((1, 8), np.float32), k)


def test_releases_go_before_the_next_prefill_and_propose_and_the_rest_on_flush():
    w = _Worker()
    d = LocalDraft(w, lambda: None, "in-process", inline=True)
    assert d.release("a") and w.calls == []                  # deferred, as a remote draft's ride on a message
    d.prefill([_prefill("a")])
    assert w.calls == [("release", ("a",), True), ("prefill", ("a",), True)]
    d.release("b")
    out = d.propose([_propose("a")])
    assert w.calls[2:] == [("release", ("b",), True), ("propose", ("a",), True)]
    assert [list(p.drafts) for p in out] == [[0, 1]] and d.last_compute_seconds is not None
    d.release("a")
    d.flush_releases()
    d.flush_releases()                                       # nothing left: no call
    assert w.calls[4:] == [("release", ("a",), True)]


def test_an_overlapped_propose_flushes_releases_first_and_answers_when_collected():
    w = _Worker()
    d = LocalDraft(w, lambda: None, "in-process", inline=False)           # the draft on another device
    d.release("old")
    collect = d.propose_async([_propose("a"), _propose("b")])
    assert w.calls == [("release", ("old",), False), ("propose_async", ("a", "b"))]
    w.refuse = {"b"}                                         # decided when the queued job runs
    with pytest.raises(ItemFailures) as failures:
        collect()
    assert set(failures.value.errors) == {"b"}
    w.refuse, w.fail = set(), LifecycleError("Propose needs loaded weights (state EMPTY)")
    with pytest.raises(RequestError, match="state EMPTY"):
        d.propose_async([_propose("a")])()


def test_on_the_targets_device_an_overlapped_propose_runs_at_once():
    w = _Worker()
    d = LocalDraft(w, lambda: None, "in-process", inline=True)
    collect = d.propose_async([_propose("a")])
    assert w.calls == [("propose", ("a",), True)]                         # already ran, on this thread
    assert [list(p.drafts) for p in collect()] == [[0, 1]] and len(w.calls) == 1


def test_another_device_is_never_run_on_the_round_loops_thread():
    w = _Worker()
    d = LocalDraft(w, lambda: None, "in-process", inline=False)
    d.propose([_propose("a")])
    assert w.calls == [("propose", ("a",), False)]


def test_drafts_stay_on_the_device_only_on_the_targets_device():
    """The round asks for drafts on the device only of a port that says so: an in-process draft
    on the target's device that is allowed to (``colocated_device_drafts``), as the round's guard
    passes it on; on another device, or over the network, never."""
    on = LocalDraft(_Worker(), lambda: None, "in-process", inline=True, drafts_on_device=True)
    other_device = LocalDraft(_Worker(), lambda: None, "in-process", inline=False, drafts_on_device=True)
    switched_off = LocalDraft(_Worker(), lambda: None, "in-process", inline=True)
    assert on.drafts_on_device and not other_device.drafts_on_device and not switched_off.drafts_on_device
    assert GuardedDraft(on, {}).drafts_on_device and not GuardedDraft(object(), {}).drafts_on_device


def test_refused_items_and_failed_calls_are_what_a_remote_draft_gives():
    w = _Worker()
    d = LocalDraft(w, lambda: None, "in-process")
    w.refuse = {"b"}
    with pytest.raises(ItemFailures) as failures:
        d.propose([_propose("a"), _propose("b")])
    assert set(failures.value.errors) == {"b"} and failures.value.errors["b"].code == "INVALID_ARGUMENT"
    assert failures.value.results[0] is not None and failures.value.results[1] is None
    w.refuse, w.fail = set(), LifecycleError("Propose needs loaded weights (state EMPTY)")
    with pytest.raises(RequestError) as err:                 # the scheduler's cue: the draft is lost
        d.propose([_propose("a")])
    assert err.value.code == "FAILED_PRECONDITION" and "state EMPTY" in err.value.message
    w.fail = RuntimeError("device lost")
    with pytest.raises(RequestError) as err:
        d.prefill([_prefill("a")])
    assert err.value.code == "INTERNAL"


def test_colocated_draft_config_rules():
    cfg = WorkerConfig(role="target", target_path="/m", colocated_draft=True, draft_device="cuda:1",
                       runtime=RuntimeConfig(backend="torch", device="cuda:0"), data_plane_port=7000)
    d = cfg.colocated_draft_config()
    assert (d.role, d.runtime.device, d.data_plane_port, d.colocated_draft) == ("draft", "cuda:1", -1, False)
    assert (d.target_path, d.spec, d.cache, d.graphs) == (cfg.target_path, cfg.spec, cfg.cache, cfg.graphs)
    same = WorkerConfig(role="target", target_path=None, colocated_draft=True).colocated_draft_config()
    assert same.runtime.device == "cpu"                      # empty draft_device: the target's
    for bad, name in ((dict(role="draft", colocated_draft=True), "colocated_draft"),
                      (dict(role="target", colocated_draft=True, tp=2, runtime=RuntimeConfig(backend="torch")),
                       "colocated_draft"),
                      (dict(role="target", draft_device="cuda:1"), "draft_device"),
                      (dict(role="target", colocated_draft=True, draft_device="gpu1"), "draft_device")):
        with pytest.raises(ConfigError, match=name):
            WorkerConfig(target_path=None, **bad)


def test_the_launcher_starts_the_draft_inside_the_target():
    opts = StackOptions(model="/m", colocated_draft=True, draft_device="cuda:1", target_device="cuda:0")
    argv = target_argv(opts)
    assert argv[-3:] == ["--colocated-draft", "--draft-device", "cuda:1"]
    assert "--colocated-draft" not in target_argv(StackOptions(model="/m"))
    assert "--colocated-draft" not in target_argv(StackOptions(model="/m", colocated_draft=True, no_draft=True))
    with pytest.raises(ValueError, match="draft_args"):
        target_argv(StackOptions(model="/m", colocated_draft=True, draft_args=("--runtime-dtype", "bfloat16")))
