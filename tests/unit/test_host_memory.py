"""The process's mmap threshold (runtime/host_memory.py): fixed high while serving, 128 KiB while a
checkpoint's host arrays are made, whatever threads overlap those windows; nothing without a pin
or with the operator's MALLOC_MMAP_THRESHOLD_."""

from __future__ import annotations

import threading

import pytest

from runtime import host_memory


class _FakeLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


@pytest.fixture()
def libc(monkeypatch):
    fake = _FakeLibc()
    monkeypatch.setattr(host_memory, "_libc", fake)
    monkeypatch.setattr(host_memory, "_pinned", False)
    monkeypatch.setattr(host_memory, "_loads", 0)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    return fake


def _values(fake: _FakeLibc) -> list[int]:
    assert all(p == host_memory.M_MMAP_THRESHOLD for p, _ in fake.calls)
    return [v for _, v in fake.calls]


def test_the_threshold_is_low_only_while_loading(libc):
    low, high = host_memory.MMAP_THRESHOLD_BYTES, host_memory.SERVING_THRESHOLD_BYTES
    assert host_memory.pin_mmap_threshold()
    with host_memory.loading():
        with host_memory.loading():          # nested (an apply inside a load): no change
            pass
        assert _values(libc) == [high, low]
    assert _values(libc) == [high, low, high]


def test_overlapping_windows_of_two_threads_keep_it_low_until_the_last_closes(libc):
    host_memory.pin_mmap_threshold()
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with host_memory.loading():
            inside.set()
            release.wait(10)
    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    with host_memory.loading():
        pass                                  # this window closes first: still loading elsewhere
    assert _values(libc)[-1] == host_memory.MMAP_THRESHOLD_BYTES
    release.set()
    t.join(10)
    assert _values(libc)[-1] == host_memory.SERVING_THRESHOLD_BYTES


def test_a_pin_inside_a_window_waits_for_its_end(libc):
    with host_memory.loading():
        assert host_memory.pin_mmap_threshold()
        assert _values(libc) == [host_memory.MMAP_THRESHOLD_BYTES]
    assert _values(libc) == [host_memory.MMAP_THRESHOLD_BYTES, host_memory.SERVING_THRESHOLD_BYTES]


def test_nothing_without_a_pin_or_with_the_operators_setting(libc, monkeypatch):
    with host_memory.loading():
        pass
    assert libc.calls == []
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert not host_memory.pin_mmap_threshold()
    with host_memory.loading():
        pass
    assert libc.calls == []
