"""gRPC clients of the draft and target workers, shaped as the round driver's ports: what both
share, and the target's (``TargetClient``); the draft's is ``rounds.draft_client.DraftClient``.

Owns: channels (message-size limits, optional TLS, admin-token metadata on
lifecycle calls), unary Prefill/Release/GetStatus/lifecycle calls with
deadlines, and the per-round Propose/Verify exchanges over ONE persistent
bidirectional stream per worker: a round puts one batched request on the
stream and reads exactly one response within a bounded wait. The draft's
Propose goes over its data plane instead (``rounds.data_plane``, same
contract, no threads) when its status advertises one, and so do its prefill
and the releases flushed between rounds (``rounds.draft_client``). A timeout or a
stream error cancels the stream and raises ``WorkerUnavailable``; the next
round opens a fresh stream (lazy reconnect). Per-item ``ItemError``s become
``ItemFailures`` so only those requests end.

Hidden states are never interpreted here: they are kept as the wire's raw
values (bf16 stays as its uint16 bit patterns) between the target's response
and the draft's request; only tokens and counts are read.

Must not know: scheduling, sampling, models, frameworks.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import numpy as np
import structlog

from rounds.scheduler import ItemFailures, RequestError, WorkerUnavailable
from runtime.types import PrefillRequest, PrefillResult, VerifyRequest, VerifyResult
from core import wire
from core.serving import admin_metadata
from specsplit.v1 import common_pb2, target_pb2, target_pb2_grpc

log = structlog.get_logger("rounds.clients")

# Codes meaning "the worker (or the path to it) is gone", not "this request is bad".
_UNAVAILABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                      grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}
_WATCHDOG_POLL_S = 0.05
_HOLD_POINTS = ("clear_graphs", "release", "load")    # CommitWeightsStart.hold_after
_WEIGHTS_MODES = {"recapture": common_pb2.WEIGHTS_MODE_RECAPTURE, "in_place": common_pb2.WEIGHTS_MODE_IN_PLACE}


def make_channel(address: str, *, max_message_bytes: int, tls_ca: str | None = None,
                 client_cert: str | None = None, client_key: str | None = None) -> grpc.Channel:
    """A channel with the message-size limits; TLS when ``tls_ca`` is set (mTLS with a client cert)."""
    options = [("grpc.max_send_message_length", max_message_bytes),
               ("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.keepalive_time_ms", 30_000),
               ("grpc.enable_retries", 0),
               # NOTE: a restarted worker is found within ~1 s: gRPC's default reconnect
               # backoff grows to 120 s, and calls fail fast meanwhile.
               ("grpc.initial_reconnect_backoff_ms", 100),
               ("grpc.min_reconnect_backoff_ms", 100),
               ("grpc.max_reconnect_backoff_ms", 1000)]
    if tls_ca is None:
        return grpc.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(tls_ca).read_bytes(),
        private_key=Path(client_key).read_bytes() if client_key else None,
        certificate_chain=Path(client_cert).read_bytes() if client_cert else None)
    return grpc.secure_channel(address, creds, options=options)


def _rpc_error(role: str, what: str, exc: grpc.RpcError) -> RequestError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    return _call_error(role, what, code, exc.details() if hasattr(exc, "details") else str(exc))


def _call_error(role: str, what: str, code: grpc.StatusCode, details: str) -> RequestError:
    """A whole call's failure, as the scheduler sees it: WorkerUnavailable for the codes that mean
    the worker is away, else RequestError with the code."""
    msg = f"{role} {what}: {code.name}: {details}"
    return WorkerUnavailable(msg) if code in _UNAVAILABLE_CODES else RequestError(code.name, msg)


def status_error(role: str, what: str, code: int, message: str) -> RequestError:
    """``_call_error`` for a status carried in a message (a ``Code`` number, unknown ones INTERNAL)."""
    return _call_error(role, what, grpc.StatusCode[_CODE_NAMES.get(code, "INTERNAL")], message)


def _item_error(role: str, err: common_pb2.ItemError) -> RequestError:
    return RequestError(_CODE_NAMES.get(err.code, "INTERNAL"), f"{role}: {err.message}")


def hidden_to_wire(arr: np.ndarray, into: common_pb2.Tensor | None = None) -> common_pb2.Tensor:
    # uint16 rows are bf16 bit patterns kept from the target's response (see module doc).
    dtype = "bfloat16" if arr.dtype == np.uint16 else None
    return wire.encode_tensor(arr, dtype) if into is None else wire.fill_tensor(into, arr, dtype)


def _hidden_from_wire(t: common_pb2.Tensor, field: str) -> np.ndarray:
    return wire.decode_tensor(t, field, allowed=wire.FLOAT_DTYPES, bf16_bits=True)


def collect_results(role: str, reqs: list[Any], results: Any, convert: Callable[[Any, Any], Any]) -> list[Any]:
    """Match results to requests by id; raise ItemFailures if any item failed."""
    by_id = {r.request_id: r for r in results}
    out: list[Any] = []
    errors: dict[str, RequestError] = {}
    for q in reqs:
        res = by_id.get(q.request_id)
        try:
            if res is None:
                raise RequestError("INTERNAL", f"{role}: no result for request {q.request_id!r}")
            if res.HasField("error"):
                raise _item_error(role, res.error)
            out.append(convert(q, res))
        except RequestError as exc:
            errors[q.request_id] = exc
            out.append(None)
        except ValueError as exc:                # a malformed tensor in the worker's answer
            errors[q.request_id] = RequestError("INTERNAL", f"{role}: {exc}")
            out.append(None)
    if errors:
        raise ItemFailures(out, errors)
    return out


class RoundStream:
    """One persistent bidi stream: ``exchange`` = send one message, read exactly one back.

    A watchdog thread cancels the call when a response is late, so a stalled
    worker cannot block the scheduler past ``timeout_s``.
    """

    def __init__(self, role: str, open_call: Callable[[Iterator[Any]], Any], timeout_s: float) -> None:
        self.role, self._open_call, self.timeout_s = role, open_call, timeout_s
        self._call: Any = None
        self._requests: queue.SimpleQueue | None = None
        self._deadline: float | None = None
        self._timed_out = False
        self._closed = False
        self._watchdog: threading.Thread | None = None

    def _open(self) -> None:
        self._requests = queue.SimpleQueue()
        requests = self._requests

        def request_iter() -> Iterator[Any]:
            while (item := requests.get()) is not None:
                yield item
        self._call = self._open_call(request_iter())
        self._timed_out = False
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name=f"{self.role}-stream-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        while not self._closed:
            time.sleep(_WATCHDOG_POLL_S)
            deadline, call = self._deadline, self._call
            if deadline is not None and call is not None and time.monotonic() > deadline:
                self._timed_out = True
                call.cancel()

    def reset(self) -> None:
        """Cancel the stream; the next exchange opens a new one."""
        call, requests = self._call, self._requests
        self._call, self._requests = None, None
        if requests is not None:
            requests.put(None)                   # ends the request iterator's thread
        if call is not None:
            call.cancel()

    def exchange(self, request: Any, what: str) -> Any:
        return self.send(request)(what)

    def send(self, request: Any) -> Callable[[str], Any]:
        """Put one message on the stream now; the returned function reads its response
        (the round may do other work in between, e.g. verify while the draft drafts ahead)."""
        if self._call is None:
            self._open()
        call = self._call
        self._requests.put(request)
        return lambda what: self._receive(call, request, what)

    def _receive(self, call: Any, request: Any, what: str) -> Any:
        if call is not self._call:               # the stream was reset since the send
            raise WorkerUnavailable(f"{self.role} {what}: the stream was reset before the response")
        self._deadline = time.monotonic() + self.timeout_s
        try:
            response = next(call)
        except StopIteration:
            self.reset()
            raise WorkerUnavailable(f"{self.role} {what}: the worker closed the stream") from None
        except grpc.RpcError as exc:
            timed_out = self._timed_out
            self.reset()
            if timed_out:
                raise WorkerUnavailable(f"{self.role} {what}: no response within {self.timeout_s:g}s") from None
            raise WorkerUnavailable(_rpc_error(self.role, what, exc).message) from None
        finally:
            self._deadline = None
        if response.round != request.round:
            self.reset()
            raise WorkerUnavailable(f"{self.role} {what}: response for round {response.round}, "
                                    f"expected {request.round}")
        return response

    def close(self) -> None:
        self._closed = True
        self.reset()


class WorkerClient:
    """Shared by both roles: channel, deadlines, Release, GetStatus and lifecycle RPCs."""

    role = ""

    def __init__(self, address: str, stub_factory: Callable[[grpc.Channel], Any], *, timeout_s: float,
                 max_message_bytes: int, tls_ca: str | None = None, client_cert: str | None = None,
                 client_key: str | None = None, admin_token: str | None = None,
                 token_source: Callable[[], str | None] | None = None) -> None:
        self.address, self.timeout_s, self.max_message_bytes = address, timeout_s, max_message_bytes
        # Where the admin token comes from again when the worker refuses it (a restarted worker
        # with a generated token wrote a new one to its token file).
        self._token_source = token_source
        self._channel = make_channel(address, max_message_bytes=max_message_bytes, tls_ca=tls_ca,
                                     client_cert=client_cert, client_key=client_key)
        self.stub = stub_factory(self._channel)
        self._admin_md = admin_metadata(admin_token) or None
        self.last_compute_seconds: float | None = None    # of the last Propose/Verify (read by the scheduler)
        self._round = 0

    def _unary(self, what: str, request: Any, *, admin: bool = False, timeout: float | None = None) -> Any:
        self.last_compute_seconds = None                 # unary answers carry no compute time
        for attempt in (0, 1):
            try:
                return getattr(self.stub, what)(request, timeout=timeout or self.timeout_s,
                                                metadata=self._admin_md if admin else None)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if attempt == 0 and admin and code == grpc.StatusCode.UNAUTHENTICATED and self._refresh_token():
                    continue                             # the worker restarted with a new generated token
                raise _rpc_error(self.role, what, exc) from None
        raise AssertionError("unreachable")

    def _refresh_token(self) -> bool:
        """Re-read the admin token; True when it changed (worth one retry)."""
        if self._token_source is None:
            return False
        md = admin_metadata(self._token_source()) or None
        if md == self._admin_md:
            return False
        self._admin_md = md
        return True

    def _next_round(self) -> int:
        self._round += 1
        return self._round

    # --- port: release ----------------------------------------------------------
    def release(self, request_id: str) -> bool:
        return request_id in self.release_many([request_id])

    def release_many(self, request_ids: list[str]) -> list[str]:
        """Free caches (idempotent); returns the ids the worker held."""
        resp = self._unary("Release", common_pb2.ReleaseRequest(request_ids=list(request_ids)))
        return list(resp.released)

    # --- status and lifecycle ----------------------------------------------------
    def get_status(self, timeout: float | None = None) -> common_pb2.WorkerStatus:
        try:
            return self._unary("GetStatus", common_pb2.GetStatusRequest(), timeout=timeout).status
        except RequestError as exc:
            if exc.code != "UNIMPLEMENTED":
                raise
            # A server that answers but has no such service: most often a draft address that names
            # a target started without --colocated-draft.
            hint = (" (a target serves the draft only when started with --colocated-draft)"
                    if self.role == "draft" else "")
            raise RequestError(exc.code, f"{exc.message}: the server at {self.address} has no {self.role} "
                                         f"service{hint}") from None

    def load_weights(self, target_path: str, draft_path: str = "", version: str = "", in_place: bool = False,
                     validate_only: bool = False, timeout: float | None = None) -> common_pb2.WorkerStatus:
        req = common_pb2.LoadWeightsRequest(target_path=target_path, draft_path=draft_path, version=version,
                                            in_place=in_place, validate_only=validate_only)
        return self._unary("LoadWeights", req, admin=True, timeout=timeout).status

    def release_weights(self, timeout: float | None = None) -> common_pb2.WorkerStatus:
        return self._unary("ReleaseWeights", common_pb2.ReleaseWeightsRequest(), admin=True, timeout=timeout).status

    def capture_graphs(self, timeout: float | None = None) -> common_pb2.WorkerStatus:
        return self._unary("CaptureGraphs", common_pb2.CaptureGraphsRequest(), admin=True, timeout=timeout).status

    def clear_graphs(self, timeout: float | None = None) -> common_pb2.WorkerStatus:
        return self._unary("ClearGraphs", common_pb2.ClearGraphsRequest(), admin=True, timeout=timeout).status

    # --- weight swaps (PrepareWeights / CommitWeights / AbortWeights) -------------------------
    def prepare_weights(self, target_path: str, draft_path: str, version: str, mode: str, preload: bool = False,
                        timeout: float | None = None) -> common_pb2.WorkerStatus:
        req = common_pb2.PrepareWeightsRequest(target_path=target_path, draft_path=draft_path, version=version,
                                               mode=_WEIGHTS_MODES[mode], preload=preload)
        return self._unary("PrepareWeights", req, admin=True, timeout=timeout).status

    def abort_weights(self, version: str = "", timeout: float | None = None) -> bool:
        req = common_pb2.AbortWeightsRequest(version=version)
        return self._unary("AbortWeights", req, admin=True, timeout=timeout).dropped

    def commit_weights(self, version: str, mode: str, *, capture: bool | None = None,
                       hold: Callable[[str], bool] | None = None,
                       on_phase: Callable[[common_pb2.CommitWeightsEvent], None] = lambda ev: None,
                       timeout: float | None = None) -> common_pb2.WorkerStatus:
        """Commit ``version`` on the worker: one CommitWeights stream; ``on_phase`` gets each
        phase as it ends. With ``hold`` (RECAPTURE), the worker stops after clearing its graphs,
        after releasing its weights and after loading the new ones, and ``hold(after)`` decides
        each time (True: go on; False: stop there, see CommitWeightsResume). Returns the
        worker's status after the last phase; raises ``CommitFailed`` naming the last phase
        that ended (the failed one, or the one before the stream broke)."""
        start = common_pb2.CommitWeightsStart(version=version, mode=_WEIGHTS_MODES[mode],
                                              hold_after=list(_HOLD_POINTS) if hold is not None else [])
        if capture is not None:
            start.capture_graphs = capture
        for attempt in (0, 1):
            requests: queue.SimpleQueue = queue.SimpleQueue()
            requests.put(common_pb2.CommitWeightsRequest(start=start))

            def request_iter(q: queue.SimpleQueue = requests) -> Iterator[Any]:
                while (item := q.get()) is not None:
                    yield item
            last: common_pb2.CommitWeightsEvent | None = None
            stopped = done = False
            failed: CommitFailed | None = None
            try:
                call = self.stub.CommitWeights(request_iter(), timeout=timeout or self.timeout_s,
                                               metadata=self._admin_md)
                for ev in call:                          # to the stream's end (the worker ends it after "done"
                    last = ev                            # or after a failed phase)
                    if ev.HasField("error"):
                        failed = CommitFailed(ev.phase, _item_error(self.role, ev.error), reported=True)
                        continue
                    on_phase(ev)
                    if ev.held and hold is not None:
                        stopped = not hold(ev.after)
                        requests.put(common_pb2.CommitWeightsRequest(
                            resume=common_pb2.CommitWeightsResume(proceed=not stopped)))
                    done = done or ev.phase == "done"
                if failed is not None:
                    raise failed
                if (done or stopped) and last is not None:
                    return last.status
                raise CommitFailed(_ended(last), RequestError(
                    "INTERNAL", f"{self.role} CommitWeights: the stream ended before the commit was done"))
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if (attempt == 0 and last is None and code == grpc.StatusCode.UNAUTHENTICATED
                        and self._refresh_token()):
                    continue                             # the worker restarted with a new generated token
                raise CommitFailed(_ended(last), _rpc_error(self.role, "CommitWeights", exc)) from None
            finally:
                requests.put(None)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._channel.close()


def _ended(ev: common_pb2.CommitWeightsEvent | None) -> str:
    """The last phase that ended by ``ev`` (a held event: the phase it holds after)."""
    return "" if ev is None else (ev.after if ev.held else ev.phase)


class CommitFailed(Exception):
    """A CommitWeights stream failed. ``reported``: the worker reported the failed phase
    (``phase``); otherwise the stream broke or ended early and ``phase`` is the last phase
    that ended before ("" when none did). ``error``: why."""

    def __init__(self, phase: str, error: RequestError, reported: bool = False) -> None:
        super().__init__(error.message)
        self.phase, self.error, self.reported = phase, error, reported


class TargetClient(WorkerClient):
    """``TargetPort`` over gRPC: Prefill (unary), Verify (persistent stream), Release."""

    role = "target"

    def __init__(self, address: str, **kw: Any) -> None:
        super().__init__(address, target_pb2_grpc.TargetServiceStub, **kw)
        self._verify = RoundStream("target", lambda it: self.stub.Verify(it), self.timeout_s)

    def prefill(self, reqs: list[PrefillRequest]) -> list[PrefillResult]:
        items = []
        for r in reqs:
            item = target_pb2.TargetPrefillItem(request_id=r.request_id, prompt=[int(t) for t in r.prompt],
                                                params=wire.params_to_proto(r.params))
            if r.resume_token is not None:
                item.resume_token = int(r.resume_token)
            items.append(item)
        resp = self._unary("Prefill", target_pb2.TargetPrefillRequest(items=items))
        return collect_results("target", reqs, resp.results, lambda q, res: PrefillResult(
            q.request_id, int(res.output.first_token),
            _hidden_from_wire(res.output.hidden, f"results[{q.request_id}].output.hidden")))

    def verify(self, reqs: list[VerifyRequest]) -> list[VerifyResult]:
        items = []
        for r in reqs:
            item = target_pb2.VerifyItem(request_id=r.request_id, drafts=[int(d) for d in r.drafts])
            if r.draft_probs is not None:
                item.draft_probs.CopyFrom(wire.encode_tensor(r.draft_probs, "float32"))
            items.append(item)
        self.last_compute_seconds = None
        resp = self._verify.exchange(target_pb2.VerifyRequest(round=self._next_round(), items=items), "Verify")
        self.last_compute_seconds = resp.compute_seconds
        return collect_results("target", reqs, resp.results, lambda q, res: VerifyResult(
            q.request_id, int(res.output.num_accepted), tuple(int(t) for t in res.output.tokens),
            _hidden_from_wire(res.output.hidden, f"results[{q.request_id}].output.hidden")))

    def reset_streams(self) -> None:
        """Drop the Verify stream (scheduler thread); the next round opens a fresh one."""
        self._verify.reset()

    def close(self) -> None:
        self._verify.close()
        super().close()
