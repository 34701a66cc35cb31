"""orchestrator/decode_mux.py against a fake DecodeStream call: events routed by request id, a
local cancel ending a call at once and telling the target, a broken stream failing every
request on it, a fresh stream for the next join, and an old stream half-closed when empty."""

from __future__ import annotations

import queue
import threading

import grpc
import pytest

from orchestrator.decode_mux import DecodeMux, StreamEnded
from rounds.scheduler_types import RequestError
from specsplit.v1 import target_pb2 as tpb
from tests.waiting import wait_until

TIMEOUT = 10.0


class FakeCall:
    """A DecodeStream call: records what the caller sends; ``send``/``fail`` drive the responses."""

    def __init__(self, requests) -> None:
        self.sent: list[tpb.DecodeStreamRequest] = []
        self.half_closed = threading.Event()
        self._down: queue.Queue = queue.Queue()
        threading.Thread(target=self._consume, args=(requests,), daemon=True).start()

    def _consume(self, requests) -> None:
        for msg in requests:
            self.sent.append(msg)
        self.half_closed.set()

    def send(self, *events: tuple[str, tpb.DecodeEvent]) -> None:
        self._down.put(tpb.DecodeStreamResponse(events=[tpb.DecodeStreamEvent(request_id=r, event=e)
                                                        for r, e in events]))

    def fail(self, code: grpc.StatusCode) -> None:
        self._down.put(StreamEnded(code, "broken"))

    def end(self) -> None:
        self._down.put(None)

    def cancel(self) -> None:
        self.fail(grpc.StatusCode.CANCELLED)

    def __iter__(self):
        return self

    def __next__(self):
        item = self._down.get(timeout=TIMEOUT)
        if item is None:
            raise StopIteration
        if isinstance(item, Exception):
            raise item
        return item


def chunk(*tokens: int) -> tpb.DecodeEvent:
    return tpb.DecodeEvent(chunk=tpb.DecodeChunk(tokens=tokens))


def final(reason: str = "length") -> tpb.DecodeEvent:
    return tpb.DecodeEvent(final=tpb.DecodeFinal(finish_reason=reason))


@pytest.fixture()
def mux():
    calls: list[FakeCall] = []

    def open_call(requests):
        calls.append(FakeCall(requests))
        return calls[-1]
    m = DecodeMux(open_call, deadline_s=3600.0)
    yield m, calls
    m.close()
    for c in calls:
        c.end()
    wait_until(lambda: not any(t.name == "specsplit-decode-mux" and t.is_alive() for t in threading.enumerate()),
               "every stream's reader thread to end")


def joins(call: FakeCall) -> list[str]:
    return [m.join.request_id for m in call.sent if m.WhichOneof("action") == "join"]


def test_events_are_routed_by_request_id_in_order(mux):
    m, calls = mux
    a, b = m.join(tpb.DecodeRequest(request_id="a")), m.join(tpb.DecodeRequest(request_id="b"))
    assert len(calls) == 1
    wait_until(lambda: joins(calls[0]) == ["a", "b"], "the fake call to see it")
    calls[0].send(("a", chunk(1)), ("b", chunk(7)), ("a", chunk(2)))
    calls[0].send(("b", final()), ("a", final()))
    assert [next(a).chunk.tokens[0], next(a).chunk.tokens[0], next(a).final.finish_reason] == [1, 2, "length"]
    assert [next(b).chunk.tokens[0], next(b).final.finish_reason] == [7, "length"]
    with pytest.raises(StopIteration):
        next(a)
    with pytest.raises(RequestError):                     # a running id is refused here, never sent
        c = m.join(tpb.DecodeRequest(request_id="c"))
        m.join(tpb.DecodeRequest(request_id="c"))
    c.cancel()


def test_cancel_ends_the_call_at_once_and_tells_the_target(mux):
    m, calls = mux
    a = m.join(tpb.DecodeRequest(request_id="a"))
    wait_until(lambda: joins(calls[0]) == ["a"], "the fake call to see it")
    calls[0].send(("a", chunk(1)))
    wait_until(lambda: a._events, "the fake call to see it")
    a.cancel()
    with pytest.raises(grpc.RpcError) as info:
        next(a)                                           # the received chunk is dropped, as gRPC does
    assert info.value.code() == grpc.StatusCode.CANCELLED
    wait_until(lambda: any(x.WhichOneof("action") == "cancel_request_id" and x.cancel_request_id == "a"
                           for x in calls[0].sent), "the cancel to go up")
    calls[0].send(("a", final("cancelled")))              # the target's late final goes nowhere


def test_a_broken_stream_fails_every_request_and_the_next_join_opens_a_new_one(mux):
    m, calls = mux
    a, b = m.join(tpb.DecodeRequest(request_id="a")), m.join(tpb.DecodeRequest(request_id="b"))
    wait_until(lambda: len(joins(calls[0])) == 2, "the fake call to see it")
    calls[0].send(("a", chunk(5)))
    calls[0].fail(grpc.StatusCode.UNAVAILABLE)
    assert next(a).chunk.tokens[0] == 5                   # what came before the break, then the error
    for call in (a, b):
        with pytest.raises(grpc.RpcError) as info:
            next(call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert calls[0].half_closed.wait(TIMEOUT)
    c = m.join(tpb.DecodeRequest(request_id="a"))         # the same id again, on a fresh stream
    assert len(calls) == 2
    wait_until(lambda: joins(calls[1]) == ["a"], "the fake call to see it")
    c.cancel()


def test_the_target_ending_the_stream_early_is_stop_iteration(mux):
    m, calls = mux
    a = m.join(tpb.DecodeRequest(request_id="a"))
    calls[0].end()
    with pytest.raises(StopIteration):
        next(a)


def test_an_old_stream_takes_no_joins_and_half_closes_after_its_last_request(mux):
    m, calls = mux
    a = m.join(tpb.DecodeRequest(request_id="a"))
    m.deadline_s = 0.0                                    # the current stream is now past half its deadline
    b = m.join(tpb.DecodeRequest(request_id="b"))
    assert len(calls) == 2
    wait_until(lambda: joins(calls[0]) == ["a"] and joins(calls[1]) == ["b"], "the fake call to see it")
    assert not calls[0].half_closed.is_set()              # "a" still runs on it
    calls[0].send(("a", final()))
    assert next(a).final.finish_reason == "length"
    assert calls[0].half_closed.wait(TIMEOUT)
    b.cancel()


def test_a_join_over_the_message_limit_is_refused_before_it_reaches_the_stream():
    """One oversized message would end the shared stream for every request on it: RemoteRounds
    refuses it (RESOURCE_EXHAUSTED) and sends nothing."""
    from types import SimpleNamespace

    from core.params import SamplingParams
    from orchestrator.round_client import RemoteRounds
    from rounds.scheduler_types import GenerationRequest

    def never(*a, **kw):
        raise AssertionError("the oversized join was sent")
    rounds = RemoteRounds(SimpleNamespace(max_message_bytes=1024, stub=SimpleNamespace(DecodeStream=never)))
    with pytest.raises(RequestError) as info:
        rounds.submit(GenerationRequest("big", tuple(range(2000)), SamplingParams(max_tokens=4), 0))
    assert info.value.code == "RESOURCE_EXHAUSTED" and "max_message_bytes=1024" in info.value.message
    assert rounds.open_calls() == 0
