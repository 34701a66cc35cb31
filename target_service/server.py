"""TargetService over gRPC: Decode (a request through the hosted round loop), ControlRounds,
Prefill and the persistent Verify stream, and ``start``.

Owns: the target's messages only: a DecodeRequest checked into a
``GenerationRequest`` and its events back as DecodeEvents (chunks held for the
caller's ``stream_interval``, the last ones riding on the final event with
``chunk_in_final``); ControlRounds actions;
Prefill / Verify items into records and their results back. The plumbing both
workers share is ``worker.service``; the round loop is ``target_service.rounds``.

Must not know: models, frameworks, the draft's internals.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import grpc
import numpy as np

from rounds.scheduler import (ErrorEvent, FinalEvent, GenerationRequest, QueueFull, RequestError, SeqStats,
                                    TokensEvent)
from worker.config import WorkerConfig
from runtime.types import PrefillRequest, PrefillResult, VerifyRequest, VerifyResult
from runtime.request_checks import check_request_id, check_token_range
from core import wire
from worker.service import (WorkerService, WorkerServicerMixin, decode_items, new_worker, result_proto,
                            start_worker_service)
from specsplit.v1 import common_pb2
from specsplit.v1 import target_pb2 as tpb
from specsplit.v1 import target_pb2_grpc
from target_service.rounds import (ABORT, CONFIGURE, DRAIN, DRAIN_ABORT, DRAIN_PARK, DRAIN_WAIT, PARK, PAUSE, RESUME,
                                   RESUME_ALL, RESUME_PARKED, SETTLE, STATUS, RoundHost, RoundsState)
from target_service.worker import TargetWorker

SERVICE_NAME = tpb.DESCRIPTOR.services_by_name["TargetService"].full_name   # "specsplit.v1.TargetService"


def _decode_prefill(i: int, item: tpb.TargetPrefillItem) -> PrefillRequest:
    return PrefillRequest(item.request_id, np.asarray(item.prompt, dtype=np.int64),
                          wire.params_from_proto(item.params, f"items[{i}].params"),
                          int(item.resume_token) if item.HasField("resume_token") else None)


def _decode_verify(i: int, item: tpb.VerifyItem, max_bytes: int | None = None) -> VerifyRequest:
    probs = wire.decode_optional_tensor(item, "draft_probs", f"items[{i}].draft_probs", wire.FLOAT_DTYPES,
                                        max_bytes=max_bytes)
    return VerifyRequest(item.request_id, np.asarray(item.drafts, dtype=np.int64),
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
EVENT_POLL_S = 0.25                # how often a Decode handler checks that its caller is still there


def decode_request(req: tpb.DecodeRequest, worker: TargetWorker) -> GenerationRequest:
    """DecodeRequest -> GenerationRequest; ValueError naming the bad field."""
    check_request_id(req.request_id, "request_id")
    mc = worker.model_cfg
    vocab = mc.vocab_size if mc is not None else 0
    prompt = np.asarray(req.prompt, dtype=np.int64)
    if prompt.size == 0:
        raise ValueError("prompt: must hold at least one token (empty)")
    if mc is not None:
        check_token_range(prompt, vocab, "prompt")
        check_token_range(np.asarray(req.stop_token_ids, dtype=np.int64), vocab, "stop_token_ids")
        if mc.max_position_embeddings and prompt.size > mc.max_position_embeddings:
            raise ValueError(f"prompt: a prompt of {prompt.size} tokens exceeds the model's max_position_embeddings="
                             f"{mc.max_position_embeddings}")
    if req.max_tokens < 1:
        raise ValueError(f"max_tokens: {req.max_tokens} must be >= 1")
    max_k = worker.cfg.spec.max_k
    if not 0 <= req.k <= max_k:
        raise ValueError(f"k: {req.k} is out of range [0, {max_k}]")
    if req.stream_interval < 0:
        raise ValueError(f"stream_interval: {req.stream_interval} must be >= 0 (0 or 1: every round)")
    resume = np.asarray(req.resume_output, dtype=np.int64)
    if mc is not None:
        check_token_range(resume, vocab, "resume_output")
    if resume.size >= req.max_tokens:
        raise ValueError(f"resume_output: {resume.size} tokens leave nothing to generate (max_tokens={req.max_tokens})")
    params = dataclasses.replace(wire.params_from_proto(req.params, "params"), max_tokens=int(req.max_tokens),
                                 stop_token_ids=tuple(int(t) for t in req.stop_token_ids),
                                 ignore_eos=bool(req.ignore_eos))
    return GenerationRequest(req.request_id, tuple(int(t) for t in prompt), params, int(req.k),
                             tuple(int(t) for t in resume))


def stats_to_proto(s: SeqStats) -> tpb.DecodeStats:
    return tpb.DecodeStats(drafted=s.drafted, accepted=s.accepted, rounds=s.rounds, spec_rounds=s.spec_rounds,
                           emitted_in_rounds=s.emitted_in_rounds, position_drafted=s.pos_drafted,
                           position_accepted=s.pos_accepted, ahead_asked=s.ahead_asked,
                           ahead_used=s.ahead_used)


def _chunk_proto(ev: TokensEvent) -> tpb.DecodeChunk:
    chunk = tpb.DecodeChunk(tokens=ev.tokens, round=ev.round, num_accepted=ev.num_accepted,
                            num_drafted=ev.num_drafted, weights_version=ev.weights_version)
    t = ev.timing
    if t is not None:
        chunk.timing.CopyFrom(tpb.RoundTiming(round=t.round, batch=t.batch, draft_seconds=t.draft_s,
                                              target_seconds=t.target_s, overhead_seconds=t.overhead_s,
                                              total_seconds=t.wall_s))
    return chunk


def _chunks_proto(held: list[TokensEvent]) -> tpb.DecodeEvent:
    """Held chunks in one message: a plain chunk when there is one."""
    if len(held) == 1:
        return tpb.DecodeEvent(chunk=_chunk_proto(held[0]))
    return tpb.DecodeEvent(chunks=tpb.DecodeChunks(chunks=[_chunk_proto(e) for e in held]))


def _event_proto(ev: Any, last_chunks: list[TokensEvent] = ()) -> tpb.DecodeEvent:
    """One event as sent; ``last_chunks``: chunks riding on a final event (chunk_in_final)."""
    if isinstance(ev, TokensEvent):
        return tpb.DecodeEvent(chunk=_chunk_proto(ev))
    if isinstance(ev, FinalEvent):
        final = tpb.DecodeFinal(finish_reason=ev.finish_reason, output=ev.output, prompt_tokens=ev.prompt_tokens,
                                stats=stats_to_proto(ev.stats), weights_version=ev.weights_version)
        final.last_chunks.extend(_chunk_proto(e) for e in last_chunks)
        return tpb.DecodeEvent(final=final)
    return tpb.DecodeEvent(error=tpb.DecodeError(
        error=common_pb2.ItemError(code=grpc.StatusCode[ev.code].value[0], message=ev.message), streamed=ev.output))


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
        def check() -> GenerationRequest:
            self.worker.lifecycle.require_serving("Decode")
            return decode_request(request, self.worker)
        greq = self._run(context, "Decode", check)
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
        interval = max(int(request.stream_interval), 1)
        held: list[TokensEvent] = []             # chunks not sent yet, oldest first
        n_held = 0                               # their tokens
        while True:
            ev = handle.next_event(EVENT_POLL_S)
            if ev is None:
                if not context.is_active():
                    handle.cancel()
                    return
                continue
            # NOTE: chunks are held until stream_interval tokens are (the prefill's go at
            # once: the time to the first token); with chunk_in_final the round a request
            # finishes in is held for its final event, which follows within the round's end
            # (the releases), and they all ride on it. Anything but a final event sends what
            # is held on its own first, in order.
            if isinstance(ev, TokensEvent):
                if held and held[-1].weights_version != ev.weights_version:
                    yield _chunks_proto(held)        # NOTE: one message never spans a weight swap
                    held, n_held = [], 0
                held.append(ev)
                n_held += len(ev.tokens)
                if ev.last and request.chunk_in_final:
                    continue
                if ev.timing is None or n_held >= interval:
                    yield _chunks_proto(held)
                    held, n_held = [], 0
                continue
            if isinstance(ev, FinalEvent) and request.chunk_in_final:
                yield _event_proto(ev, held)
                return
            if held:
                yield _chunks_proto(held)
            yield _event_proto(ev)
            return

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
            lambda rid, res: result_proto(tpb.VerifyResult, rid, res, _verify_output), tpb.VerifyResponse))


def start(cfg: WorkerConfig, rendezvous: Any = None) -> WorkerService:
    """Build the worker (loading weights at start if ``cfg.target_path`` is set), start serving.
    With ``cfg.tp`` > 1 this process is rank 0 of a tensor-parallel group (``target_service/tp_launch.py``;
    ``rendezvous``: where torchrun's ranks meet, None: spawn the other ranks here)."""
    if cfg.tp > 1:
        from target_service.tp_launch import leader_worker

        worker, log = new_worker(cfg, "target", leader_worker(rendezvous))
    else:
        worker, log = new_worker(cfg, "target", TargetWorker)
    rounds = RoundHost(worker, cfg)
    # NOTE: every Decode call holds a handler thread for its whole life (the running
    # batch plus the waiting queue), so the pool is sized for that, not for cfg alone.
    cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, max_workers=max(cfg.server.max_workers,
                                                                                        256)))
    svc = start_worker_service(cfg, worker, TargetServicer(worker, log, rounds),
                               target_pb2_grpc.add_TargetServiceServicer_to_server, SERVICE_NAME, log)
    # NOTE: the round loop stops before the worker tears down (its requests end with
    # UNAVAILABLE and their slots are released while the weights are still there).
    svc.before_close.append(rounds.close)
    return svc


def create_server(cfg: WorkerConfig) -> tuple[grpc.Server, int]:
    """A started target server and its bound port (``cfg.server.port`` 0 picks one)."""
    svc = start(cfg)
    return svc.server, svc.port
