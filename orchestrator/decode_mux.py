"""The orchestrator's one DecodeStream to the target, shared by every request.

Owns: the open stream (joins and cancels up, every request's events down, routed by
request id to a per-request call object), opening a new one when the last one broke or
is older than half its deadline (the old one is half-closed once its last request ends),
and a broken stream's error handed to every request still on it.

A request's call object reads like a gRPC response iterator of DecodeEvents
(``next`` blocks; a broken stream raises its ``grpc.RpcError``; the target ending the
stream without a final event is ``StopIteration``) and ``cancel()`` ends it here at once
(CANCELLED) and tells the target, which takes the request out at its next round
boundary, as cancelling a Decode call does.

Must not know: what the events mean (``orchestrator.round_client``), rounds, models.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any, Callable

import grpc

from rounds.scheduler_types import RequestError
from specsplit.v1 import target_pb2 as tpb

_ENDED = object()          # the target ended the stream


class StreamEnded(grpc.RpcError):
    """A call ended on this side (cancelled, or its stream went away) with a status code."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class StreamCall:
    """One request's events on the shared stream (module doc)."""

    def __init__(self, stream: "_Stream", request_id: str) -> None:
        self._stream, self.request_id = stream, request_id
        self._cv = threading.Condition()
        self._events: collections.deque[tpb.DecodeEvent] = collections.deque()
        self._end: Any = None              # None: open; _ENDED or an RpcError once it is over

    def deliver(self, ev: tpb.DecodeEvent) -> None:
        with self._cv:
            self._events.append(ev)
            self._cv.notify()

    def end(self, how: Any) -> None:
        with self._cv:
            if self._end is None:
                self._end = how
            self._cv.notify()

    def cancel(self) -> None:
        self.end(StreamEnded(grpc.StatusCode.CANCELLED, "cancelled by the orchestrator"))
        self._stream.cancel(self.request_id)

    def __iter__(self) -> "StreamCall":
        return self

    def __next__(self) -> tpb.DecodeEvent:
        with self._cv:
            while not self._events and self._end is None:
                self._cv.wait()
            # NOTE: a cancelled call ends at once, as a cancelled gRPC call does; otherwise what
            # came before the end (a final event, the stream breaking) is read first.
            cancelled = isinstance(self._end, StreamEnded) and self._end.code() == grpc.StatusCode.CANCELLED
            if self._events and not cancelled:
                return self._events.popleft()
            end = self._end
        if end is _ENDED:
            raise StopIteration
        raise end


class _Stream:
    """One DecodeStream call and the requests on it."""

    def __init__(self, open_call: Callable[[Any], Any]) -> None:
        self._lock = threading.Lock()
        self._up: queue.Queue[tpb.DecodeStreamRequest | None] = queue.Queue()
        self._calls: dict[str, StreamCall] = {}
        self.broken = False
        self.retiring = False                  # no new joins; half-close once empty
        self._closed = False
        self.opened = time.monotonic()
        self._responses = open_call(self._requests())
        threading.Thread(target=self._read, name="specsplit-decode-mux", daemon=True).start()

    def _requests(self):
        while (msg := self._up.get()) is not None:
            yield msg

    def join(self, msg: tpb.DecodeRequest) -> StreamCall:
        call = StreamCall(self, msg.request_id)
        with self._lock:
            if self.broken:                          # broke since the mux chose it: nothing to join
                call.end(StreamEnded(grpc.StatusCode.UNAVAILABLE, "target DecodeStream: the stream is closed"))
                return call
            if msg.request_id in self._calls:
                raise RequestError("INVALID_ARGUMENT", f"request_id: {msg.request_id!r} is already running")
            self._calls[msg.request_id] = call
        self._up.put(tpb.DecodeStreamRequest(join=msg))
        return call

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if self._calls.pop(request_id, None) is None or self.broken:
                return
            self._up.put(tpb.DecodeStreamRequest(cancel_request_id=request_id))
            self._close_if_done()

    def retire(self) -> None:
        with self._lock:
            self.retiring = True
            self._close_if_done()

    def _close_if_done(self) -> None:
        """Under the lock: half-close a retiring stream with no request left."""
        if self.retiring and not self._calls and not self._closed:
            self._closed = True
            self._up.put(None)

    def abort(self) -> None:
        """End the call and every request on it (the orchestrator stops)."""
        self._responses.cancel()

    def _read(self) -> None:
        how: Any = _ENDED
        try:
            for resp in self._responses:
                for e in resp.events:
                    with self._lock:
                        call = self._calls.get(e.request_id)
                        if call is not None and e.event.WhichOneof("event") in ("final", "error"):
                            del self._calls[e.request_id]
                            self._close_if_done()
                    if call is not None:          # none: cancelled here already
                        call.deliver(e.event)
                        if e.event.WhichOneof("event") in ("final", "error"):
                            call.end(_ENDED)
        except grpc.RpcError as exc:
            how = exc
        with self._lock:
            self.broken = True
            calls, self._calls = list(self._calls.values()), {}
            if not self._closed:
                self._closed = True
                self._up.put(None)
        for c in calls:
            c.end(how)


class DecodeMux:
    """Joins go to the current stream; a new one opens when it broke or grew old."""

    def __init__(self, open_call: Callable[[Any], Any], deadline_s: float) -> None:
        self._open_call, self.deadline_s = open_call, deadline_s
        self._lock = threading.Lock()
        self._stream: _Stream | None = None

    def join(self, msg: tpb.DecodeRequest) -> StreamCall:
        with self._lock:
            st = self._stream
            # NOTE: a stream lives for its deadline at most; new requests move to a fresh one at
            # half of it, so a request on the old one has the other half to finish.
            if st is not None and not st.broken and time.monotonic() - st.opened > self.deadline_s / 2:
                st.retire()
                st = None
            if st is None or st.broken:
                st = self._stream = _Stream(self._open_call)
        return st.join(msg)

    def close(self) -> None:
        with self._lock:
            st, self._stream = self._stream, None
        if st is not None:
            st.abort()
