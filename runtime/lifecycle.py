"""Worker lifecycle: the EMPTY -> LOADED -> READY state machine (DESIGN § Worker lifecycle).

Owns: the worker's lifecycle state, which transitions are allowed from which
state, the idempotent no-ops, the ordered event log of transitions (the last
256, reported by GetStatus) and notifying observers (metrics, health, logs)
of every transition attempt.

The worker that the lifecycle drives is ``worker/base.py``.

Must not know: gRPC, frameworks, models, scheduling. The work a transition
stands for is a callable passed to ``Lifecycle.apply``; the state machine only
decides whether it may run and records the result.

    EMPTY ──load_weights──▶ LOADED ──capture_graphs──▶ READY (graphs live)
      ▲                       │  ▲                       │
      └──release_weights──────┘  └──────clear_graphs─────┘

Rules:
- A refused transition raises ``LifecycleError`` (FAILED_PRECONDITION at the
  service) and leaves the state unchanged; so does a transition whose work
  raised (the work's exception propagates).
- No-ops where repeating is safe: capture_graphs when READY, clear_graphs when
  LOADED or EMPTY, release_weights when EMPTY. They run no work and are not
  events.
- release_weights while READY is refused: graphs read the weights, so they must
  be cleared first (by construction, never weights-before-graphs teardown).
- load_weights_in_place (copy into the existing parameters, addresses kept)
  keeps the state (LOADED or READY); it needs weights to copy into.
- Serving (Prefill / Propose / Verify) needs LOADED or READY.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from core.errors import FailedPrecondition

MAX_EVENTS = 256


class State(enum.Enum):
    EMPTY = "EMPTY"      # no weights on the device
    LOADED = "LOADED"    # weights loaded; serving runs eagerly
    READY = "READY"      # weights loaded and graphs captured


class LifecycleError(FailedPrecondition):
    """A transition or request not allowed in the current state (FAILED_PRECONDITION)."""


# Action names double as event names in the event log and as metric labels.
LOAD_WEIGHTS = "load_weights"
LOAD_WEIGHTS_IN_PLACE = "load_weights_in_place"
CAPTURE_GRAPHS = "capture_graphs"
CLEAR_GRAPHS = "clear_graphs"
RELEASE_WEIGHTS = "release_weights"
ACTIONS = (LOAD_WEIGHTS, LOAD_WEIGHTS_IN_PLACE, CAPTURE_GRAPHS, CLEAR_GRAPHS, RELEASE_WEIGHTS)

_OK, _NOOP, _REFUSED = "ok", "noop", "refused"

# action -> {from state: (to state, None) | (None, why refused) | "noop"}
_TABLE: dict[str, dict[State, object]] = {
    LOAD_WEIGHTS: {
        State.EMPTY: (State.LOADED, None),
        State.LOADED: (None, "weights are already loaded (state LOADED): call ReleaseWeights first, "
                             "or load with in_place=true"),
        State.READY: (None, "weights are already loaded and graphs are live (state READY): call ClearGraphs "
                            "and ReleaseWeights first, or load with in_place=true"),
    },
    LOAD_WEIGHTS_IN_PLACE: {
        State.EMPTY: (None, "an in-place load needs loaded weights to copy into (state EMPTY): "
                            "call LoadWeights with in_place=false"),
        State.LOADED: (State.LOADED, None),
        State.READY: (State.READY, None),
    },
    CAPTURE_GRAPHS: {
        State.EMPTY: (None, "cannot capture graphs without weights (state EMPTY): call LoadWeights first"),
        State.LOADED: (State.READY, None),
        State.READY: _NOOP,
    },
    CLEAR_GRAPHS: {
        State.EMPTY: _NOOP,
        State.LOADED: _NOOP,
        State.READY: (State.LOADED, None),
    },
    RELEASE_WEIGHTS: {
        State.EMPTY: _NOOP,
        State.LOADED: (State.EMPTY, None),
        # NOTE: refused, not done implicitly: the graphs read these weights, and
        # freeing weights under live graphs is the "teardown in the wrong order"
        # bug (a replay reads freed memory, or the clear hangs). Clear graphs first.
        State.READY: (None, "graphs are live (state READY): clear graphs first (ClearGraphs), "
                            "then ReleaseWeights"),
    },
}


@dataclass(frozen=True)
class Event:
    """One completed transition."""

    seq: int            # 1, 2, ... in order of completion
    action: str         # one of ACTIONS
    before: State
    after: State
    at: float           # time.time()
    detail: str = ""    # e.g. the weights version


# observer(action, outcome, before, after, detail): outcome in ok|noop|refused|failed
Observer = Callable[[str, str, State, State, str], None]


class Lifecycle:
    """The state machine. Thread-safe; callers serialize the work itself with their own lock."""

    def __init__(self, observers: list[Observer] | None = None, max_events: int = MAX_EVENTS) -> None:
        self._state = State.EMPTY
        self._events: deque[Event] = deque(maxlen=max_events)
        self._seq = 0
        self._observers: list[Observer] = list(observers or [])
        self._lock = threading.RLock()

    # --- reads (cheap, never block on work) ----------------------------------
    @property
    def state(self) -> State:
        return self._state

    @property
    def serving(self) -> bool:
        return self._state in (State.LOADED, State.READY)

    def events(self) -> list[Event]:
        return list(self._events)

    def event_names(self) -> list[str]:
        """Action names of the retained events, oldest first (GetStatus.lifecycle_events)."""
        return [e.action for e in list(self._events)]

    def add_observer(self, observer: Observer) -> None:
        self._observers.append(observer)

    # --- checks ----------------------------------------------------------------
    def check(self, action: str) -> State | None:
        """The state ``action`` would lead to, or None for a no-op; raises LifecycleError if refused.

        Advisory when called without holding the caller's lock (used to fail fast
        before slow work such as reading a checkpoint); ``apply`` checks again.
        """
        if action not in _TABLE:
            raise ValueError(f"unknown lifecycle action {action!r}; expected one of {ACTIONS}")
        rule = _TABLE[action][self._state]
        if rule == _NOOP:
            return None
        after, why = rule  # type: ignore[misc]
        if after is None:
            raise LifecycleError(f"{action} refused: {why}")
        return after

    def require_serving(self, what: str) -> None:
        """Raise LifecycleError unless the worker can serve ``what`` (LOADED or READY)."""
        state = self._state
        if state not in (State.LOADED, State.READY):
            raise LifecycleError(f"{what} needs loaded weights (state {state.value}): call LoadWeights first")

    # --- transitions -------------------------------------------------------------
    def apply(self, action: str, work: Callable[[], None] | None = None, detail: str = "") -> bool:
        """Run ``work`` for ``action`` if allowed, then commit the new state.

        Returns True for a transition, False for a no-op (``work`` not run).
        Raises LifecycleError when refused; re-raises ``work``'s exception. In
        both cases the state is unchanged and no event is recorded.
        """
        with self._lock:
            before = self._state
            try:
                after = self.check(action)
            except LifecycleError:
                self._notify(action, _REFUSED, before, before, detail)
                raise
            if after is None:
                self._notify(action, _NOOP, before, before, detail)
                return False
            try:
                if work is not None:
                    work()
            except BaseException:
                self._notify(action, "failed", before, before, detail)
                raise
            # NOTE: the state changes only after the work succeeded, so a failed
            # load/capture/clear never leaves a state that claims otherwise.
            self._state = after
            self._seq += 1
            self._events.append(Event(self._seq, action, before, after, time.time(), detail))
            self._notify(action, _OK, before, after, detail)
            return True

    def _notify(self, action: str, outcome: str, before: State, after: State, detail: str) -> None:
        for obs in list(self._observers):
            try:
                obs(action, outcome, before, after, detail)
            except Exception:  # an observer (metrics, health) must never break a transition
                pass
