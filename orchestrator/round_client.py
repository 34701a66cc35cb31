"""The orchestrator's view of the round loop that runs in the target service.

Owns: each admitted request's place on the one DecodeStream to the target
(``orchestrator.decode_mux``: its committed tokens come back as events, off the
rounds' critical path, batched per round for all requests), cancelling it when
the client goes away, the ``ControlRounds`` actions the reload and the draft
address need (pause / settle / abort / park / resume, configure, status),
turning the call's messages and status into the scheduler's event records
(one per round, also when several rounds came in one message), and feeding
the orchestrator's metrics from them (round time split, acceptance,
outcomes).

Must not know: how rounds run, models, tensors, frameworks. The target's
scheduler is the single owner of the batch; this side never sees a round.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import grpc

from rounds.scheduler_types import (ErrorEvent, Event, FinalEvent, GenerationRequest, NullObserver,
                                          RequestError, RoundTiming, TokensEvent)
from runtime.round_driver import SeqStats
from core import wire
from orchestrator.decode_mux import DecodeMux
from specsplit.v1 import target_pb2 as tpb

_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}
# Status codes of a broken Decode call that mean "the target is gone", not "this request is bad".
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
         grpc.StatusCode.UNKNOWN)

_DRAIN = {"wait": tpb.DRAIN_POLICY_WAIT, "abort": tpb.DRAIN_POLICY_ABORT, "park": tpb.DRAIN_POLICY_PARK}

def stats_from_proto(p: tpb.DecodeStats) -> SeqStats:
    return SeqStats(rounds=p.rounds, drafted=p.drafted, accepted=p.accepted, emitted_in_rounds=p.emitted_in_rounds,
                    spec_rounds=p.spec_rounds, pos_drafted=list(p.position_drafted),
                    pos_accepted=list(p.position_accepted), ahead_asked=p.ahead_asked, ahead_used=p.ahead_used,
                    watch_probes=p.watch_probes)


def _timing(p: tpb.DecodeChunk) -> RoundTiming | None:
    if not p.HasField("timing"):
        return None
    t = p.timing
    return RoundTiming(t.round, t.batch, t.draft_seconds, t.target_seconds, t.overhead_seconds, t.total_seconds)


class RemoteHandle:
    """A request in the target's round loop: ``next_event`` reads its Decode call."""

    def __init__(self, rounds: "RemoteRounds", request: GenerationRequest, call: Any) -> None:
        self.request, self._rounds, self._call = request, rounds, call
        self._cancelled = threading.Event()
        self._streamed: list[int] = []
        self._ended = False
        self._failure: str | None = None         # set by fail(): why the orchestrator ended the call
        self._pending: collections.deque[Event] = collections.deque()   # received, not returned yet

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """The client is gone: the target takes the request out at its next round boundary."""
        self._cancelled.set()
        self._call.cancel()

    def fail(self, reason: str) -> None:
        """End the call from this side (the target stopped answering): UNAVAILABLE with ``reason``."""
        self._failure = reason
        self._call.cancel()

    def next_event(self, timeout: float | None = None) -> Event | None:
        """The next event (blocks until the target sends one or the call ends; ``timeout`` is
        accepted for the scheduler's handle interface: a cancelled call always returns)."""
        if self._pending:
            ev = self._pending.popleft()
            return ev if isinstance(ev, TokensEvent) else self._end(ev)
        if self._ended:
            return None
        try:
            msg = next(self._call)
        except StopIteration:
            return self._end(ErrorEvent("UNAVAILABLE", "target: the Decode stream ended without a final event",
                                        tuple(self._streamed)))
        except grpc.RpcError as exc:
            if self._resume_after_reload(exc):
                return self.next_event(timeout)
            return self._end(self._error(exc))
        which = msg.WhichOneof("event")
        if which in ("chunk", "chunks"):
            self._queue_chunks([msg.chunk] if which == "chunk" else msg.chunks.chunks)
            return self.next_event(timeout)
        if which == "final":
            f = msg.final
            # NOTE: chunks that rode on the final event (chunk_in_final) come out first.
            self._queue_chunks(f.last_chunks)
            self._pending.append(FinalEvent(f.finish_reason, tuple(f.output), f.prompt_tokens,
                                            stats_from_proto(f.stats), f.weights_version))
            return self.next_event(timeout)
        err = msg.error
        return self._end(ErrorEvent(_CODE_NAMES.get(err.error.code, "INTERNAL"), err.error.message,
                                    tuple(err.streamed) or tuple(self._streamed)))

    def _queue_chunks(self, chunks: Any) -> None:
        """One message's chunks (one round each, oldest first) as events, each round observed."""
        for c in chunks:
            ev = TokensEvent(tuple(c.tokens), c.round, c.num_accepted, c.num_drafted, c.weights_version, _timing(c))
            self._streamed.extend(ev.tokens)
            self._rounds.observe_chunk(ev)
            self._pending.append(ev)

    def ready_tokens(self, weights_version: str | None = None) -> list[TokensEvent]:
        """The token events already received and not returned (the other rounds of the message
        the last one came in), without waiting, up to one of other weights than
        ``weights_version``: a stream sends them on in one message."""
        out: list[TokensEvent] = []
        while self._pending and isinstance(self._pending[0], TokensEvent) and (
                weights_version is None or self._pending[0].weights_version == weights_version):
            out.append(self._pending.popleft())
        return out

    def _resume_after_reload(self, exc: grpc.RpcError) -> bool:
        """The target went away during a weight reload (a RECOMPUTE reload parks requests in the
        target; a target restarted mid-reload lost them): once the reload has ended, rolled
        forward or back, the request joins again where it was (``resume_output``)."""
        rounds = self._rounds
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        if (code not in _GONE or self.cancelled or rounds.stopping or self._failure is not None
                or not rounds.reloading()):
            return False
        if not rounds.wait_reload(rounds.resume_wait_s) or self.cancelled:
            return False
        req = dataclasses.replace(self.request, resume_output=tuple(self._streamed))
        try:
            # NOTE: the draft may still hold this id's cache (its round loop died with the
            # target): free it before the request joins again under the same id.
            rounds.release_draft([req.request_id])
        except Exception:  # noqa: BLE001 - a draft that is away holds nothing to free
            pass
        try:
            self._call = rounds.open_call(req)
        except Exception:  # noqa: BLE001 - the original error stands
            return False
        return True

    def _error(self, exc: grpc.RpcError) -> Event:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else str(exc)
        streamed = tuple(self._streamed)
        if self._rounds.stopping:
            return ErrorEvent("UNAVAILABLE", "the orchestrator is shutting down", streamed)
        if self._failure is not None:
            self._rounds.orphaned.add(self.request_id)
            return ErrorEvent("UNAVAILABLE", self._failure, streamed)
        if self.cancelled:
            return FinalEvent("cancelled", streamed, len(self.request.prompt), SeqStats(), "")
        if code in _GONE:
            # NOTE: the target is gone, and with it the round loop that would have freed this
            # request's draft cache: the orchestrator frees it (``orphaned``, next poll).
            self._rounds.orphaned.add(self.request_id)
            return ErrorEvent("UNAVAILABLE", f"target Decode: {code.name}: {details}", streamed)
        return ErrorEvent(code.name, details or code.name, streamed)

    def _end(self, ev: Event) -> Event:
        self._ended = True
        self._rounds.finished(self, ev)
        return ev


