"""``runtime.device_thread``: jobs run on the one device thread in order; inline runs only while it
is idle, never overtake a queued job, nest, and are capped to MAX_INLINE_THREADS threads."""

from __future__ import annotations

import gc
import threading

import pytest

from runtime import device_thread
from runtime.device_thread import DeviceThread
from tests.waiting import wait_until


def _name() -> str:
    return threading.current_thread().name


def _in_thread(fn, name: str = "caller"):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), name=name)
    t.start()
    return t, out


def test_jobs_run_on_the_device_thread_after_setup():
    setup_on: list[str] = []
    d = DeviceThread("dev", lambda: setup_on.append(_name()))
    assert setup_on == ["dev_0"]
    assert d.run(_name) == "dev_0"
    assert d.run(lambda: d.run(_name)) == "dev_0"                   # nested: inline on the device thread
    with pytest.raises(ZeroDivisionError):
        d.run(lambda: 1 / 0)
    assert d.run(lambda: 7) == 7                                    # still serving after a failure


def test_setup_failure_is_raised_by_the_constructor():
    with pytest.raises(RuntimeError, match="no device"):
        DeviceThread("dev", lambda: (_ for _ in ()).throw(RuntimeError("no device")))


def test_inline_runs_on_the_caller_when_idle_and_sets_it_up_once():
    setup_on: list[str] = []
    d = DeviceThread("dev", lambda: setup_on.append(_name()))
    assert d.run(_name, inline=True) == "MainThread"
    assert d.run(_name, inline=True) == "MainThread"
    assert setup_on == ["dev_0", "MainThread"]
    assert d.run(lambda: d.run(_name), inline=True) == "MainThread"  # nested inside an inline run
    with pytest.raises(ZeroDivisionError):
        d.run(lambda: 1 / 0, inline=True)
    assert d.run(_name, inline=True) == "MainThread"               # the lock was handed back


def test_inline_never_overtakes_a_queued_or_running_job():
    d = DeviceThread("dev")
    release = threading.Event()
    order: list[str] = []
    long, _ = _in_thread(lambda: d.run(lambda: (release.wait(10), order.append("first"))))
    wait_until(lambda: d._pending[0] == 1, "the first job to be submitted")
    second, out = _in_thread(lambda: d.run(lambda: (order.append("second"), _name())[1], inline=True))
    wait_until(lambda: d._pending[0] == 2, "the inline caller to queue behind it")
    release.set()
    long.join(10)
    second.join(10)
    assert order == ["first", "second"] and out == ["dev_0"]       # hopped: the device was busy


def test_submit_returns_at_once_and_its_waiter_answers_in_order():
    d = DeviceThread("dev")
    release = threading.Event()
    order: list[str] = []
    first = d.submit(lambda: (release.wait(10), order.append("first"), _name())[2])
    second = d.submit(lambda: order.append("second"))
    failing = d.submit(lambda: 1 / 0)
    assert order == []                                   # nothing waited for yet: the caller went on
    release.set()
    d.run(lambda: order.append("inline"), inline=True)   # queued jobs go first: this one hops behind them
    assert first() == "dev_0"
    second()
    with pytest.raises(ZeroDivisionError):               # the job's exception, raised by its waiter
        failing()
    assert order == ["first", "second", "inline"]


def test_a_submit_from_the_device_thread_runs_at_once():
    d = DeviceThread("dev")

    def nested():
        inner = d.submit(lambda: _name())
        bad = d.submit(lambda: 1 / 0)                    # raised by its waiter, not here
        with pytest.raises(ZeroDivisionError):
            bad()
        return inner()
    assert d.run(nested) == "dev_0"


def test_inline_threads_are_capped(monkeypatch):
    monkeypatch.setattr(device_thread, "MAX_INLINE_THREADS", 2)
    d = DeviceThread("dev")
    got = []
    for i in range(4):
        t, out = _in_thread(lambda: d.run(_name, inline=True), name=f"h{i}")
        t.join(10)
        got += out
    assert got == ["h0", "h1", "dev_0", "dev_0"]


def test_the_thread_ends_when_the_object_is_collected():
    d = DeviceThread("dev")
    finalizer = d._finalizer
    del d
    gc.collect()
    assert not finalizer.alive
