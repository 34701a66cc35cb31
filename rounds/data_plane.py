"""The round loop's side of a worker's per-round data plane (DESIGN § Topology).

Owns: ``DataPlaneLink``: one TCP (or TLS) connection to the port a worker
advertises in its status, opened lazily on the first round and after every
failure; one frame out and one back per round, written and read on the
calling thread itself (the round loop: no threads, no queues), the read
bounded by ``timeout_s``; the same contract as the gRPC round stream
(``send`` now, read later; a response for another round, a connection that
fails, closes, stalls or answers an undecodable frame closes the connection
and raises ``WorkerUnavailable``, so the draft's fallback and re-attach work
unchanged). A connection that cannot be opened at all (refused, filtered, TLS
refused) raises ``ConnectFailed`` at once and the link stays unusable for that
port for ``RETRY_AFTER_S``: the caller sends that round, and the next ones, over
its gRPC stream instead (a firewall that lets gRPC through but not the data
plane costs speed, not service). ``address_host`` / ``tls_context`` turn the
worker's gRPC address and the client's CA / certificate into where and how to
connect.

Must not know: scheduling, which messages are framed (``parse`` decodes the
answer), gRPC.
"""

from __future__ import annotations

import socket
import ssl
import time
from typing import Any, Callable

from google.protobuf.message import DecodeError

from core import frames
from rounds.scheduler_types import WorkerUnavailable


CONNECT_TIMEOUT_S = 3.0      # opening the connection (one host or one cluster: milliseconds)
RETRY_AFTER_S = 60.0         # after a failed open, the gRPC stream carries the rounds this long


class ConnectFailed(WorkerUnavailable):
    """The data plane could not be opened; the worker may still answer over gRPC."""


def address_host(address: str) -> str | None:
    """The host part of a gRPC ``host:port`` address (``[v6]:port`` too); None for a unix socket."""
    if address.startswith("unix:"):
        return None
    if address.startswith("dns:///"):
        address = address[len("dns:///"):]
    host = address.rpartition(":")[0] if ":" in address else address
    return host.strip("[]") or None


def tls_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The data plane's TLS as the gRPC channel has it: None (plaintext) without a CA."""
    return frames.client_context(ca, cert, key) if ca is not None else None


class DataPlaneLink:
    """One worker's data-plane connection; ``port`` 0 = the worker advertises none."""

    def __init__(self, role: str, host: str | None, parse: Callable[[bytes], Any], *, timeout_s: float,
                 max_frame_bytes: int, ssl_context: ssl.SSLContext | None = None, poll_s: float = 0.0) -> None:
        self.role, self.host, self._parse, self.poll_s = role, host, parse, poll_s
        self.timeout_s, self.max_frame_bytes, self._ssl = timeout_s, max_frame_bytes, ssl_context
        self.port = 0
        self._conn: frames.FrameSocket | None = None
        self._conn_port = 0
        self._refused: tuple[int, float] | None = None      # (port, when) of the last failed open

    @property
    def usable(self) -> bool:
        """The worker advertised a data plane, we know where it is, and it was not found
        unreachable on this port within the last ``RETRY_AFTER_S``."""
        if self.port <= 0 or self.host is None:
            return False
        refused = self._refused
        return refused is None or refused[0] != self.port or time.monotonic() - refused[1] > RETRY_AFTER_S

    def advertised(self, port: int) -> None:
        """The port from the worker's latest status (any thread; a new port is used from the next send)."""
        self.port = int(port)

    def _connect(self) -> frames.FrameSocket:
        sock = socket.create_connection((self.host, self.port), timeout=min(self.timeout_s, CONNECT_TIMEOUT_S))
        try:
            frames.tune(sock)
            if self._ssl is not None:
                # NOTE: the name checked is the host of the worker's gRPC address, as gRPC checks it.
                sock = self._ssl.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise
        self._conn_port = self.port
        return frames.FrameSocket(sock, self.max_frame_bytes, self.poll_s)

    def reset(self) -> None:
        """Close the connection; the next send opens a new one."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    close = reset

    def _fail(self, what: str, why: str) -> WorkerUnavailable:
        self.reset()
        return WorkerUnavailable(f"{self.role} {what} (data plane {self.host}:{self._conn_port}): {why}")

    def exchange(self, request: Any, what: str) -> Any:
        return self.send(request)(what)

    def send(self, request: Any) -> Callable[[str], Any]:
        """Write the round's frame now; the returned function reads its answer (the round may
        do other work in between, e.g. verify while the draft drafts ahead)."""
        body = request.SerializeToString()
        if len(body) > self.max_frame_bytes:
            raise WorkerUnavailable(f"{self.role}: a round message of {len(body)} bytes is above the "
                                    f"limit of {self.max_frame_bytes} bytes")
        if self._conn is not None and self._conn_port != self.port:
            self.reset()                         # the worker restarted on another port
        if self._conn is None:
            try:
                self._conn = self._connect()
            except OSError as exc:               # refused, unreachable, timed out, TLS refused (SSLError)
                self._refused = (self.port, time.monotonic())
                raise ConnectFailed(f"{self.role}: data plane {self.host}:{self.port} could not be opened: "
                                    f"{str(exc) or type(exc).__name__}") from None
            self._refused = None
        try:
            conn = self._conn
            conn.send(body, self.timeout_s)
        except OSError as exc:                   # refused, reset, TLS refused, timed out (TimeoutError)
            err = self._fail("send", str(exc) or type(exc).__name__)
            return lambda what: _raise(err)
        return lambda what: self._receive(conn, request, what)

    def _receive(self, conn: frames.FrameSocket, request: Any, what: str) -> Any:
        if conn is not self._conn:               # reset since the send
            raise WorkerUnavailable(f"{self.role} {what}: the data plane was reset before the response")
        try:
            body = conn.recv(time.monotonic() + self.timeout_s)
        except TimeoutError:
            raise self._fail(what, f"no response within {self.timeout_s:g}s") from None
        except (OSError, frames.FrameTooLarge) as exc:   # PeerClosed is a ConnectionError
            raise self._fail(what, str(exc) or type(exc).__name__) from None
        try:
            response = self._parse(body)
        except DecodeError as exc:
            raise self._fail(what, f"undecodable response: {exc}") from None
        if response.round != request.round:
            raise self._fail(what, f"response for round {response.round}, expected {request.round}")
        return response


def _raise(err: Exception) -> Any:
    raise err
