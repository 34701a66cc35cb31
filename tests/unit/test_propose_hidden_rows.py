"""A round's hidden rows in one tensor (``ProposeRequest.hidden_rows``), both ends.

The target's ``DraftClient`` sends every item's rows in one tensor only to a draft whose status
sets ``propose_hidden_rows`` (each item's own ``hidden`` otherwise, and whenever fewer than two
items draft or the rows do not make one tensor); the draft slices them back per item (``_split_rows``) and answers exactly
what the per-item encoding gets, errors included (a bad tensor fails every drafting item, a
share above max_tensor_bytes only its own item).
"""

from __future__ import annotations

import numpy as np

from core import wire
from draft_service.server import DraftServicer, _decode_propose, _split_rows
from rounds.draft_client import DraftClient
from runtime.types import Proposal, ProposeRequest
from specsplit.v1 import draft_pb2
from worker.service import decode_items

D = 8


class _Captured:
    """A data plane that keeps the message sent (no socket)."""

    usable = True

    def __init__(self) -> None:
        self.msg = None

    def send(self, msg):
        self.msg = draft_pb2.ProposeRequest.FromString(msg.SerializeToString())
        return lambda what: None


def _client(hidden_rows: bool) -> tuple[DraftClient, _Captured]:
    client = DraftClient.__new__(DraftClient)            # the message path only: no channel
    data = _Captured()
    client._data, client._pending_release, client._next_round = data, [], lambda: 7
    client._hidden_rows = hidden_rows
    return client, data


def _reqs(dtype=np.float32) -> list[ProposeRequest]:
    rng = np.random.default_rng(3)

    def rows(n: int) -> np.ndarray:
        if dtype == np.uint16:                            # bf16 bit patterns, as a bf16 target sends them
            return rng.integers(0, 1 << 16, (n, D)).astype(np.uint16)
        return rng.standard_normal((n, D)).astype(dtype)
    return [ProposeRequest("a", 10, np.array([1, 2, 3]), rows(3), 3),
            ProposeRequest("b", 0, np.zeros(0, np.int64), np.zeros((0, 0), np.float32), 4, ahead=True,
                           keep_tail=True),
            ProposeRequest("c", 4, np.array([9]), rows(1), 2, keep_tail=True),
            ProposeRequest("d", 20, np.array([5, 6]), rows(2), 1)]


def _sent(hidden_rows: bool, reqs: list[ProposeRequest]) -> draft_pb2.ProposeRequest:
    client, data = _client(hidden_rows)
    client.propose_async(reqs)
    return data.msg


def _decoded(msg: draft_pb2.ProposeRequest, max_bytes: int | None = None) -> list:
    rows = _split_rows(msg, max_bytes) if msg.HasField("hidden_rows") else None
    return decode_items(msg.items, lambda i, it: _decode_propose(i, it, max_bytes, None if rows is None else rows[i]))


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, wire.ItemError):
            assert x == y
            continue
        assert (x.request_id, x.start_position, x.k, x.ahead, x.keep_tail) == \
            (y.request_id, y.start_position, y.k, y.ahead, y.keep_tail)
        assert x.tokens.tolist() == y.tokens.tolist()
        assert x.hidden.dtype == y.hidden.dtype and x.hidden.shape == y.hidden.shape
        assert np.array_equal(x.hidden, y.hidden)


def test_the_draft_decodes_one_tensor_as_it_decodes_each_items_own():
    for dtype in (np.float32, np.uint16):
        reqs = _reqs(dtype)
        joined, each = _sent(True, reqs), _sent(False, reqs)
        assert joined.HasField("hidden_rows") and not each.HasField("hidden_rows")
        assert list(joined.hidden_rows.shape) == [6, D]
        assert all(wire.is_empty_tensor(it.hidden) for it in joined.items)
        assert [it.request_id for it in joined.items] == [it.request_id for it in each.items]
        _same(_decoded(joined), _decoded(each))
        got = _decoded(joined)
        assert got[0].hidden.dtype == (np.uint16 if dtype == np.uint16 else np.float32)
        assert np.array_equal(got[3].hidden, reqs[3].hidden)


def test_rows_that_make_no_one_tensor_go_with_their_items():
    reqs = _reqs()
    odd = [reqs[0], ProposeRequest("w", 1, np.array([4]), np.zeros((1, D + 1), np.float32), 2)]
    assert not _sent(True, odd).HasField("hidden_rows")                        # widths differ
    mixed = [reqs[0], ProposeRequest("m", 1, np.array([4]), np.zeros((1, D), np.float16), 2)]
    assert not _sent(True, mixed).HasField("hidden_rows")                      # dtypes differ
    short = [reqs[0], ProposeRequest("s", 1, np.array([4, 5]), np.zeros((1, D), np.float32), 2)]
    assert not _sent(True, short).HasField("hidden_rows")                      # a row per token
    only_ahead = [reqs[1]]
    assert not _sent(True, only_ahead).HasField("hidden_rows")
    one_drafting = [reqs[0], reqs[1]]                                         # nothing to join
    assert not _sent(True, one_drafting).HasField("hidden_rows")
    _same(_decoded(_sent(True, one_drafting)), _decoded(_sent(False, one_drafting)))
    _same(_decoded(_sent(True, odd)), _decoded(_sent(False, odd)))


def test_a_bad_tensor_fails_every_drafting_item_and_a_big_share_only_its_own():
    msg = _sent(True, _reqs())
    bad = draft_pb2.ProposeRequest.FromString(msg.SerializeToString())
    del bad.hidden_rows.shape[:]                                               # 5 rows for 6 tokens
    bad.hidden_rows.shape.extend([5, D])
    bad.hidden_rows.data = bad.hidden_rows.data[: 5 * D * 4]
    got = _decoded(bad)
    assert [isinstance(g, wire.ItemError) for g in got] == [True, False, True, True]
    assert got[0].code.name == "INVALID_ARGUMENT" and "hidden_rows" in got[0].message
    big = _decoded(msg, max_bytes=2 * D * 4)                                    # room for two rows an item
    assert [isinstance(g, wire.ItemError) for g in big] == [True, False, False, False]
    assert big[0].message == f"items[0].hidden: {3 * D * 4} bytes exceed max_tensor_bytes={2 * D * 4}"
    each = _decoded(_sent(False, _reqs()), max_bytes=2 * D * 4)
    assert big[0] == each[0]                                                    # the same error as per item


class _EchoWorker:
    """Proposes from what it was given: the first token and the rows' sum, so a wrong slice shows."""

    class cfg:
        class security:
            max_tensor_bytes = 1 << 20

    def propose(self, items, round_):
        return [it if isinstance(it, wire.ItemError) else
                Proposal(it.request_id, np.array([int(it.tokens[0]) if len(it.tokens) else -1,
                                                  int(np.asarray(it.hidden, np.float64).sum() * 1000)]), None)
                for it in items]


def test_the_servicer_answers_both_encodings_alike_and_says_it_reads_them():
    servicer = DraftServicer(_EchoWorker(), None)
    assert servicer.propose_hidden_rows
    for dtype in (np.float32, np.uint16):
        reqs = _reqs(dtype)
        joined, each = (draft_pb2.ProposeResponse.FromString(servicer.propose_frame(
            _sent(rows, reqs).SerializeToString())) for rows in (True, False))
        joined.compute_seconds = each.compute_seconds = 0.0                     # timings differ, nothing else
        assert joined == each
        assert [r.request_id for r in joined.results] == ["a", "b", "c", "d"]
        assert all(r.HasField("proposal") for r in joined.results)
