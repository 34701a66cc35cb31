"""gRPC clients of the draft and target workers, shaped as the round driver's ports.

Owns: channels (message-size limits, optional TLS, admin-token metadata on
lifecycle calls), unary Prefill/Release/GetStatus/lifecycle calls with
deadlines, and the per-round Propose/Verify exchanges over ONE persistent
bidirectional stream per worker: a round puts one batched request on the
stream and reads exactly one response within a bounded wait. The draft's
Propose goes over its data plane instead (``rounds.data_plane``, same
contract, no threads) when its status advertises one, and so do its prefill
and the releases flushed between rounds (the Prefill / Release calls when it
does not, or predates prefill on the data plane). A timeout or a
stream error cancels the stream and raises ``WorkerUnavailable``; the next
round opens a fresh stream (lazy reconnect). Per-item ``ItemError``s become
``ItemFailures`` so only those requests end.

Hidden states are never interpreted here: they are kept as the wire's raw
values (bf16 stays as its uint16 bit patterns) between the target's response
and the draft's request; only tokens and counts are read. A draft whose status
sets ``propose_hidden_rows`` gets a round's rows in one tensor
(``ProposeRequest.hidden_rows``), others each item's own.

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

from rounds import data_plane
from rounds.data_plane import ConnectFailed, DataPlaneLink, address_host, tls_context
from rounds.scheduler import ItemFailures, RequestError, WorkerUnavailable
from runtime.types import (DraftPrefillRequest, PrefillRequest, PrefillResult, Proposal, ProposeRequest,
                           VerifyRequest, VerifyResult)
from core import wire
from core.serving import admin_metadata
from specsplit.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

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


def _item_error(role: str, err: common_pb2.ItemError) -> RequestError:
    return RequestError(_CODE_NAMES.get(err.code, "INTERNAL"), f"{role}: {err.message}")


def _hidden_to_wire(arr: np.ndarray, into: common_pb2.Tensor | None = None) -> common_pb2.Tensor:
    # uint16 rows are bf16 bit patterns kept from the target's response (see module doc).
    dtype = "bfloat16" if arr.dtype == np.uint16 else None
    return wire.encode_tensor(arr, dtype) if into is None else wire.fill_tensor(into, arr, dtype)


def _hidden_from_wire(t: common_pb2.Tensor, field: str) -> np.ndarray:
    return wire.decode_tensor(t, field, allowed=wire.FLOAT_DTYPES, bf16_bits=True)


def _joined_rows(reqs: list[ProposeRequest]) -> np.ndarray | None:
    """The items' hidden rows as one [n, d] array (ProposeRequest.hidden_rows), in item order;
    None when there are none or they do not make one tensor (then each item sends its own, as
    before, and the draft answers each as it did)."""
    parts = [r.hidden for r in reqs if not r.ahead]
    if not parts:
        return None
    first = parts[0]
    for r, h in zip((r for r in reqs if not r.ahead), parts):
        if h.ndim != 2 or h.dtype != first.dtype or h.shape[1] != first.shape[1] or len(h) != len(r.tokens):
            return None
    return np.concatenate(parts) if len(parts) > 1 else first


def _proposal_from_wire(q: ProposeRequest, res: draft_pb2.ProposeResult) -> Proposal:
    """One ProposeResult's proposal. NOTE: q's field name is built only for a result that has
    draft_probs (a greedy draft sends none), not for every request of every round."""
    p = res.proposal
    probs = (wire.decode_optional_tensor(p, "draft_probs", f"results[{q.request_id}].proposal.draft_probs",
                                         allowed=("float32",)) if p.HasField("draft_probs") else None)
    return Proposal(q.request_id, wire.int64_array(p.drafts), probs)


def _collect(role: str, reqs: list[Any], results: Any, convert: Callable[[Any, Any], Any]) -> list[Any]:
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


class _RoundStream:
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


class _WorkerClient:
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
        return self._unary("GetStatus", common_pb2.GetStatusRequest(), timeout=timeout).status

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


class TargetClient(_WorkerClient):
    """``TargetPort`` over gRPC: Prefill (unary), Verify (persistent stream), Release."""

    role = "target"

    def __init__(self, address: str, **kw: Any) -> None:
        super().__init__(address, target_pb2_grpc.TargetServiceStub, **kw)
        self._verify = _RoundStream("target", lambda it: self.stub.Verify(it), self.timeout_s)

    def prefill(self, reqs: list[PrefillRequest]) -> list[PrefillResult]:
        items = []
        for r in reqs:
            item = target_pb2.TargetPrefillItem(request_id=r.request_id, prompt=[int(t) for t in r.prompt],
                                                params=wire.params_to_proto(r.params))
            if r.resume_token is not None:
                item.resume_token = int(r.resume_token)
            items.append(item)
        resp = self._unary("Prefill", target_pb2.TargetPrefillRequest(items=items))
        return _collect("target", reqs, resp.results, lambda q, res: PrefillResult(
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
        return _collect("target", reqs, resp.results, lambda q, res: VerifyResult(
            q.request_id, int(res.output.num_accepted), tuple(int(t) for t in res.output.tokens),
            _hidden_from_wire(res.output.hidden, f"results[{q.request_id}].output.hidden")))

    def reset_streams(self) -> None:
        """Drop the Verify stream (scheduler thread); the next round opens a fresh one."""
        self._verify.reset()

    def close(self) -> None:
        self._verify.close()
        super().close()


class DraftClient(_WorkerClient):
    """``DraftPort`` over gRPC: Prefill (unary), Release, and Propose over the draft's data plane
    when its status advertises one (``rounds.data_plane``), else over the persistent gRPC stream.

    The data plane's port is learnt from every GetStatus answer (the draft link probes it before
    each attach, ``rounds.draft_health``); ``data_plane=False`` keeps Propose on the gRPC stream.
    """

    role = "draft"
    _hidden_rows = False                        # the draft reads ProposeRequest.hidden_rows (its status says)

    def __init__(self, address: str, *, data_plane: bool = True, data_plane_poll_s: float = 0.0, **kw: Any) -> None:
        super().__init__(address, draft_pb2_grpc.DraftServiceStub, **kw)
        self._propose = _RoundStream("draft", lambda it: self.stub.Propose(it), self.timeout_s)
        self._data = DataPlaneLink("draft", address_host(address) if data_plane else None,
                                   draft_pb2.ProposeResponse.FromString, timeout_s=self.timeout_s,
                                   max_frame_bytes=kw["max_message_bytes"],
                                   ssl_context=tls_context(kw.get("tls_ca"), kw.get("client_cert"),
                                                           kw.get("client_key")), poll_s=data_plane_poll_s)
        self._pending_release: list[str] = []   # released ids not yet sent (ride on the next message)
        self._data_prefill = True               # False: this draft ignores prefill_items (it predates them)

    @property
    def uses_data_plane(self) -> bool:
        """Whether the next Propose goes over the data plane (else the gRPC stream)."""
        return self._data.usable

    def get_status(self, timeout: float | None = None) -> common_pb2.WorkerStatus:
        st = super().get_status(timeout)
        self._data.advertised(st.data_plane_port)
        self._hidden_rows = st.propose_hidden_rows
        return st

    # --- port: release (deferred) ------------------------------------------------
    def release(self, request_id: str) -> bool:
        """Free a request's draft cache with the next Prefill/Propose message (no call of its own);
        ``flush_releases`` sends what is left when no message follows."""
        self._pending_release.append(request_id)
        return True

    def _take_releases(self) -> list[str]:
        ids, self._pending_release = self._pending_release, []
        return ids

    def flush_releases(self) -> None:
        """Send the deferred releases now: a message of their own on the data plane, else one
        Release call."""
        ids = self._take_releases()
        if not ids:
            return
        if self._data_message(draft_pb2.ProposeRequest(release_request_ids=ids), "Release") is None:
            self.release_many(ids)

    def prefill(self, reqs: list[DraftPrefillRequest]) -> None:
        """The joiners' prefill (and the deferred releases, first): one message on the data plane
        when it is usable, else the Prefill RPC. Per-item failures raise ItemFailures; a failure of
        the whole prefill raises what the RPC's status would (RequestError / WorkerUnavailable)."""
        items = [draft_pb2.DraftPrefillItem(request_id=r.request_id, tokens=[int(t) for t in r.tokens],
                                            hidden=_hidden_to_wire(r.hidden), params=wire.params_to_proto(r.params))
                 for r in reqs]
        releases = self._take_releases()
        self.last_compute_seconds = None                     # a prefill reports no round compute
        if self._data_prefill:
            resp = self._data_message(draft_pb2.ProposeRequest(prefill_items=items, release_request_ids=releases),
                                      "Prefill")
            if resp is not None:
                releases = []                                # sent: they ran first, whatever follows
                if resp.HasField("prefill_error"):
                    err = resp.prefill_error
                    raise _call_error("draft", "Prefill", grpc.StatusCode[_CODE_NAMES.get(err.code, "INTERNAL")],
                                      err.message)
                if len(resp.prefill_results) == len(items):
                    _collect("draft", reqs, resp.prefill_results, lambda q, res: None)
                    return
                # NOTE: a draft that predates prefill_items released and ignored them: this
                # prefill and every later one go through the Prefill RPC.
                self._data_prefill = False
                log.info("draft_data_plane_prefill_unsupported", address=self.address)
        resp = self._unary("Prefill", draft_pb2.DraftPrefillRequest(items=items, release_request_ids=releases))
        _collect("draft", reqs, resp.results, lambda q, res: None)

    def _data_message(self, msg: draft_pb2.ProposeRequest, what: str) -> draft_pb2.ProposeResponse | None:
        """A message between rounds (a prefill, releases) on the data plane, numbered like a round:
        its answer, or None when the data plane is not usable or could not be opened (the caller
        uses gRPC). A connection that breaks mid-exchange raises WorkerUnavailable, as a round does."""
        if not self._data.usable:
            return None
        msg.round = self._next_round()
        try:
            return self._data.exchange(msg, what)
        except ConnectFailed as exc:
            log.warning("data_plane_unreachable", address=self.address, error=exc.message,
                        retry_after_s=data_plane.RETRY_AFTER_S)
            return None

    def propose(self, reqs: list[ProposeRequest]) -> list[Proposal]:
        return self.propose_async(reqs)()

    def propose_async(self, reqs: list[ProposeRequest]) -> Callable[[], list[Proposal]]:
        """Send the round's Propose now; the returned function waits for the proposals."""
        self.last_compute_seconds = None
        msg = draft_pb2.ProposeRequest(round=self._next_round(), release_request_ids=self._take_releases())
        # NOTE: items built in place (items.add, the hidden rows written into their field): a
        # list of separate messages is copied once more into the request, ~40 % of the encode
        # at batch 8 (docs/performance.md § Session 10). A draft that reads hidden_rows gets
        # every item's rows in that one tensor: one encode and one decode a round instead of
        # one per request (about half of both at batch 8).
        rows = _joined_rows(reqs) if self._hidden_rows else None
        add = msg.items.add
        for r in reqs:
            if r.ahead:
                add(request_id=r.request_id, k=int(r.k), ahead=True, keep_tail=r.keep_tail)
                continue
            item = add(request_id=r.request_id, start_position=int(r.start_position), k=int(r.k),
                       keep_tail=r.keep_tail)
            item.tokens.extend(np.asarray(r.tokens, dtype=np.int64).tolist())
            if rows is None:
                _hidden_to_wire(r.hidden, item.hidden)
        if rows is not None:
            _hidden_to_wire(rows, msg.hidden_rows)
        receive = None
        if self._data.usable:
            try:
                receive = self._data.send(msg)
            except ConnectFailed as exc:
                # NOTE: the same message goes on the gRPC stream: its releases and round number
                # are sent once, whichever way carries them.
                log.warning("data_plane_unreachable", address=self.address, error=exc.message,
                            retry_after_s=data_plane.RETRY_AFTER_S)
        if receive is None:
            receive = self._propose.send(msg)

        def collect() -> list[Proposal]:
            resp = receive("Propose")
            self.last_compute_seconds = resp.compute_seconds
            return _collect("draft", reqs, resp.results, _proposal_from_wire)
        return collect

    def reset_streams(self) -> None:
        """Drop the Propose stream and the data-plane connection (scheduler thread); the next
        round opens a fresh one."""
        self._propose.reset()
        self._data.reset()

    def close(self) -> None:
        self._propose.close()
        self._data.close()
        super().close()
