"""DraftService over gRPC: Prefill and the persistent Propose stream, the same Propose over the
data plane, and ``start``.

Owns: the draft's messages only: decoding Prefill / Propose items into
``runtime.types`` records (hidden rows stay bf16 bits when sent as bf16),
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

from draft_service.worker import DraftWorker
from worker.config import WorkerConfig
from runtime.types import DraftPrefillRequest, Proposal, ProposeRequest
from core import wire
from worker.service import (WorkerService, WorkerServicerMixin, decode_items, new_worker, result_proto,
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


def _decode_propose(i: int, item: dpb.ProposeItem, max_bytes: int | None = None) -> ProposeRequest:
    if item.ahead:
        return ProposeRequest(item.request_id, int(item.start_position), np.zeros(0, dtype=np.int64),
                              np.zeros((0, 0), dtype=np.float32), int(item.k), ahead=True,
                              keep_tail=bool(item.keep_tail))
    hidden = wire.decode_tensor(item.hidden, f"items[{i}].hidden", wire.FLOAT_DTYPES, bf16_bits=True,
                                max_bytes=max_bytes)
    return ProposeRequest(item.request_id, int(item.start_position), wire.int64_array(item.tokens),
                          _float_or_bits(hidden), int(item.k), keep_tail=bool(item.keep_tail))


def _float_or_bits(hidden: np.ndarray) -> np.ndarray:
    """uint16 (bf16 bits) as is, any float as float32."""
    return hidden if hidden.dtype == np.uint16 else wire.as_float32(hidden)


def _prefill_results(items: Any, results: list[Any]) -> list[dpb.DraftPrefillResult]:
    """Per prefill item (proto, in order) its result message: an error, or nothing (success)."""
    return [result_proto(dpb.DraftPrefillResult, it.request_id, res, lambda _: {}) for it, res in zip(items, results)]


def _proposal(res: Proposal) -> dict[str, Any]:
    out = dpb.Proposal(drafts=res.drafts.tolist())
    if res.draft_probs is not None:
        out.draft_probs.CopyFrom(wire.encode_tensor(res.draft_probs, "float32"))   # [k, V]
    return {"proposal": out}


class DraftServicer(WorkerServicerMixin, draft_pb2_grpc.DraftServiceServicer):
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
        resp = self._round_answer(msg, "propose", lambda i, it: _decode_propose(i, it, self.max_tensor_bytes),
                                  lambda items, round_: self.worker.propose(items, round_) if items else [],
                                  lambda rid, res: result_proto(dpb.ProposeResult, rid, res, _proposal),
                                  dpb.ProposeResponse)
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


def create_server(cfg: WorkerConfig) -> tuple[grpc.Server, int]:
    """A started draft server and its bound port (``cfg.server.port`` 0 picks one)."""
    svc = start(cfg)
    return svc.server, svc.port
