"""target_service/decode_stream.py without a server: a boundary's events become as few
responses as the size budget allows, every event once, in order; refusals carry their code."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import structlog

from rounds.scheduler_types import ErrorEvent, FinalEvent, TokensEvent
from runtime.round_driver import SeqStats
from target_service.decode_messages import EventHold
from target_service.decode_stream import DecodeSession


def session(max_message_bytes: int) -> DecodeSession:
    return DecodeSession(None, lambda req: req, structlog.get_logger("test"), max_message_bytes)


def test_a_boundary_with_many_long_finals_is_split_under_the_budget_in_order():
    s = session(4096)                                          # budget: 1 KiB a response
    items = []
    for i in range(10):
        rid = f"r{i}"
        s._holds[rid] = EventHold(1, True)
        who = SimpleNamespace(request_id=rid)
        items += [(who, TokensEvent((i,), 5, 0, 0, "v1", None, last=True)),
                  (who, FinalEvent("length", tuple(range(300)), 4, SeqStats(), "v1"))]
    items.append(("bad", ErrorEvent("INVALID_ARGUMENT", "k: 9 is out of range [0, 3]", ())))
    out = s._responses(items)
    assert len(out) > 1 and all(r.ByteSize() <= 1024 + 700 for r in out)   # one final is ~600 bytes
    events = [(e.request_id, e.event) for r in out for e in r.events]
    assert [rid for rid, _ in events] == [f"r{i}" for i in range(10)] + ["bad"]
    for i, (_, ev) in enumerate(events[:10]):                  # the last chunk rode on each final
        assert ev.final.finish_reason == "length" and list(ev.final.last_chunks[0].tokens) == [i]
    assert events[-1][1].error.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert [e.join_refused for r in out for e in r.events] == [False] * 10 + [True]
    assert not s._holds                                        # every request ended


def test_one_round_of_a_batch_is_one_response():
    s = session(64 << 20)
    items = []
    for i in range(8):
        s._holds[f"r{i}"] = EventHold(1, False)
        items.append((SimpleNamespace(request_id=f"r{i}"), TokensEvent((i, i), 3, 1, 1, "v1", None)))
    (resp,) = s._responses(items)
    assert [list(e.event.chunk.tokens) for e in resp.events] == [[i, i] for i in range(8)]


def test_an_event_no_message_may_carry_ends_only_its_request():
    s = session(2048)
    for rid in ("long", "short"):
        s._holds[rid] = EventHold(1, True)
    out = s._responses([(SimpleNamespace(request_id="long"), FinalEvent("length", tuple(range(2000)), 4, SeqStats(), "v1")),
                        (SimpleNamespace(request_id="short"), FinalEvent("length", (1, 2), 4, SeqStats(), "v1"))])
    events = {e.request_id: e.event for r in out for e in r.events}
    assert events["long"].error.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "max_message_bytes=2048" in events["long"].error.error.message
    assert list(events["short"].final.output) == [1, 2]
