"""TargetService over gRPC: Decode (a request through the hosted round loop), DecodeStream
(many requests over one stream), ControlRounds, Prefill and the persistent Verify stream,
and ``start``.

Owns: the target's messages only: a Decode call's events back as DecodeEvents (through
``target_service.decode_messages``; a DecodeStream is ``target_service.decode_stream``);
ControlRounds actions;
Prefill / Verify items into records and their results back. The plumbing both
workers share is ``worker.service``; the round loop is ``target_service.rounds``.

Must not know: models, frameworks, the draft's internals.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import grpc

from rounds.scheduler import GenerationRequest, QueueFull, RequestError
from worker.config import WorkerConfig
from runtime.types import PrefillRequest, PrefillResult, VerifyRequest, VerifyResult
from core import wire
from worker.service import (Hosted, WorkerService, WorkerServicerMixin, decode_items, new_worker, result_proto,
                            start_worker_service)
from specsplit.v1 import target_pb2 as tpb
from specsplit.v1 import target_pb2_grpc
from target_service.rounds import (ABORT, CONFIGURE, DRAIN, DRAIN_ABORT, DRAIN_PARK, DRAIN_WAIT, PARK, PAUSE, RESUME,
                                   RESUME_ALL, RESUME_PARKED, SETTLE, STATUS, RoundHost, RoundsState, local_draft)
from target_service.decode_messages import EventHold, decode_request
from target_service.decode_stream import EVENT_POLL_S, DecodeSession
from target_service.worker import TargetWorker

SERVICE_NAME = tpb.DESCRIPTOR.services_by_name["TargetService"].full_name   # "specsplit.v1.TargetService"


def _decode_prefill(i: int, item: tpb.TargetPrefillItem) -> PrefillRequest:
    return PrefillRequest(item.request_id, wire.int64_array(item.prompt),
                          wire.params_from_proto(item.params, f"items[{i}].params"),
                          int(item.resume_token) if item.HasField("resume_token") else None)


def _decode_verify(i: int, item: tpb.VerifyItem, max_bytes: int | None = None) -> VerifyRequest:
    probs = wire.decode_optional_tensor(item, "draft_probs", f"items[{i}].draft_probs", wire.FLOAT_DTYPES,
                                        max_bytes=max_bytes)
    return VerifyRequest(item.request_id, wire.int64_array(item.drafts),
                         wire.as_float32(probs) if probs is not None else None)


def _prefill_output(res: PrefillResult) -> dict[str, Any]:
    return {"output": tpb.PrefillOutput(first_token=res.first_token,
                                        hidden=wire.encode_tensor(res.hidden, "float32"))}   # [n, d]


def _verify_output(res: VerifyResult) -> dict[str, Any]:
    return {"output": tpb.VerifyOutput(num_accepted=res.num_accepted, tokens=list(res.tokens),
                                       hidden=wire.encode_tensor(res.hidden, "float32"))}    # [a+1, d]


_ACTIONS = {tpb.ROUNDS_ACTION_STATUS: STATUS, tpb.ROUNDS_ACTION_PAUSE_ADMISSION: PAUSE,
            tpb.ROUNDS_ACTION_RESUME_ADMISSION: RESUME, tpb.ROUNDS_ACTION_SETTLE: SETTLE,
            tpb.ROUNDS_ACTION_ABORT_RUNNING: ABORT, tpb.ROUNDS_ACTION_PARK_RUNNING: PARK,
            tpb.ROUNDS_ACTION_RESUME_PARKED: RESUME_PARKED, tpb.ROUNDS_ACTION_CONFIGURE: CONFIGURE,
            tpb.ROUNDS_ACTION_DRAIN: DRAIN, tpb.ROUNDS_ACTION_RESUME_ALL: RESUME_ALL}
_DRAIN = {tpb.DRAIN_POLICY_WAIT: DRAIN_WAIT, tpb.DRAIN_POLICY_ABORT: DRAIN_ABORT, tpb.DRAIN_POLICY_PARK: DRAIN_PARK}


def _rounds_proto(st: RoundsState) -> tpb.RoundsStatus:
    return tpb.RoundsStatus(**dataclasses.asdict(st))


class TargetServicer(WorkerServicerMixin, target_pb2_grpc.TargetServiceServicer):
    def __init__(self, worker: TargetWorker, log: Any, rounds: RoundHost) -> None:
        self.worker = worker
        self.log = log
        self.rounds = rounds
        self.max_tensor_bytes = worker.cfg.security.max_tensor_bytes

    def Decode(self, request: tpb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[tpb.DecodeEvent]:
        """One request through the round loop: a chunk per round (or per ``stream_interval``
        tokens), then the final event (a failure after the first chunk is an ``error`` event,
        so what streamed stays)."""
        greq = self._run(context, "Decode", lambda: self._check_join(request))
        try:
            handle = self.rounds.submit(greq)
        except QueueFull as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RequestError as err:
            context.abort(grpc.StatusCode[err.code], err.message)
        # NOTE: registered after submit: a caller that is already gone cancels at once,
        # and the scheduler frees the slots at its next round boundary.
        if not context.add_callback(handle.cancel):
            handle.cancel()
        hold = EventHold(request.stream_interval, request.chunk_in_final)
        while True:
            ev = handle.next_event(EVENT_POLL_S)
            if ev is None:
                if not context.is_active():
                    handle.cancel()
                    return
                continue
            msgs, done = hold.messages(ev)
            yield from msgs
            if done:
                return

    def DecodeStream(self, request_iterator: Iterator[tpb.DecodeStreamRequest],
                     context: grpc.ServicerContext) -> Iterator[tpb.DecodeStreamResponse]:
        """Many requests over one stream (``target_service.decode_stream``)."""
        session = DecodeSession(self.rounds, self._check_join, self.log, self.worker.cfg.server.max_message_bytes)
        return session.serve(request_iterator, context)

    def _check_join(self, request: tpb.DecodeRequest) -> GenerationRequest:
        self.worker.lifecycle.require_serving("Decode")
        return decode_request(request, self.worker)

    def ControlRounds(self, request: tpb.ControlRoundsRequest,
                      context: grpc.ServicerContext) -> tpb.ControlRoundsResponse:
        action = _ACTIONS.get(request.action)
        if action is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"action: {request.action} is not a known RoundsAction")
        remaining = context.time_remaining()
        timeout = min(remaining, 600.0) if remaining is not None else 600.0
        count = self._run(context, f"ControlRounds.{action}", lambda: self.rounds.control(
            action, weights_version=request.weights_version, draft_address=request.draft_address,
            max_batch=request.max_batch, max_queue=request.max_queue if request.action == tpb.ROUNDS_ACTION_CONFIGURE
            else -1, draft_timeout_s=request.draft_timeout_s, reset_streams=request.reset_streams,
            drain=_DRAIN.get(request.drain, ""), wait_timeout_s=request.wait_timeout_s, timeout=max(timeout, 0.1)))
        if action != STATUS:
            self.log.info("rounds_control", action=action, count=count)
        return tpb.ControlRoundsResponse(count=count, status=_rounds_proto(self.rounds.state()))

    def Prefill(self, request: tpb.TargetPrefillRequest,
                context: grpc.ServicerContext) -> tpb.TargetPrefillResponse:
        items = decode_items(request.items, _decode_prefill)
        results = self._run(context, "Prefill", lambda: self.worker.prefill(items))
        return tpb.TargetPrefillResponse(results=[
            result_proto(tpb.TargetPrefillResult, it.request_id, res, _prefill_output)
            for it, res in zip(request.items, results)])

    def Verify(self, request_iterator: Iterator[tpb.VerifyRequest],
               context: grpc.ServicerContext) -> Iterator[tpb.VerifyResponse]:
        """One response per request message, in order; the stream ends when the client ends it."""
        return self._round_stream(request_iterator, lambda msg: self._round_answer(
            msg, "verify", lambda i, it: _decode_verify(i, it, self.max_tensor_bytes),
            lambda items, round_: self.worker.verify(items, round_),
            lambda add, rid, res: add().CopyFrom(result_proto(tpb.VerifyResult, rid, res, _verify_output)),
            tpb.VerifyResponse))


def start(cfg: WorkerConfig, rendezvous: Any = None, draft: Hosted | None = None) -> WorkerService:
    """Build the worker (loading weights at start if ``cfg.target_path`` is set), start serving.
    With ``cfg.tp`` > 1 this process is rank 0 of a tensor-parallel group (``target_service/tp_launch.py``;
    ``rendezvous``: where torchrun's ranks meet, None: spawn the other ranks here). ``draft``: the
    draft this process hosts (``cfg.colocated_draft``; built by the caller: services do not import
    each other), served on this port and called in process by the round loop."""
    if cfg.colocated_draft != (draft is not None):
        raise ValueError(f"colocated_draft={cfg.colocated_draft}, but the target was started "
                         f"{'without' if draft is None else 'with'} a draft to host")
    if cfg.tp > 1:
        from target_service.tp_launch import leader_worker

        worker, log = new_worker(cfg, "target", leader_worker(rendezvous))
    else:
        worker, log = new_worker(cfg, "target", TargetWorker)
    local = None
    if draft is not None:
        local = local_draft(draft.worker, cfg.runtime.device)
        if local.inline and (cfg.spec.ahead_drafting or cfg.spec.micro_batches):
            # Exact either way; on one device there is nothing for them to overlap (§ Session 26).
            log.warning("colocated_draft_nothing_to_overlap", device=cfg.runtime.device,
                        ahead_drafting=cfg.spec.ahead_drafting, micro_batches=cfg.spec.micro_batches,
                        detail="with the draft on the target's device these cost time: turn them off, or put "
                               "the draft on a device of its own (draft_device)")
    rounds = RoundHost(worker, cfg, local_draft=local)
    # NOTE: every Decode call (and every DecodeStream) holds a handler thread for its whole
    # life: the orchestrator keeps one DecodeStream, but callers of Decode hold one per
    # request (the running batch plus the waiting queue), so the pool is sized for that.
    cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, max_workers=max(cfg.server.max_workers,
                                                                                        256)))
    svc = start_worker_service(cfg, worker, TargetServicer(worker, log, rounds),
                               target_pb2_grpc.add_TargetServiceServicer_to_server, SERVICE_NAME, log, hosted=draft)
    # NOTE: the round loop stops before the worker tears down (its requests end with
    # UNAVAILABLE and their slots are released while the weights are still there).
    svc.before_close.append(rounds.close)
    return svc


def create_server(cfg: WorkerConfig) -> tuple[grpc.Server, int]:
    """A started target server and its bound port (``cfg.server.port`` 0 picks one)."""
    svc = start(cfg)
    return svc.server, svc.port
