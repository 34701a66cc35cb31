"""``torch_host.FetchRing``: the reused read-back buffers of a verify's outputs and a propose's
drafts. Its reuse rule runs on CPU tensors here (the allocator and the event are injected);
``tests/gpu`` runs it pinned under the engines."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime.backends.torch_host import FetchRing  # noqa: E402


class _Event:
    def __init__(self, log: list) -> None:
        self.log = log

    def record(self, stream) -> None:
        self.log.append(("record", id(self), stream))

    def synchronize(self) -> None:
        self.log.append(("sync", id(self)))


def _ring(log: list, allocs: list) -> FetchRing:
    def alloc(n: int) -> torch.Tensor:
        allocs.append(n)
        return torch.empty(n, dtype=torch.uint8)
    return FetchRing(alloc=alloc, event=lambda: _Event(log))


def _records(log: list) -> list:
    return [e[1] for e in log if e[0] == "record"]


def test_a_slot_is_reused_only_after_its_event_and_keeps_its_values_until_then():
    log, allocs = [], []
    ring = _ring(log, allocs)
    a = [torch.arange(6, dtype=torch.int64).view(2, 3), torch.full((2, 3, 4), 0.5)]
    hosts1, _ = ring.stage(a, "s")
    assert [h.tolist() for h in hosts1] == [x.tolist() for x in a] and hosts1[1].dtype == torch.float32
    b = [torch.arange(6, 12, dtype=torch.int64).view(2, 3), torch.full((2, 3, 4), 1.5)]
    hosts2, _ = ring.stage(b, "s")
    ev1, ev2 = _records(log)
    assert ev2 != ev1 and hosts1[0].tolist() == a[0].tolist()     # the first fetch's values still there
    assert hosts2[0].data_ptr() != hosts1[0].data_ptr()
    c = [torch.arange(12, 18, dtype=torch.int64).view(2, 3), torch.full((2, 3, 4), 2.5)]
    hosts3, _ = ring.stage(c, "s")
    # SLOTS = 2: the third fetch takes the first slot again, after its event (nobody waited
    # for a fetch since), with its buffers
    assert ("sync", ev1) in log and log.index(("sync", ev1)) == 2
    assert hosts3[0].data_ptr() == hosts1[0].data_ptr() and hosts3[0].tolist() == c[0].tolist()
    assert hosts3[1] is hosts1[1] and hosts3[1].tolist() == c[1].tolist()  # the same shape: its view kept
    assert len(allocs) == 4                                  # two slots x two tensors, nothing since
    assert [e for e in log if e[0] == "record"] == [("record", ev1, "s"), ("record", ev2, "s"), ("record", ev1, "s")]


def test_a_slot_needs_no_wait_of_its_own_once_a_later_fetch_on_its_stream_was_waited_for():
    log = []
    ring = _ring(log, [])
    x = torch.arange(4, dtype=torch.int64)
    for _ in range(5):                       # a verify: each fetch waited for before the next
        _, wait = ring.stage([x], "s")
        wait()
    syncs = [e for e in log if e[0] == "sync"]
    assert len(syncs) == 5                   # the five waits, no slot sync before a reuse
    ring.stage([x], "s")                     # not waited for ...
    ring.stage([x], "s")
    before = len([e for e in log if e[0] == "sync"])
    ring.stage([x], "s")                     # ... so reusing its slot waits on its event
    assert len([e for e in log if e[0] == "sync"]) == before + 1
    _, wait = ring.stage([x], "other")       # a fetch waited for on another stream proves nothing here
    wait()
    n = len([e for e in log if e[0] == "sync"])
    ring.stage([x], "s")
    assert len([e for e in log if e[0] == "sync"]) == n + 1


def test_a_slot_grows_for_a_larger_tensor_and_takes_any_shape_that_fits():
    log, allocs = [], []
    ring = _ring(log, allocs)
    ring.stage([torch.zeros(4, dtype=torch.int64)], None)
    ring.stage([torch.zeros(4, dtype=torch.int64)], None)
    big = torch.arange(40, dtype=torch.int64).view(8, 5)
    hosts, _ = ring.stage([big], None)                    # slot 0 again: 32 bytes -> 320
    assert hosts[0].tolist() == big.tolist() and allocs[-1] >= big.numel() * 8
    small = torch.tensor([[7]], dtype=torch.int16)
    hosts, _ = ring.stage([small, torch.zeros(0)], None)     # slot 1: a smaller dtype, an empty tensor
    assert hosts[0].tolist() == [[7]] and hosts[1].shape == (0,)


def test_a_kept_view_gives_way_to_another_shape_or_dtype_at_its_place():
    ring = _ring([], [])
    seen = []
    for x in (torch.arange(6, dtype=torch.int64).view(2, 3), torch.arange(6, dtype=torch.int64).view(3, 2),
              torch.arange(6, dtype=torch.int32).view(3, 2), torch.arange(8, dtype=torch.int32).view(4, 2),
              torch.arange(8, dtype=torch.int32).view(4, 2) + 1):
        hosts, _ = ring.stage([x], None)
        ring.stage([torch.zeros(1)], None)             # the other slot: the next call comes back here
        assert hosts[0].dtype == x.dtype and hosts[0].shape == x.shape and hosts[0].tolist() == x.tolist()
        seen.append(hosts[0])
    assert seen[4] is seen[3] and all(seen[i] is not seen[i + 1] for i in range(3))
