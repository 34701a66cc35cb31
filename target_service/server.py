"""The target service's gRPC servicer and ``create_server``.

Owns: proto <-> record conversion for TargetService (via ``specsplit.wire``),
the persistent Verify stream (one batched response per batched request,
per-item errors, the stream survives bad items and failed batches), and
assembling worker + servicer + health + metrics into a started server.

Must not know: tensors beyond decoding them into numpy records, models,
frameworks. All work happens in ``TargetWorker``; lifecycle / status / release
RPCs come from ``specsplit.serving.WorkerServicerMixin``.
"""

from __future__ import annotations

from typing import Any, Iterator

import grpc
import numpy as np
import structlog

from runtime.config import WorkerConfig
from runtime.observability import redact
from runtime.types import PrefillRequest, PrefillResult, VerifyRequest, VerifyResult
from specsplit import wire
from specsplit.serving import WorkerService, WorkerServicerMixin, start_worker_service
from specsplit.v1 import target_pb2 as tpb
from specsplit.v1 import target_pb2_grpc
from target_service.worker import TargetWorker

SERVICE_NAME = tpb.DESCRIPTOR.services_by_name["TargetService"].full_name   # "specsplit.v1.TargetService"


def _decode_prefill(i: int, item: tpb.TargetPrefillItem) -> PrefillRequest | wire.ItemError:
    try:
        return PrefillRequest(item.request_id, np.asarray(item.prompt, dtype=np.int64),
                              wire.params_from_proto(item.params, f"items[{i}].params"),
                              int(item.resume_token) if item.HasField("resume_token") else None)
    except Exception as exc:  # noqa: BLE001 - a bad item must never end the call
        return wire.item_error_for(exc)


def _decode_verify(i: int, item: tpb.VerifyItem, max_bytes: int | None = None) -> VerifyRequest | wire.ItemError:
    try:
        probs = wire.decode_optional_tensor(item, "draft_probs", f"items[{i}].draft_probs", wire.FLOAT_DTYPES,
                                            max_bytes=max_bytes)
        return VerifyRequest(item.request_id, np.asarray(item.drafts, dtype=np.int64),
                             wire.as_float32(probs) if probs is not None else None)
    except Exception as exc:  # noqa: BLE001 - a bad item must never end the call
        return wire.item_error_for(exc)


def _prefill_result(request_id: str, res: PrefillResult | wire.ItemError) -> tpb.TargetPrefillResult:
    if isinstance(res, wire.ItemError):
        return tpb.TargetPrefillResult(request_id=request_id, error=wire.item_error_to_proto(res))
    return tpb.TargetPrefillResult(request_id=request_id, output=tpb.PrefillOutput(
        first_token=res.first_token, hidden=wire.encode_tensor(res.hidden, "float32")))   # [n, d]


def _verify_result(request_id: str, res: VerifyResult | wire.ItemError) -> tpb.VerifyResult:
    if isinstance(res, wire.ItemError):
        return tpb.VerifyResult(request_id=request_id, error=wire.item_error_to_proto(res))
    return tpb.VerifyResult(request_id=request_id, output=tpb.VerifyOutput(
        num_accepted=res.num_accepted, tokens=list(res.tokens),
        hidden=wire.encode_tensor(res.hidden, "float32")))                               # [a+1, d]


class TargetServicer(WorkerServicerMixin, target_pb2_grpc.TargetServiceServicer):
    def __init__(self, worker: TargetWorker, log: Any) -> None:
        self.worker = worker
        self.log = log
        self.max_tensor_bytes = worker.cfg.security.max_tensor_bytes

    def Prefill(self, request: tpb.TargetPrefillRequest,
                context: grpc.ServicerContext) -> tpb.TargetPrefillResponse:
        items = [_decode_prefill(i, it) for i, it in enumerate(request.items)]
        results = self._run(context, "Prefill", lambda: self.worker.prefill(items))
        return tpb.TargetPrefillResponse(results=[
            _prefill_result(it.request_id, res) for it, res in zip(request.items, results)])

    def Verify(self, request_iterator: Iterator[tpb.VerifyRequest],
               context: grpc.ServicerContext) -> Iterator[tpb.VerifyResponse]:
        """One response per request message, in order; the stream ends when the client ends it."""
        for msg in request_iterator:
            items = [_decode_verify(i, it, self.max_tensor_bytes) for i, it in enumerate(msg.items)]
            results, seconds = self._round_results("verify", lambda: self.worker.verify(items, msg.round),
                                                   len(items), msg.round)
            yield tpb.VerifyResponse(round=msg.round, compute_seconds=seconds, results=[
                _verify_result(it.request_id, res) for it, res in zip(msg.items, results)])


def start(cfg: WorkerConfig) -> WorkerService:
    """Build the worker (loading weights at start if ``cfg.target_path`` is set), start serving."""
    if cfg.role != "target":
        raise ValueError(f"role={cfg.role!r}: the target service needs role 'target'")
    log = structlog.get_logger(service="target")
    log.info("starting", config=redact(cfg))
    worker = TargetWorker(cfg, log=log)
    return start_worker_service(cfg, worker, TargetServicer(worker, log),
                                target_pb2_grpc.add_TargetServiceServicer_to_server, SERVICE_NAME, log)


def create_server(cfg: WorkerConfig) -> tuple[grpc.Server, int]:
    """A started target server and its bound port (``cfg.server.port`` 0 picks one)."""
    svc = start(cfg)
    return svc.server, svc.port
