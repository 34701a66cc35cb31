"""The draft worker's gRPC client, shaped as the round driver's ``DraftPort``.

Owns: the draft's side of ``rounds.worker_clients``' contract (module doc there: deadlines,
one persistent stream, lazy reconnect, per-item failures): Propose over the draft's data plane
when its status advertises one (``rounds.data_plane``) and over the gRPC stream otherwise; the
joiners' prefill and the deferred releases on the same data plane (the Prefill / Release calls
when it is not usable, or the draft predates prefill on it); a round's hidden rows in one
tensor (``ProposeRequest.hidden_rows``) to a draft whose status sets ``propose_hidden_rows``,
each item's own to others. Hidden rows are passed on as the wire's raw values, never read.

Must not know: scheduling, sampling, models, frameworks.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import structlog

from core import wire
from rounds import data_plane
from rounds.data_plane import ConnectFailed, DataPlaneLink, address_host, tls_context
from rounds.worker_clients import RoundStream, WorkerClient, collect_results, hidden_to_wire, status_error
from runtime.types import DraftPrefillRequest, Proposal, ProposeRequest
from specsplit.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = structlog.get_logger("rounds.clients")


def _joined_rows(reqs: list[ProposeRequest]) -> np.ndarray | None:
    """The items' hidden rows as one [n, d] array (ProposeRequest.hidden_rows), in item order;
    None when fewer than two items draft or their rows do not make one tensor (then each item
    sends its own, as before, and the draft answers each as it did).

    NOTE: one drafting item keeps its own tensor: joining buys nothing there and the draft's
    slicing cost ~3 us more a round at batch 1 (``bench propose-host``, 2-core CPU)."""
    drafting = [r for r in reqs if not r.ahead]
    if len(drafting) < 2:
        return None
    parts = [r.hidden for r in drafting]
    first = parts[0]
    for r, h in zip(drafting, parts):
        if h.ndim != 2 or h.dtype != first.dtype or h.shape[1] != first.shape[1] or len(h) != len(r.tokens):
            return None
    return np.concatenate(parts)


def _proposal_from_wire(q: ProposeRequest, res: draft_pb2.ProposeResult) -> Proposal:
    """One ProposeResult's proposal. NOTE: q's field name is built only for a result that has
    draft_probs (a greedy draft sends none), not for every request of every round."""
    p = res.proposal
    probs = (wire.decode_optional_tensor(p, "draft_probs", f"results[{q.request_id}].proposal.draft_probs",
                                         allowed=("float32",)) if p.HasField("draft_probs") else None)
    return Proposal(q.request_id, wire.int64_array(p.drafts), probs)


class DraftClient(WorkerClient):
    """``DraftPort`` over gRPC: Prefill (unary), Release, and Propose over the draft's data plane
    when its status advertises one (``rounds.data_plane``), else over the persistent gRPC stream.

    The data plane's port is learnt from every GetStatus answer (the draft link probes it before
    each attach, ``rounds.draft_health``); ``data_plane=False`` keeps Propose on the gRPC stream.
    """

    role = "draft"
    _hidden_rows = False                        # the draft reads ProposeRequest.hidden_rows (its status says)

    def __init__(self, address: str, *, data_plane: bool = True, data_plane_poll_s: float = 0.0, **kw: Any) -> None:
        super().__init__(address, draft_pb2_grpc.DraftServiceStub, **kw)
        self._propose = RoundStream("draft", lambda it: self.stub.Propose(it), self.timeout_s)
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
                                            hidden=hidden_to_wire(r.hidden), params=wire.params_to_proto(r.params))
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
                    raise status_error("draft", "Prefill", err.code, err.message)
                if len(resp.prefill_results) == len(items):
                    collect_results("draft", reqs, resp.prefill_results, lambda q, res: None)
                    return
                # NOTE: a draft that predates prefill_items released and ignored them: this
                # prefill and every later one go through the Prefill RPC.
                self._data_prefill = False
                log.info("draft_data_plane_prefill_unsupported", address=self.address)
        resp = self._unary("Prefill", draft_pb2.DraftPrefillRequest(items=items, release_request_ids=releases))
        collect_results("draft", reqs, resp.results, lambda q, res: None)

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
                hidden_to_wire(r.hidden, item.hidden)
        if rows is not None:
            hidden_to_wire(rows, msg.hidden_rows)
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
            return collect_results("draft", reqs, resp.results, _proposal_from_wire)
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
