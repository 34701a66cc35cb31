"""Unit tests for the worker lifecycle state machine (runtime/lifecycle.py)."""

from __future__ import annotations

import pytest

from runtime.lifecycle import (ACTIONS, CAPTURE_GRAPHS, CLEAR_GRAPHS, LOAD_WEIGHTS, LOAD_WEIGHTS_IN_PLACE,
                               RELEASE_WEIGHTS, Lifecycle, LifecycleError, State)

E, L, R = State.EMPTY, State.LOADED, State.READY

# (from, action) -> to state | "noop" | "refused"
EXPECTED = {
    (E, LOAD_WEIGHTS): L, (L, LOAD_WEIGHTS): "refused", (R, LOAD_WEIGHTS): "refused",
    (E, LOAD_WEIGHTS_IN_PLACE): "refused", (L, LOAD_WEIGHTS_IN_PLACE): L, (R, LOAD_WEIGHTS_IN_PLACE): R,
    (E, CAPTURE_GRAPHS): "refused", (L, CAPTURE_GRAPHS): R, (R, CAPTURE_GRAPHS): "noop",
    (E, CLEAR_GRAPHS): "noop", (L, CLEAR_GRAPHS): "noop", (R, CLEAR_GRAPHS): L,
    (E, RELEASE_WEIGHTS): "noop", (L, RELEASE_WEIGHTS): E, (R, RELEASE_WEIGHTS): "refused",
}
PATH_TO = {E: [], L: [LOAD_WEIGHTS], R: [LOAD_WEIGHTS, CAPTURE_GRAPHS]}


def lifecycle_in(state: State, observed: list | None = None) -> Lifecycle:
    lc = Lifecycle([lambda *a: observed.append(a)] if observed is not None else None)
    for action in PATH_TO[state]:
        assert lc.apply(action)
    if observed is not None:
        observed.clear()
    assert lc.state == state
    return lc


def test_table_covers_every_state_and_action():
    assert {(s, a) for s in State for a in ACTIONS} == set(EXPECTED)


@pytest.mark.parametrize(("start", "action"), sorted(EXPECTED, key=lambda k: (k[0].value, k[1])))
def test_transition(start: State, action: str):
    observed: list = []
    lc = lifecycle_in(start, observed)
    events_before = lc.event_names()
    ran: list[str] = []
    expected = EXPECTED[(start, action)]
    if expected == "refused":
        with pytest.raises(LifecycleError) as info:
            lc.apply(action, lambda: ran.append(action))
        assert action in str(info.value)
        assert lc.state == start and lc.event_names() == events_before and ran == []
        assert observed == [(action, "refused", start, start, "")]
    elif expected == "noop":
        assert lc.apply(action, lambda: ran.append(action)) is False
        assert lc.state == start and lc.event_names() == events_before and ran == []
        assert observed == [(action, "noop", start, start, "")]
    else:
        assert lc.apply(action, lambda: ran.append(action), detail="v7") is True
        assert lc.state == expected and ran == [action]
        assert lc.event_names() == events_before + [action]
        assert lc.events()[-1].before == start and lc.events()[-1].after == expected
        assert lc.events()[-1].detail == "v7"
        assert observed == [(action, "ok", start, expected, "v7")]


def test_release_while_ready_says_clear_graphs_first():
    lc = lifecycle_in(R)
    with pytest.raises(LifecycleError, match="clear graphs first"):
        lc.apply(RELEASE_WEIGHTS)
    assert lc.state == R


@pytest.mark.parametrize("start", [L, R])
def test_failed_work_leaves_state_and_events_unchanged(start: State):
    observed: list = []
    lc = lifecycle_in(start, observed)
    events = lc.event_names()
    action = {L: CAPTURE_GRAPHS, R: CLEAR_GRAPHS}[start]

    def boom() -> None:
        raise OSError("device on fire")

    with pytest.raises(OSError, match="device on fire"):
        lc.apply(action, boom)
    assert lc.state == start and lc.event_names() == events
    assert observed == [(action, "failed", start, start, "")]


def test_failed_load_stays_empty():
    lc = Lifecycle()
    with pytest.raises(ValueError):
        lc.apply(LOAD_WEIGHTS, lambda: (_ for _ in ()).throw(ValueError("bad checkpoint")))
    assert lc.state == E and lc.events() == []


def test_check_is_side_effect_free():
    lc = lifecycle_in(L)
    assert lc.check(CAPTURE_GRAPHS) == R
    assert lc.check(CLEAR_GRAPHS) is None
    with pytest.raises(LifecycleError):
        lc.check(LOAD_WEIGHTS)
    assert lc.state == L and lc.event_names() == [LOAD_WEIGHTS]
    with pytest.raises(ValueError, match="unknown lifecycle action"):
        lc.check("explode")


def test_serving_needs_weights():
    lc = Lifecycle()
    assert not lc.serving
    with pytest.raises(LifecycleError, match="Verify needs loaded weights"):
        lc.require_serving("Verify")
    for action in (LOAD_WEIGHTS, CAPTURE_GRAPHS):
        lc.apply(action)
        lc.require_serving("Verify")
        assert lc.serving


def test_full_cycle_event_order():
    """Teardown order is visible in the log: clear_graphs strictly before release_weights."""
    lc = Lifecycle()
    for action in (LOAD_WEIGHTS, CAPTURE_GRAPHS, CAPTURE_GRAPHS, LOAD_WEIGHTS_IN_PLACE, CLEAR_GRAPHS,
                   CLEAR_GRAPHS, RELEASE_WEIGHTS, RELEASE_WEIGHTS, LOAD_WEIGHTS):
        lc.apply(action)
    assert lc.event_names() == [LOAD_WEIGHTS, CAPTURE_GRAPHS, LOAD_WEIGHTS_IN_PLACE, CLEAR_GRAPHS,
                                RELEASE_WEIGHTS, LOAD_WEIGHTS]
    assert [e.seq for e in lc.events()] == [1, 2, 3, 4, 5, 6]
    assert lc.state == L


def test_event_log_keeps_the_last_n():
    lc = Lifecycle(max_events=4)
    for _ in range(5):
        lc.apply(LOAD_WEIGHTS)
        lc.apply(RELEASE_WEIGHTS)
    assert len(lc.events()) == 4
    assert [e.seq for e in lc.events()] == [7, 8, 9, 10]


def test_observer_errors_do_not_break_transitions():
    def bad_observer(*_args: object) -> None:
        raise RuntimeError("metrics backend down")

    lc = Lifecycle([bad_observer])
    assert lc.apply(LOAD_WEIGHTS)
    assert lc.state == L