class RemoteRounds:
    """Requests and control actions of the target's round loop, over the target client."""

    def __init__(self, target: Any, observer: Any = None, decode_deadline_s: float = 24 * 3600.0,
                 control_timeout_s: float = 30.0, resume_wait_s: float = 120.0, stream_interval: int = 1) -> None:
        self.target = target                     # rounds.worker_clients.TargetClient
        self.stream_interval = stream_interval   # tokens each request's Decode stream holds back (DecodeRequest)
        self.resume_wait_s = resume_wait_s
        # Hooks the orchestrator sets: is a reload running, wait for it, free a draft cache.
        self.reloading: Any = lambda: False
        self.wait_reload: Any = lambda timeout: True
        self.release_draft: Any = lambda ids: None
        self.observer = observer or NullObserver()
        self.decode_deadline_s, self.control_timeout_s = decode_deadline_s, control_timeout_s
        self.stopping = False
        self._open: set[RemoteHandle] = set()
        self._lock = threading.Lock()
        self._last_timed_round = 0              # the latest round whose timing was recorded
        # Requests whose Decode call broke with the target gone: their draft caches may be left
        # behind (the target's round loop died with them); the orchestrator releases them.
        self.orphaned: set[str] = set()
        # NOTE: a generation's only deadline is this generous bound: a dead target ends
        # the stream at once (the channel breaks), and cancel() ends a request when its
        # client leaves; requests move to a fresh stream at half the deadline.
        self._mux = DecodeMux(lambda requests: self.target.stub.DecodeStream(requests, timeout=self.decode_deadline_s),
                              decode_deadline_s)

    # --- requests ----------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> RemoteHandle:
        """Start the request's Decode call; its first event may be a refusal (e.g. queue full)."""
        if self.stopping:
            raise RequestError("UNAVAILABLE", "the orchestrator is shutting down")
        handle = RemoteHandle(self, req, self.open_call(req))
        with self._lock:
            self._open.add(handle)
        return handle

    def open_call(self, req: GenerationRequest) -> Any:
        p = req.params
        msg = tpb.DecodeRequest(request_id=req.request_id, prompt=list(req.prompt), params=wire.params_to_proto(p),
                                max_tokens=p.max_tokens, stop_token_ids=list(p.stop_token_ids),
                                ignore_eos=p.ignore_eos, k=req.k, fixed_k=req.fixed_k,
                                resume_output=list(req.resume_output),
                                chunk_in_final=True, stream_interval=self.stream_interval)
        # NOTE: refused here, not sent: a message over the channel's limit would end the shared
        # stream, and every request on it with it.
        size, limit = msg.ByteSize(), self.target.max_message_bytes
        if size > limit:
            raise RequestError("RESOURCE_EXHAUSTED", f"the request's DecodeRequest is {size} bytes, above "
                                                     f"max_message_bytes={limit}")
        return self._mux.join(msg)

    def finished(self, handle: RemoteHandle, ev: Event) -> None:
        with self._lock:
            self._open.discard(handle)
        if isinstance(ev, FinalEvent):
            self.observer.on_outcome(ev.finish_reason, "CANCELLED" if ev.finish_reason == "cancelled" else "OK")
        elif isinstance(ev, ErrorEvent):
            self.observer.on_outcome(None, ev.code)

    def observe_chunk(self, ev: TokensEvent) -> None:
        """Round timing once per round (every request of a round carries it; the target numbers
        rounds in order), acceptance per chunk."""
        timing = ev.timing
        with self._lock:
            if timing is not None and timing.round <= self._last_timed_round:
                timing = None
            elif timing is not None:
                self._last_timed_round = timing.round
        self.observer.on_round(timing, [(ev.num_drafted, ev.num_accepted)] if ev.round else [])

    def open_calls(self) -> int:
        with self._lock:
            return len(self._open)

    def fail_all(self, reason: str) -> int:
        """The target stopped answering: end every open request with UNAVAILABLE now."""
        with self._lock:
            handles = list(self._open)
        for h in handles:
            h.fail(reason)
        return len(handles)

    def stop(self) -> None:
        """End every open request with UNAVAILABLE (the target frees their slots)."""
        self.stopping = True
        with self._lock:
            handles = list(self._open)
        for h in handles:
            h._call.cancel()
        self._mux.close()

    # --- control -------------------------------------------------------------------------
    def control(self, action: int, timeout: float | None = None, **fields: Any) -> tpb.ControlRoundsResponse:
        """One ControlRounds call (admin); RequestError when it fails."""
        return self.target._unary("ControlRounds", tpb.ControlRoundsRequest(action=action, **fields), admin=True,
                                  timeout=timeout or self.control_timeout_s)

    def status(self, timeout: float | None = None) -> tpb.RoundsStatus:
        return self.control(tpb.ROUNDS_ACTION_STATUS, timeout).status

    def snapshot(self) -> tuple[int, int]:
        """(active, queued) in the target's round loop."""
        st = self.status()
        return st.active_requests, st.queued_requests

    def configure(self, draft_address: str, max_batch: int, max_queue: int, draft_timeout_s: float,
                  timeout: float | None = None) -> tpb.RoundsStatus:
        status = self.control(tpb.ROUNDS_ACTION_CONFIGURE, timeout, draft_address=draft_address, max_batch=max_batch,
                              max_queue=max_queue, draft_timeout_s=draft_timeout_s).status
        with self._lock:
            # NOTE: a (re)configured target may be a restarted one, numbering rounds from 1 again.
            self._last_timed_round = min(self._last_timed_round, int(status.round))
        return status

    def pause_admission(self, timeout: float | None = None) -> None:
        self.control(tpb.ROUNDS_ACTION_PAUSE_ADMISSION, timeout)

    def resume_admission(self, timeout: float | None = None) -> None:
        self.control(tpb.ROUNDS_ACTION_RESUME_ADMISSION, timeout)

    def settle(self, timeout: float | None = None) -> int:
        return self.control(tpb.ROUNDS_ACTION_SETTLE, timeout).count

    def abort_running(self, timeout: float | None = None) -> int:
        return self.control(tpb.ROUNDS_ACTION_ABORT_RUNNING, timeout).count

    def park_running(self, timeout: float | None = None) -> int:
        return self.control(tpb.ROUNDS_ACTION_PARK_RUNNING, timeout).count

    def drain(self, policy: str, wait_timeout_s: float, timeout: float | None = None) -> tpb.ControlRoundsResponse:
        """A reload's pause in one call: admission paused, running requests settled by ``policy``
        ("wait" | "abort" | "park"); ``count``: how many were aborted or parked."""
        return self.control(tpb.ROUNDS_ACTION_DRAIN, timeout, drain=_DRAIN[policy], wait_timeout_s=wait_timeout_s)

    def resume_all(self, version: str | None, timeout: float | None = None,
                   reset_streams: bool = True) -> tpb.ControlRoundsResponse:
        """A reload's end in one call: parked requests re-prefilled with ``version``, admission resumed."""
        return self.control(tpb.ROUNDS_ACTION_RESUME_ALL, timeout, weights_version=version or "",
                            reset_streams=reset_streams)

    def resume_parked(self, version: str | None, timeout: float | None = None, reset_streams: bool = True) -> int:
        return self.control(tpb.ROUNDS_ACTION_RESUME_PARKED, timeout, weights_version=version or "",
                            reset_streams=reset_streams).count
