"""A Decode request's messages: DecodeRequest -> ``GenerationRequest``, the round loop's events ->
DecodeEvents, and the per-request hold that batches chunks for ``stream_interval`` and
``chunk_in_final``. Both ways of decoding share them: one ``Decode`` call per request and
the many-request ``DecodeStream`` (``target_service.decode_stream``).

Owns: the field checks of a DecodeRequest, the DecodeEvent shapes, the hold's rule (which
chunks go now, which wait, which ride on the final event).

Must not know: gRPC calls and threads, the scheduler's internals, models.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import grpc
import numpy as np

from rounds.scheduler import ErrorEvent, FinalEvent, GenerationRequest, SeqStats, TokensEvent
from runtime.request_checks import check_request_id, check_token_range
from core import wire
from specsplit.v1 import target_pb2 as tpb
from target_service.worker import TargetWorker


def decode_request(req: tpb.DecodeRequest, worker: TargetWorker) -> GenerationRequest:
    """DecodeRequest -> GenerationRequest; ValueError naming the bad field."""
    check_request_id(req.request_id, "request_id")
    mc = worker.model_cfg
    vocab = mc.vocab_size if mc is not None else 0
    prompt = wire.int64_array(req.prompt)
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
                             tuple(int(t) for t in resume), fixed_k=req.fixed_k)


def stats_to_proto(s: SeqStats) -> tpb.DecodeStats:
    return tpb.DecodeStats(drafted=s.drafted, accepted=s.accepted, rounds=s.rounds, spec_rounds=s.spec_rounds,
                           emitted_in_rounds=s.emitted_in_rounds, position_drafted=s.pos_drafted,
                           position_accepted=s.pos_accepted, ahead_asked=s.ahead_asked,
                           ahead_used=s.ahead_used, watch_probes=s.watch_probes)


# NOTE: messages are filled in place (the destination is a field of the message being built):
# a separate message per chunk copied into its parent cost the DecodeStream writer ~2.5x as
# much per round at batch 8, on the thread that shares the GIL with the round loop.
def _fill_chunk(c: tpb.DecodeChunk, ev: TokensEvent) -> tpb.DecodeChunk:
    c.tokens.extend(ev.tokens)
    c.round, c.num_accepted, c.num_drafted, c.weights_version = ev.round, ev.num_accepted, ev.num_drafted, \
        ev.weights_version
    t = ev.timing
    if t is not None:
        ct = c.timing
        ct.round, ct.batch, ct.draft_seconds, ct.target_seconds = t.round, t.batch, t.draft_s, t.target_s
        ct.overhead_seconds, ct.total_seconds = t.overhead_s, t.wall_s
    return c


def _fill_chunks(dst: tpb.DecodeEvent, held: list[TokensEvent]) -> None:
    """Held chunks in one message: a plain chunk when there is one."""
    if len(held) == 1:
        _fill_chunk(dst.chunk, held[0])
        return
    for e in held:
        _fill_chunk(dst.chunks.chunks.add(), e)


def _fill_event(dst: tpb.DecodeEvent, ev: Any, last_chunks: list[TokensEvent] = ()) -> None:
    """One event as sent; ``last_chunks``: chunks riding on a final event (chunk_in_final)."""
    if isinstance(ev, TokensEvent):
        _fill_chunk(dst.chunk, ev)
    elif isinstance(ev, FinalEvent):
        f = dst.final
        f.finish_reason, f.prompt_tokens, f.weights_version = ev.finish_reason, ev.prompt_tokens, ev.weights_version
        f.output.extend(ev.output)
        f.stats.CopyFrom(stats_to_proto(ev.stats))
        for e in last_chunks:
            _fill_chunk(f.last_chunks.add(), e)
    else:
        err = dst.error
        err.error.code, err.error.message = grpc.StatusCode[ev.code].value[0], ev.message
        err.streamed.extend(ev.output)


def _event_proto(ev: Any, last_chunks: list[TokensEvent] = ()) -> tpb.DecodeEvent:
    dst = tpb.DecodeEvent()
    _fill_event(dst, ev, last_chunks)
    return dst


def error_event_proto(code: str, message: str, streamed: tuple[int, ...] = ()) -> tpb.DecodeEvent:
    return _event_proto(ErrorEvent(code, message, streamed))


class EventHold:
    """One request's events as the messages to send, in order.

    Chunks are held until ``interval`` tokens are (the prefill's go at once: the time to the
    first token); with ``chunk_in_final`` the round a request finishes in is held for its
    final event, which follows within the round's end (the releases), and they all ride on
    it. Anything but a final event sends what is held on its own first, in order."""

    def __init__(self, interval: int, chunk_in_final: bool) -> None:
        self.interval, self.chunk_in_final = max(int(interval), 1), bool(chunk_in_final)
        self._held: list[TokensEvent] = []       # chunks not sent yet, oldest first
        self._n_held = 0                         # their tokens

    def feed(self, ev: Any, new: Callable[[], tpb.DecodeEvent]) -> bool:
        """Write the messages to send now into ``new()`` (an empty DecodeEvent each, in order);
        returns whether ``ev`` ended the request."""
        if isinstance(ev, TokensEvent):
            if self._held and self._held[-1].weights_version != ev.weights_version:
                self._take(new())                    # NOTE: one message never spans a weight swap
            self._held.append(ev)
            self._n_held += len(ev.tokens)
            if not (ev.last and self.chunk_in_final) and (ev.timing is None or self._n_held >= self.interval):
                self._take(new())
            return False
        if isinstance(ev, FinalEvent) and self.chunk_in_final:
            held, self._held, self._n_held = self._held, [], 0
            _fill_event(new(), ev, held)
            return True
        if self._held:
            self._take(new())
        _fill_event(new(), ev)
        return True

    def messages(self, ev: Any) -> tuple[list[tpb.DecodeEvent], bool]:
        """``feed`` into fresh messages: (messages to send now, whether ``ev`` ended the request)."""
        out: list[tpb.DecodeEvent] = []

        def new() -> tpb.DecodeEvent:
            out.append(tpb.DecodeEvent())
            return out[-1]
        done = self.feed(ev, new)
        return out, done

    def _take(self, dst: tpb.DecodeEvent) -> None:
        held, self._held, self._n_held = self._held, [], 0
        _fill_chunks(dst, held)
