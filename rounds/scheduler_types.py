"""What the scheduler and its callers exchange: errors, request events, timing.

Owns: the error contract between ports and the scheduler (``RequestError``,
``WorkerUnavailable``, ``ItemFailures``), a request and the events it
streams (``GenerationRequest``, ``TokensEvent``/``FinalEvent``/``ErrorEvent``,
``RequestHandle``), and the per-round timing record with its ``Observer``.

Must not know: channels, servicers, frameworks, how rounds are scheduled
(``rounds/scheduler.py``). Exceptions become status names only through
``core.wire.status_code_for``, the codebase's one map.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from core import wire
from core.params import SamplingParams
from runtime.round_driver import SeqStats

# --- the port error contract ---------------------------------------------------
class RequestError(Exception):
    """One request failed. ``code`` is a gRPC status code name, e.g. "INVALID_ARGUMENT"."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class WorkerUnavailable(RequestError):
    """A whole call to a worker failed (stream broken, deadline passed, worker down)."""

    def __init__(self, message: str) -> None:
        super().__init__("UNAVAILABLE", message)


class ItemFailures(Exception):
    """Some items of a batched call failed on the worker; the others succeeded.

    ``results`` has one entry per request of the call, ``None`` where
    ``errors`` (request id -> RequestError) says why that item failed.
    """

    def __init__(self, results: list[Any], errors: dict[str, RequestError]) -> None:
        super().__init__("; ".join(f"{rid}: {e}" for rid, e in errors.items()))
        self.results, self.errors = results, errors


def error_of(exc: BaseException) -> RequestError:
    """The status a whole-call exception gives every request of that call: a RequestError as it
    is, anything else through the codebase's one exception -> status map (``core.wire``)."""
    if isinstance(exc, RequestError):
        return exc
    return RequestError(wire.status_code_for(exc).name, wire.error_message(exc))


def local_results(role: str, reqs: list[Any], results: list[Any]) -> list[Any]:
    """A worker in this process answered ``results`` (an ``ItemError`` for a refused item) to
    ``reqs``: as they are, or ``ItemFailures`` naming each refused item (a remote answer's rule)."""
    errors = {q.request_id: RequestError(r.code.name, f"{role}: {r.message}")
              for q, r in zip(reqs, results) if isinstance(r, wire.ItemError)}
    if errors:
        raise ItemFailures([None if isinstance(r, wire.ItemError) else r for r in results], errors)
    return results


# --- what a request sees ---------------------------------------------------------
@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: tuple[int, ...]          # t_0..t_{n-1}, validated by the caller
    params: SamplingParams
    k: int                           # drafts per round; 0 = target-only
    resume_output: tuple[int, ...] = ()  # tokens produced before (a resumed request): re-prefilled, not re-sent
    fixed_k: bool = False            # draft k every round even where the loop adapts k (no policy)


@dataclass(slots=True)                 # per request per round, not frozen: runtime/types.py's module doc
class TokensEvent:
    tokens: tuple[int, ...]
    round: int
    num_accepted: int
    num_drafted: int
    weights_version: str
    timing: "RoundTiming | None" = None  # the round these tokens came from (None at admission)
    last: bool = False                  # the request finished in this round: its final event comes next


@dataclass(frozen=True)
class FinalEvent:
    finish_reason: str               # "stop" | "length" | "cancelled"
    output: tuple[int, ...]
    prompt_tokens: int
    stats: SeqStats
    weights_version: str


@dataclass(frozen=True)
class ErrorEvent:
    code: str                        # gRPC status code name
    message: str
    output: tuple[int, ...]          # what was streamed before the failure


Event = TokensEvent | FinalEvent | ErrorEvent


class QueueFull(Exception):
    """The admission queue is full (RESOURCE_EXHAUSTED)."""


class EventOutbox:
    """The events of many requests for one reader (a target's DecodeStream), handed over at
    round boundaries: the scheduler adds a round's events without waking the reader and
    flushes once. Why: every woken reader competes with the round loop for the process's
    GIL; one wake-up per round for the whole batch instead of one per request took an
    in-process batch of 8 from 1.17 to 0.74 ms a round on the H200 host
    (``scripts/round_host_probe.py``, docs/performance.md § Session 10).

    Items are (``who``, event): a ``RequestHandle`` for the scheduler's events, or a request
    id for events its reader adds itself (a refused join)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._items: list[tuple[Any, Event]] = []
        self._flushed = False

    def add(self, who: Any, ev: Event) -> None:
        with self._cv:
            self._items.append((who, ev))

    def flush(self) -> None:
        """Wake the reader if anything was added since it last took."""
        with self._cv:
            if self._items:
                self._flushed = True
                self._cv.notify()

    def take(self, timeout: float) -> list[tuple[Any, Event]]:
        """Everything added so far, oldest first; waits up to ``timeout`` for a flush."""
        with self._cv:
            if not self._flushed:
                self._cv.wait(timeout)
            items, self._items, self._flushed = self._items, [], False
            return items


class RequestHandle:
    """A submitted request: read its events; ``cancel`` from any thread. With an ``outbox``
    its events go there instead of to its own queue (``next_event`` then has none)."""

    def __init__(self, req: GenerationRequest, wake: Callable[[], None], outbox: EventOutbox | None = None) -> None:
        self.request = req
        self.events: queue.Queue[Event] = queue.Queue()
        self.outbox = outbox
        self._cancelled = threading.Event()
        self._wake = wake

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def push(self, ev: Event) -> EventOutbox | None:
        """Scheduler side: hand ``ev`` over; returns the outbox to flush, None when delivered."""
        if self.outbox is None:
            self.events.put(ev)
            return None
        self.outbox.add(self, ev)
        return self.outbox

    def next_event(self, timeout: float) -> Event | None:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

    def cancel(self) -> None:
        """Mark cancelled; the scheduler frees its slots at the next round boundary."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._wake()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


# --- timing and observation ------------------------------------------------------
@dataclass(frozen=True)
class RoundTiming:
    round: int
    batch: int
    draft_s: float                   # draft compute (worker-reported, else call wall time)
    target_s: float                  # target compute
    overhead_s: float                # round wall time - draft_s - target_s
    wall_s: float


@dataclass
class TimingTotals:
    rounds: int = 0
    batch_sum: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0
    overhead_s: float = 0.0
    wall_s: float = 0.0

    def add(self, t: RoundTiming) -> None:
        self.rounds += 1
        self.batch_sum += t.batch
        self.draft_s += t.draft_s
        self.target_s += t.target_s
        self.overhead_s += t.overhead_s
        self.wall_s += t.wall_s


class Observer(Protocol):
    def on_round(self, timing: RoundTiming, ks_and_accepts: list[tuple[int, int]]) -> None: ...
    def on_outcome(self, finish_reason: str | None, code: str) -> None: ...
    def on_load(self, active: int, queued: int) -> None: ...


class NullObserver:
    def on_round(self, timing: RoundTiming, ks_and_accepts: list[tuple[int, int]]) -> None: ...
    def on_outcome(self, finish_reason: str | None, code: str) -> None: ...
    def on_load(self, active: int, queued: int) -> None: ...
