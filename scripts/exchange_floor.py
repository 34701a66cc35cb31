"""What one frame exchange between two processes costs on this host, beyond the work around it:
``python scripts/exchange_floor.py``.

Two processes and one loopback connection speaking ``core.frames`` (4 KiB out, 256 bytes back,
the size of a batch-1 round message): the requester works ``verify`` ms (a busy loop, as the
target's verify keeps its core), then sends and waits; the responder works ``draft`` ms per
frame, then answers. Printed: the median and 90th percentile of the exchange's wall time
minus the responder's work, with both sides blocking in ``recv`` (``data_plane_poll_us`` 0,
the default) and with both sides polling for the frame (``FrameSocket``'s ``poll_s``, what
``data_plane_poll_us`` sets: what the wake-ups of a blocked reader cost here). The services' round overhead cannot go below the blocking figure of
its own (verify, draft) row on the same host.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.frames import FrameSocket, tune  # noqa: E402

ROUNDS = 300


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _responder(port_q, draft_s: float, poll_s: float) -> None:
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        port_q.put(ls.getsockname()[1])
        conn, _ = ls.accept()
    tune(conn)
    fs = FrameSocket(conn, 1 << 24, poll_s)
    while True:
        try:
            body = fs.recv()
        except (ConnectionError, OSError):
            return
        _busy(draft_s)
        fs.send(body[:256])


def exchange_cost(verify_s: float, draft_s: float, poll: bool) -> tuple[float, float]:
    """(median, p90) microseconds of one exchange beyond the responder's work."""
    q = mp.Queue()
    peer = mp.Process(target=_responder, args=(q, draft_s, verify_s + draft_s + 0.002 if poll else 0.0),
                      daemon=True)
    peer.start()
    try:
        with socket.create_connection(("127.0.0.1", q.get(timeout=30))) as sock:
            tune(sock)
            fs = FrameSocket(sock, 1 << 24, draft_s + 0.002 if poll else 0.0)
            body, took = os.urandom(4096), []
            for _ in range(ROUNDS):
                _busy(verify_s)
                t0 = time.perf_counter()
                fs.send(body)
                fs.recv(time.monotonic() + 30)
                took.append((time.perf_counter() - t0 - draft_s) * 1e6)
    finally:
        peer.terminate()
        peer.join(5)
    took = sorted(took[ROUNDS // 6:])
    return statistics.median(took), took[int(0.9 * (len(took) - 1))]


def main() -> int:
    print(f"one exchange beyond the responder's work, {ROUNDS} exchanges each (microseconds)")
    print(f"{'verify ms':>9s} {'draft ms':>8s} {'blocking median / p90':>24s} {'polling median / p90':>22s}")
    for verify_ms, draft_ms in ((0.0, 0.0), (0.7, 0.5), (10.0, 5.0)):
        b = exchange_cost(verify_ms / 1e3, draft_ms / 1e3, poll=False)
        p = exchange_cost(verify_ms / 1e3, draft_ms / 1e3, poll=True)
        print(f"{verify_ms:9.1f} {draft_ms:8.1f} {b[0]:12.0f} / {b[1]:<9.0f} {p[0]:10.0f} / {p[1]:<9.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
