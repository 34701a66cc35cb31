"""One DecodeStream call: many requests through the round loop over one bidirectional stream.

Owns: the call's requests (joins checked and submitted with the call's ``EventOutbox``,
cancels, duplicate ids refused), the per-request ``EventHold``s, and the batching of
every request's messages into one DecodeStreamResponse per round boundary.

Why: with one Decode call per request, each round woke one handler thread per request in
this process, each competing with the round loop for the GIL (at batch 8 on the H200
host a target-only round took 2.3 ms through the services against 0.5 ms in the engine;
docs/performance.md § Session 10). Here the scheduler flushes the outbox once per
boundary: one wake-up and one message per round for the whole stream.

Threads: ``serve`` runs on the call's gRPC handler thread and writes; one reader thread per
call takes joins and cancels from the caller. Caller gone (the call cancelled or broken):
every request still on it is cancelled. Caller half-closed: no more joins, the call ends
after its last request does.

Must not know: the scheduler's internals, models, frameworks.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import grpc

from core import wire
from rounds.scheduler import EventOutbox, GenerationRequest, QueueFull, RequestError, RequestHandle
from rounds.scheduler_types import ErrorEvent, FinalEvent
from specsplit.v1 import target_pb2 as tpb
from target_service.decode_messages import EventHold, error_event_proto

EVENT_POLL_S = 0.25                # how often a waiting writer checks that its caller is still there
RESPONSE_BYTES = 1 << 20           # a response holds events up to about this size (one bigger event goes alone)


class DecodeSession:
    """The state of one DecodeStream call (module doc)."""

    def __init__(self, rounds: Any, check: Callable[[tpb.DecodeRequest], GenerationRequest], log: Any,
                 max_message_bytes: int = 64 << 20) -> None:
        self.rounds, self._check, self.log = rounds, check, log
        # NOTE: responses stay well under the message limit: a round in which many requests
        # end carries each one's whole output in its final event.
        self.response_bytes = max(1, min(RESPONSE_BYTES, max_message_bytes // 4))
        self.max_message_bytes = max_message_bytes
        self.outbox = EventOutbox()
        self._lock = threading.Lock()
        self._handles: dict[str, RequestHandle] = {}    # open requests by id
        self._holds: dict[str, EventHold] = {}
        self._input_done = False                        # the caller sends no more joins
        self._gone = False                              # the call ended from the caller's side

    # --- the reader thread ------------------------------------------------------------------
    def _read(self, requests: Iterator[tpb.DecodeStreamRequest]) -> None:
        try:
            for msg in requests:
                which = msg.WhichOneof("action")
                if which == "join":
                    self._join(msg.join)
                elif which == "cancel_request_id":
                    with self._lock:
                        handle = self._handles.get(msg.cancel_request_id)
                    if handle is not None:
                        handle.cancel()
        except Exception as exc:  # noqa: BLE001 - the caller went away (the call is cancelled)
            self.log.info("decode_stream_reader_ended", error=str(exc))
            self._cancel_all()
        finally:
            with self._lock:
                self._input_done = True
            self.outbox.flush()

    def _join(self, req: tpb.DecodeRequest) -> None:
        rid = req.request_id
        try:
            greq = self._check(req)                   # names the bad field (the id too)
            with self._lock:
                if rid in self._holds:
                    raise ValueError(f"request_id: {rid!r} is already running on this stream")
                self._holds[rid] = EventHold(req.stream_interval, req.chunk_in_final)
            try:
                handle = self.rounds.submit(greq, self.outbox)
            except BaseException:
                with self._lock:
                    del self._holds[rid]
                raise
        except QueueFull as exc:
            return self._refuse(rid, "RESOURCE_EXHAUSTED", str(exc))
        except RequestError as err:
            return self._refuse(rid, err.code, err.message)
        except Exception as exc:  # noqa: BLE001 - every refusal becomes the join's error event
            return self._refuse(rid, wire.status_code_for(exc).name, wire.error_message(exc))
        with self._lock:
            # NOTE: only while its hold is there: a request can end (the writer drops both)
            # before submit returns here.
            if rid in self._holds:
                self._handles[rid] = handle
            gone = self._gone
        if gone:
            handle.cancel()

    def _refuse(self, rid: str, code: str, message: str) -> None:
        self.log.info("decode_join_refused", request_id=rid[:128], code=code, error=message)
        self.outbox.add(rid, ErrorEvent(code, message, ()))
        self.outbox.flush()

    def _cancel_all(self) -> None:
        with self._lock:
            self._gone = True
            handles = list(self._handles.values())
        for h in handles:
            h.cancel()

    # --- the writer (the call's handler thread) ---------------------------------------------
    def serve(self, requests: Iterator[tpb.DecodeStreamRequest],
              context: grpc.ServicerContext) -> Iterator[tpb.DecodeStreamResponse]:
        context.add_callback(self._cancel_all)
        threading.Thread(target=self._read, args=(requests,), name="specsplit-decode-stream", daemon=True).start()
        while True:
            items = self.outbox.take(EVENT_POLL_S)
            if items:
                yield from self._responses(items)
            elif not context.is_active():
                self._cancel_all()
                return
            with self._lock:
                # NOTE: a closed round loop (the service stopping) ends the call once its requests
                # have their final events out, without waiting for the caller to half-close: the
                # server's grace period is for rounds in flight, not for an idle stream.
                if (self._input_done or self.rounds.closed) and not self._holds:
                    return

    def _responses(self, items: list[tuple[Any, Any]]) -> list[tpb.DecodeStreamResponse]:
        """Everything taken as messages: each request's events through its hold, in order, in as
        few responses as ``response_bytes`` allows (usually one).

        NOTE: every event is written in place into one response first (a DecodeEvent built on its
        own, sized, then copied into the response cost ~40 % more a round at batch 8 on the 2-core
        CPU, on the thread that shares the GIL with the round loop); ``_split`` cuts it as the
        size rule says only when its whole size could ask for a cut."""
        resp = tpb.DecodeStreamResponse()
        add = resp.events.add
        for who, ev in items:
            if isinstance(who, str):                     # a refused join: no hold, nothing streamed
                _entry(add, who, refused=True).CopyFrom(error_event_proto(ev.code, ev.message))
                continue
            rid = who.request_id
            with self._lock:
                hold = self._holds.get(rid)
            if hold is None:
                continue
            done = hold.feed(ev, lambda: _entry(add, rid))
            if done or isinstance(ev, (FinalEvent, ErrorEvent)):
                with self._lock:
                    self._holds.pop(rid, None)
                    self._handles.pop(rid, None)
        n = len(resp.events)
        if not n:
            return []
        # Each event's size as the rule counts it (its own + its id + 8) is at most its share of
        # the whole: within both bounds, the rule would neither cut nor replace anything.
        if resp.ByteSize() + 8 * n <= min(self.response_bytes, self.max_message_bytes - 64):
            return [resp]
        return self._split(resp)

    def _split(self, whole: tpb.DecodeStreamResponse) -> list[tpb.DecodeStreamResponse]:
        """``whole``'s events in order, in responses of at most ``response_bytes`` each (one bigger
        event goes alone); an event no message may carry becomes its request's error."""
        out: list[tpb.DecodeStreamResponse] = []
        resp, size = tpb.DecodeStreamResponse(), 0
        for entry in whole.events:
            rid, event = entry.request_id, entry.event
            n = event.ByteSize() + len(rid) + 8
            if n > self.max_message_bytes - 64:
                # NOTE: an event no message may carry ends its own request (as a Decode call
                # would), never the stream every other request shares.
                event = error_event_proto("RESOURCE_EXHAUSTED", f"an event of {n} bytes is above "
                                          f"max_message_bytes={self.max_message_bytes}")
                n = event.ByteSize() + len(rid) + 8
            if resp.events and size + n > self.response_bytes:
                out.append(resp)
                resp, size = tpb.DecodeStreamResponse(), 0
            resp.events.add(request_id=rid, event=event, join_refused=entry.join_refused)
            size += n
        if resp.events:
            out.append(resp)
        return out


def _entry(add: Callable[..., Any], rid: str, refused: bool = False) -> tpb.DecodeEvent:
    """A new event of the response being built (``add``: its ``events.add``), present even before
    anything is written into it, as a copied-in event was."""
    event = add(request_id=rid, join_refused=refused).event
    event.SetInParent()
    return event
