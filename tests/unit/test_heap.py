"""core/heap.py: a settled heap keeps its cycles from the collector until thawed; off, nothing moves."""

from __future__ import annotations

import gc
import weakref

import pytest

from core import heap


class _Node:
    def __init__(self) -> None:
        self.me = self                   # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def settled(monkeypatch):
    monkeypatch.setattr(heap, "_enabled", False)
    yield
    gc.collect()
    gc.freeze()                          # as tests/conftest.py leaves the process


def test_off_by_default_nothing_is_frozen(settled):
    before = gc.get_freeze_count()
    node = weakref.ref(_Node())
    heap.settle()
    heap.thaw()
    assert gc.get_freeze_count() == before
    gc.collect()
    assert node() is None                # never frozen: the next collection frees it


def test_settled_cycles_wait_for_thaw(settled):
    heap.enable()
    node = _Node()
    ref = weakref.ref(node)
    heap.settle()
    assert gc.get_freeze_count() > 0
    del node
    gc.collect()
    assert ref() is not None             # frozen: the collector does not walk it
    heap.thaw()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None                 # what a worker's teardown relies on (worker/base.py)
