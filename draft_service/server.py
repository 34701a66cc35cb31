"""DraftService over gRPC: Prefill and the persistent Propose stream, the same Propose over the
data plane, and ``start``.

Owns: the draft's messages only: decoding Prefill / Propose items into
``runtime.types`` records (hidden rows stay bf16 bits when sent as bf16; a
round's rows sliced out of one ``hidden_rows`` tensor when the target sends
them so, which this draft's status invites: ``propose_hidden_rows``),
encoding a proposal (drafts, and q when the draft samples), and answering one
Propose message the same way whether the gRPC stream or the data plane
(``propose_frame``: serialized ProposeRequest in, ProposeResponse out) carried
it. The plumbing both workers share (per-item errors, the round answer,
lifecycle / status / release RPCs, start-up, the data plane's listener) is
``worker.service`` / ``worker.data_plane``; the work is ``DraftWorker``'s.

Must not know: models, frameworks, the target, scheduling.
"""

from __future__ import annotations

from typing import Any, Iterator

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from draft_service.worker import DraftWorker, chains_rounds
from worker.config import WorkerConfig
from runtime.types import DraftPrefillRequest, Proposal, ProposeRequest
from core import wire
from worker.service import (Hosted, WorkerService, WorkerServicerMixin, decode_items, new_worker, result_proto,
                            start_worker_service)
from specsplit.v1 import draft_pb2 as dpb
from specsplit.v1 import draft_pb2_grpc
from worker.data_plane import UndecodableFrame

SERVICE_NAME = dpb.DESCRIPTOR.services_by_name["DraftService"].full_name   # "specsplit.v1.DraftService"


def _decode_prefill(i: int, item: dpb.DraftPrefillItem, max_bytes: int | None = None) -> DraftPrefillRequest:
    # NOTE: bf16 rows stay bf16 bit patterns (uint16) up to the device (runtime/types.py).
    hidden = wire.decode_optional_tensor(item, "hidden", f"items[{i}].hidden", wire.FLOAT_DTYPES,
                                         bf16_bits=True, max_bytes=max_bytes)
    if hidden is None:  # "no tensor": valid only with no tokens (a one-token prompt)
        hidden = np.zeros((0, 0), dtype=np.float32)
    return DraftPrefillRequest(item.request_id, wire.int64_array(item.tokens),
                               _float_or_bits(hidden), wire.params_from_proto(item.params, f"items[{i}].params"))


def _decode_propose(i: int, item: dpb.ProposeItem, max_bytes: int | None = None,
                    rows: np.ndarray | ValueError | None = None) -> ProposeRequest:
    """``rows``: the item's hidden rows out of the message's ``hidden_rows`` (``_split_rows``),
    or why they could not be had; None: the item carries its own ``hidden``."""
    if item.ahead:
        return ProposeRequest(item.request_id, int(item.start_position), np.zeros(0, dtype=np.int64),
                              np.zeros((0, 0), dtype=np.float32), int(item.k), ahead=True,
                              keep_tail=bool(item.keep_tail))
    if rows is None:
        rows = _float_or_bits(wire.decode_tensor(item.hidden, f"items[{i}].hidden", wire.FLOAT_DTYPES,
                                                 bf16_bits=True, max_bytes=max_bytes))
    elif isinstance(rows, ValueError):
        raise rows
    return ProposeRequest(item.request_id, int(item.start_position), wire.int64_array(item.tokens),
                          rows, int(item.k), keep_tail=bool(item.keep_tail))


def _split_rows(msg: dpb.ProposeRequest, max_bytes: int | None = None) -> list[np.ndarray | ValueError | None]:
    """Each item's hidden rows out of ``msg.hidden_rows`` (one tensor for the round), in item
    order: a slice of it (as many rows as the item has tokens; None for an ahead item), or the
    ValueError that item gets: the whole tensor's (every drafting item), or its own share above
    ``max_bytes`` (the limit of one item's hidden, as when each item carried its own)."""
    counts = [-1 if it.ahead else len(it.tokens) for it in msg.items]
    total = sum(n for n in counts if n > 0)
    try:
        raw = wire.decode_tensor(msg.hidden_rows, "hidden_rows", wire.FLOAT_DTYPES, bf16_bits=True)
        if raw.ndim != 2 or raw.shape[0] != total:
            raise ValueError(f"hidden_rows: shape {list(raw.shape)}, expected [{total}, hidden_size] (a row "
                             "per token of the items)")
    except ValueError as exc:
        return [None if n < 0 else exc for n in counts]
    rows, row_bytes = _float_or_bits(raw), raw.shape[1] * raw.itemsize     # bytes of one row on the wire
    out: list[np.ndarray | ValueError | None] = []
    start = 0
    for i, n in enumerate(counts):
        if n < 0:
            out.append(None)
            continue
        if max_bytes is not None and n * row_bytes > max_bytes:
            out.append(ValueError(f"items[{i}].hidden: {n * row_bytes} bytes exceed max_tensor_bytes={max_bytes}"))
        else:
            out.append(rows[start:start + n])
        start += n
    return out


def _float_or_bits(hidden: np.ndarray) -> np.ndarray:
    """uint16 (bf16 bits) as is, any float as float32."""
    return hidden if hidden.dtype == np.uint16 else wire.as_float32(hidden)


def _prefill_results(items: Any, results: list[Any]) -> list[dpb.DraftPrefillResult]:
    """Per prefill item (proto, in order) its result message: an error, or nothing (success)."""
    return [result_proto(dpb.DraftPrefillResult, it.request_id, res, lambda _: {}) for it, res in zip(items, results)]


