"""Length-prefixed frames over a TCP socket, and the TLS contexts of the per-round data plane.

Owns: the frame format both ends of the draft's data plane speak (a 4-byte
big-endian length, then that many bytes: one serialized protobuf message),
``FrameSocket`` (write one frame; read one frame, bounded in size and,
optionally, by a deadline, optionally polling for it before blocking; bytes
read past a frame are kept for the next),
``tune`` (TCP_NODELAY), and the ``ssl`` contexts matching the gRPC
server's and channel's TLS settings (``server_context``: the service's
certificate and key, client certificates required with a client CA;
``client_context``: the CA that verifies the server, and the client's own
certificate for mTLS).

Why a data plane beside gRPC: one exchange over Python gRPC's bidi stream
costs ~0.9 ms per round in thread hand-offs; a socket ping-pong between two
processes costs ~0.03 ms (DESIGN § Topology, docs/performance.md).

Must not know: which messages the frames carry, workers, rounds, gRPC.
"""

from __future__ import annotations

import os
import socket
import ssl
import time

HEADER_BYTES = 4
_CHUNK = 1 << 16                    # bytes asked of one recv at least (a frame may need several) ...
_MAX_RECV = 1 << 22                 # ... and at most


class FrameTooLarge(ValueError):
    """A frame's length prefix is above the configured bound (the connection must close)."""


class PeerClosed(ConnectionError):
    """The peer closed the connection (before a frame, or in the middle of one)."""


def tune(sock: socket.socket) -> None:
    """TCP_NODELAY: a frame goes out at once, never held back for the next one (Nagle)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def encode(body: bytes) -> bytes:
    """One frame: the length prefix, then ``body``."""
    return len(body).to_bytes(HEADER_BYTES, "big") + body


class FrameSocket:
    """A connected (possibly TLS) socket carrying frames; one reader and one writer at a time.
    ``poll_s`` > 0 leaves the socket non-blocking while a read polls, so reads and writes must
    come from one thread (as both ends of the data plane do)."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int, poll_s: float = 0.0) -> None:
        self.sock, self.max_frame_bytes, self.poll_s = sock, max_frame_bytes, poll_s
        self._buf = bytearray()

    def send(self, body: bytes, timeout: float | None = None) -> None:
        """Write one frame; ``timeout`` bounds the write (None: block)."""
        self.sock.settimeout(timeout)
        self.sock.sendall(encode(body))

    def recv(self, deadline: float | None = None) -> bytes:
        """Read one frame's body. ``deadline`` (``time.monotonic``): ``TimeoutError`` past it
        (None: block). ``FrameTooLarge`` for a length above ``max_frame_bytes``; ``PeerClosed``
        when the peer closes before the frame is whole. With ``poll_s``, the frame's start is
        polled for that long before the read blocks."""
        if self.poll_s > 0 and len(self._buf) < HEADER_BYTES:
            self._poll(min(self.poll_s, max(deadline - time.monotonic(), 0.0)) if deadline is not None
                       else self.poll_s)
        header = self._read(HEADER_BYTES, deadline)
        n = int.from_bytes(header, "big")
        if n > self.max_frame_bytes:
            raise FrameTooLarge(f"frame of {n} bytes is above the limit of {self.max_frame_bytes} bytes")
        return self._read(n, deadline)

    def _poll(self, seconds: float) -> None:
        """Read without blocking until bytes arrive or ``seconds`` pass, yielding the core between
        tries; the caller's blocking read does the rest.

        NOTE: a blocked reader pays the wake-up of its thread on every frame (several tens of
        microseconds on an idle core, more on a small virtual machine: scripts/exchange_floor.py);
        a polling one is running when the frame lands, at the price of a busy core meanwhile."""
        sock, end = self.sock, time.perf_counter() + seconds
        sock.setblocking(False)
        try:
            while time.perf_counter() < end:
                try:
                    chunk = sock.recv(_CHUNK)
                except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    os.sched_yield()
                    continue
                if not chunk:
                    raise PeerClosed(f"connection closed with {len(self._buf)} bytes of a frame read")
                self._buf += chunk
                return
        finally:
            sock.setblocking(True)

    def _read(self, n: int, deadline: float | None) -> bytes:
        buf = self._buf
        while len(buf) < n:
            if deadline is None:
                self.sock.settimeout(None)
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no frame before the deadline")
                self.sock.settimeout(left)
            # NOTE: at most _MAX_RECV per call: recv allocates what it is asked for, and a
            # length prefix alone (up to max_frame_bytes) must not make every read that big.
            chunk = self.sock.recv(min(max(_CHUNK, n - len(buf)), _MAX_RECV))
            if not chunk:
                raise PeerClosed(f"connection closed with {len(buf)} of {n} bytes read")
            buf += chunk
        out = bytes(buf[:n])
        del buf[:n]
        return out

    def close(self) -> None:
        """Shut the connection down both ways (wakes a thread blocked reading it), then close."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass                          # already closed or never connected
        self.sock.close()


# --- TLS, as the gRPC server and channel have it -------------------------------------


def server_context(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    """The service's certificate and key; with ``client_ca``, clients must show a certificate it signed."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if client_ca:
        ctx.load_verify_locations(cafile=client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """Verify the server against ``ca`` (and its name, as gRPC does); show ``cert`` for mTLS."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx
