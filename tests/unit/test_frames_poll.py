"""``FrameSocket`` polling for a frame before it blocks (``data_plane_poll_us``): same frames, same errors.

Bounded: every wait here has a deadline; the timed sends run on threads joined with a timeout.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator

import pytest

from core import frames

MAX = 1 << 20


@contextlib.contextmanager
def _pair(poll_s: float) -> Iterator[tuple[frames.FrameSocket, socket.socket]]:
    """A polling FrameSocket and its raw peer, both closed at the end."""
    a, b = socket.socketpair()
    fs = frames.FrameSocket(a, MAX, poll_s)
    try:
        yield fs, b
    finally:
        fs.close()
        b.close()


def _send_later(sock: socket.socket, data: bytes, after_s: float) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(after_s), sock.sendall(data)), daemon=True)
    t.start()
    return t


def test_a_frame_that_lands_while_polling_is_read_at_once():
    with _pair(poll_s=5.0) as (fs, peer):
        t = _send_later(peer, frames.encode(b"first"), 0.05)
        t0 = time.monotonic()
        assert fs.recv(time.monotonic() + 10) == b"first"
        assert time.monotonic() - t0 < 2.0                      # not the whole poll window
        t.join(5)


def test_frames_after_the_poll_window_and_back_to_back_frames_are_read_whole():
    with _pair(poll_s=0.01) as (fs, peer):
        t = _send_later(peer, frames.encode(b"late") + frames.encode(b"x" * 70_000) + frames.encode(b""), 0.2)
        assert fs.recv(time.monotonic() + 10) == b"late"        # the window passed: the blocking read got it
        assert fs.recv(time.monotonic() + 10) == b"x" * 70_000  # bytes read past a frame are kept
        assert fs.recv(time.monotonic() + 10) == b""
        t.join(5)


def test_polling_keeps_the_deadline_and_a_closed_peer_is_peer_closed():
    with _pair(poll_s=30.0) as (fs, peer):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            fs.recv(time.monotonic() + 0.2)                     # the poll is cut to the deadline
        assert time.monotonic() - t0 < 5.0
        peer.close()
        with pytest.raises(frames.PeerClosed):
            fs.recv(time.monotonic() + 10)


def test_the_automatic_poll_follows_the_cpus_the_process_may_use():
    from core.config import ConfigError
    from worker.config import AUTO_POLL_CPUS, AUTO_POLL_US, WorkerConfig, poll_seconds

    assert poll_seconds(-1, cpus=2) == 0.0 and poll_seconds(-1, cpus=AUTO_POLL_CPUS - 1) == 0.0
    assert poll_seconds(-1, cpus=AUTO_POLL_CPUS) == poll_seconds(-1, cpus=64) == AUTO_POLL_US / 1e6
    assert poll_seconds(0, cpus=64) == 0.0 and poll_seconds(500, cpus=1) == 0.0005       # explicit values win
    assert WorkerConfig(role="draft", target_path=None).data_plane_poll_us == -1          # auto by default
    with pytest.raises(ConfigError, match="data_plane_poll_us"):
        WorkerConfig(role="draft", target_path=None, data_plane_poll_us=-2)


def test_usable_cpus_follow_a_container_cpu_limit(tmp_path):
    import os

    from worker.config import usable_cpus

    affinity = len(os.sched_getaffinity(0))
    f = tmp_path / "cpu.max"
    f.write_text("max 100000\n")
    assert usable_cpus(str(f)) == affinity                         # no quota
    f.write_text("150000 100000\n")
    assert usable_cpus(str(f)) == min(affinity, 2)                 # 1.5 CPUs -> 2
    f.write_text("20000 100000\n")
    assert usable_cpus(str(f)) == 1
    assert usable_cpus(str(tmp_path / "absent")) == affinity       # no cgroup v2 file