def _fill_proposal(add: Any, request_id: str, res: Proposal | wire.ItemError) -> None:
    """One ProposeResult written in place (``add``: the response's ``results.add``): its error, or
    its proposal (drafts, and q [k, V] when the draft samples)."""
    if isinstance(res, wire.ItemError):
        add(request_id=request_id, error=wire.item_error_to_proto(res))
        return
    out = add(request_id=request_id).proposal
    out.SetInParent()                                   # present even with no drafts, as before
    out.drafts.extend(res.drafts.tolist())
    if res.draft_probs is not None:
        wire.fill_tensor(out.draft_probs, res.draft_probs, "float32")                # [k, V]


class DraftServicer(WorkerServicerMixin, draft_pb2_grpc.DraftServiceServicer):
    propose_hidden_rows = True          # reads ProposeRequest.hidden_rows (``_split_rows``); in its status

    def __init__(self, worker: DraftWorker, log: Any) -> None:
        self.worker = worker
        self.log = log
        self.max_tensor_bytes = worker.cfg.security.max_tensor_bytes

    def Prefill(self, request: dpb.DraftPrefillRequest, context: grpc.ServicerContext) -> dpb.DraftPrefillResponse:
        items = decode_items(request.items, lambda i, it: _decode_prefill(i, it, self.max_tensor_bytes))
        if request.release_request_ids:
            # NOTE: releases first: a request id that finished and joins again must find its old cache gone.
            self._run(context, "Release", lambda: self.worker.release(list(request.release_request_ids)))
        results = self._run(context, "Prefill", lambda: self.worker.prefill(items))
        return dpb.DraftPrefillResponse(results=_prefill_results(request.items, results))

    def _answer_propose(self, msg: dpb.ProposeRequest) -> dpb.ProposeResponse:
        """One Propose message -> its response: the one handling of both transports (the
        Propose stream and the data plane). Releases ride on the message and run first, then
        the joining requests' prefill (``prefill_items``), then the round's items.

        NOTE: releases before the prefill (a finished id that joins again must find its old
        cache gone) and the prefill before the items (a joiner's first Propose may follow in
        the same message). Device work runs inline on the message's thread (``DeviceThread``)."""
        if msg.release_request_ids:
            ids = list(msg.release_request_ids)
            self._round_results("release", lambda: self.worker.release(ids, inline=True), 0, msg.round)
        prefilled = self._prefill_in_message(msg) if msg.prefill_items else []
        rows = _split_rows(msg, self.max_tensor_bytes) if msg.HasField("hidden_rows") else None
        resp = self._round_answer(msg, "propose", lambda i, it: _decode_propose(
                                           i, it, self.max_tensor_bytes, None if rows is None else rows[i]),
                                       lambda items, round_: self.worker.propose(items, round_) if items else [],
                                       _fill_proposal, dpb.ProposeResponse)
        if isinstance(prefilled, wire.ItemError):
            resp.prefill_error.CopyFrom(wire.item_error_to_proto(prefilled))
        else:
            resp.prefill_results.extend(prefilled)
        return resp

    def _prefill_in_message(self, msg: dpb.ProposeRequest) -> list[dpb.DraftPrefillResult] | wire.ItemError:
        """A message's ``prefill_items`` (what the Prefill RPC does): a result per item, or the
        error of the whole prefill (e.g. no weights), said once as the RPC's status says it."""
        items = decode_items(msg.prefill_items, lambda i, it: _decode_prefill(i, it, self.max_tensor_bytes))
        try:
            return _prefill_results(msg.prefill_items, self.worker.prefill(items, inline=True))
        except Exception as exc:  # noqa: BLE001 - the whole prefill failed
            err = wire.item_error_for(exc)
            if err.code == grpc.StatusCode.INTERNAL:
                self.log.exception("prefill_failed", round=msg.round)
            return err

    def Propose(self, request_iterator: Iterator[dpb.ProposeRequest],
                context: grpc.ServicerContext) -> Iterator[dpb.ProposeResponse]:
        """One response per request message, in order; the stream ends when the client ends it."""
        return self._round_stream(request_iterator, self._answer_propose)

    def propose_frame(self, body: bytes) -> bytes:
        """The data plane's handler: a serialized ProposeRequest -> its serialized response."""
        try:
            msg = dpb.ProposeRequest.FromString(body)
        except DecodeError as exc:
            raise UndecodableFrame(f"not a ProposeRequest: {exc}") from None
        return self._answer_propose(msg).SerializeToString()


def start(cfg: WorkerConfig) -> WorkerService:
    """Build the worker (loading weights at start if ``cfg.target_path`` is set), start serving."""
    worker, log = new_worker(cfg, "draft", DraftWorker)
    servicer = DraftServicer(worker, log)
    return start_worker_service(cfg, worker, servicer, draft_pb2_grpc.add_DraftServiceServicer_to_server,
                                SERVICE_NAME, log, data_plane=servicer.propose_frame)


def colocated(target_cfg: WorkerConfig) -> Hosted:
    """The draft a ``colocated_draft`` target hosts: its worker (``WorkerConfig.colocated_draft_config``)
    and its servicer, for the target's server (``worker.service.Hosted``). Loads nothing yet."""
    cfg = target_cfg.colocated_draft_config()
    worker, log = new_worker(cfg, "draft", DraftWorker)
    worker.chain_rounds = chains_rounds(target_cfg)      # NOTE: before any LoadWeights (its engine reads it)
    return Hosted(worker, DraftServicer(worker, log), draft_pb2_grpc.add_DraftServiceServicer_to_server, SERVICE_NAME)


def create_server(cfg: WorkerConfig) -> tuple[grpc.Server, int]:
    """A started draft server and its bound port (``cfg.server.port`` 0 picks one)."""
    svc = start(cfg)
    return svc.server, svc.port
