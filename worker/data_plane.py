"""A worker's per-round data plane: a TCP listener beside its gRPC server (DESIGN § Topology).

Owns: ``DataPlaneServer``: listening on the gRPC server's host (a chosen or a
free port), TLS / mTLS with the gRPC server's own certificate, key and client
CA (``core.frames.server_context``; plaintext when gRPC is plaintext), one
thread per connection at a time (threads are reused for later connections, so
the worker's inline-run threads stay the same few), frames in and answers out
in order through ``handle`` (bytes -> bytes; the servicer's round handling;
each connection polls for its next frame for ``poll_s`` before blocking),
closing only the connection whose frame is too large or undecodable, the count
of frames answered, and stopping (listener and every connection) on shutdown.

Must not know: which messages the frames carry (``handle`` decodes them),
engines, rounds, gRPC.
"""

from __future__ import annotations

import queue
import socket
import ssl
import threading
from typing import Any, Callable

from core import frames

HANDSHAKE_TIMEOUT_S = 10.0          # a TLS client that does not finish its handshake in this long is dropped
MAX_CONNECTIONS = 16                # open connections (threads) at most; more are closed at once
_STOP_JOIN_S = 5.0


class UndecodableFrame(ValueError):
    """``handle`` could not decode a frame: that connection closes, the service goes on."""


class DataPlaneServer:
    """Frames in, answers out, one connection per thread; ``handle(body) -> answer`` runs on it."""

    def __init__(self, host: str, port: int, handle: Callable[[bytes], bytes], *, max_frame_bytes: int,
                 ssl_context: ssl.SSLContext | None, log: Any, name: str = "data-plane", poll_s: float = 0.0) -> None:
        self._handle, self.max_frame_bytes, self._ssl, self.log, self.name = (
            handle, max_frame_bytes, ssl_context, log, name)
        self.poll_s = poll_s                    # how long a connection polls for its next frame before blocking
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(16)
        self.port: int = self._listener.getsockname()[1]
        self.frames = 0                         # frames answered since start (GetStatus: data_plane_frames)
        self._lock = threading.Lock()
        self._conns: set[frames.FrameSocket] = set()
        self._idle = 0                          # connection threads waiting for a connection
        self._accepted: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)

    def start(self) -> "DataPlaneServer":
        self._acceptor.start()
        return self

    # --- accepting ------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                if self._stopping:
                    return
                self.log.exception("data_plane_accept_failed")
                continue
            spawn: threading.Thread | None = None
            with self._lock:
                if self._stopping:
                    conn.close()
                    return
                busy = len(self._threads) - self._idle
                if busy >= MAX_CONNECTIONS:
                    # NOTE: bounded: one thread per connection, and the worker has one client
                    # (its target; a few during a restart). Refused here, never queued.
                    self.log.warning("data_plane_connection_refused", peer=str(peer), open=busy)
                    conn.close()
                    continue
                # NOTE: an idle thread is claimed before the put, so each queued connection
                # has exactly one thread that will pick it up (a reused one or a new one).
                if self._idle:
                    self._idle -= 1
                else:
                    spawn = threading.Thread(target=self._serve_loop, name=f"{self.name}-conn", daemon=True)
                    self._threads.append(spawn)
            self._accepted.put((conn, peer))
            if spawn is not None:
                spawn.start()

    def _serve_loop(self) -> None:
        while (item := self._accepted.get()) is not None:
            self._serve(*item)
            with self._lock:
                if self._stopping:
                    return
                self._idle += 1

    # --- one connection -----------------------------------------------------------------
    def _serve(self, conn: socket.socket, peer: Any) -> None:
        try:
            frames.tune(conn)
            if self._ssl is not None:
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                conn = self._ssl.wrap_socket(conn, server_side=True)
        except (OSError, ssl.SSLError) as exc:
            self.log.warning("data_plane_handshake_failed", peer=str(peer), error=str(exc))
            conn.close()
            return
        fs = frames.FrameSocket(conn, self.max_frame_bytes, self.poll_s)
        with self._lock:
            if self._stopping:
                fs.close()
                return
            self._conns.add(fs)
        try:
            while True:
                body = fs.recv()
                answer = self._handle(body)
                # NOTE: counted before the write: a client that has its answer and then asks
                # for the status sees this frame counted.
                with self._lock:
                    self.frames += 1
                fs.send(answer)
        except frames.PeerClosed:
            pass                                # the client went away (reset_streams, a restart)
        except (frames.FrameTooLarge, UndecodableFrame) as exc:
            self.log.error("data_plane_bad_frame", peer=str(peer), error=str(exc))
        except OSError as exc:
            if not self._stopping:
                self.log.info("data_plane_connection_lost", peer=str(peer), error=str(exc))
        except Exception:  # noqa: BLE001 - one connection's failure never ends the service
            self.log.exception("data_plane_connection_failed", peer=str(peer))
        finally:
            with self._lock:
                self._conns.discard(fs)
            fs.close()

    # --- stopping -----------------------------------------------------------------------
    def stop(self) -> None:
        """Stop accepting, close every connection (their clients see the stream end), join."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            conns, threads = list(self._conns), list(self._threads)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)   # wakes the blocked accept
        except OSError:
            pass
        self._listener.close()
        for fs in conns:
            fs.close()
        for _ in threads:
            self._accepted.put(None)
        self._acceptor.join(_STOP_JOIN_S)
        for t in threads:
            t.join(_STOP_JOIN_S)
