"""The orchestrator's reload RPCs: ReloadWeights (a checkpoint the workers can read) and
PushWeights (tensors streamed to the orchestrator, staged as a checkpoint), proto <-> records.

Owns: turning a ReloadWeightsRequest / the PushWeights header into a ``ReloadSpec``,
running the reload on its own thread (a client that leaves never stops it half-way),
streaming its ``ReloadEvent``s back as messages, and the push stream's parts (header,
chunks, commit) into ``PushStaging``.

Must not know: how a reload proceeds (``orchestrator.reload``), how a push is staged
(``orchestrator.push``), tensors, frameworks. Needs ``self.core`` (the ``Orchestrator``).
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import grpc
import structlog

from orchestrator.push import PushError
from orchestrator.reload_spec import ABORT, IN_PLACE, RECAPTURE, RECOMPUTE, WAIT, ReloadError, ReloadEvent, ReloadSpec
from specsplit.v1 import common_pb2, orchestrator_pb2 as opb

log = structlog.get_logger("orchestrator")

_MODES = {opb.RELOAD_MODE_RECAPTURE: RECAPTURE, opb.RELOAD_MODE_IN_PLACE: IN_PLACE}
_POLICIES = {opb.INFLIGHT_POLICY_WAIT: WAIT, opb.INFLIGHT_POLICY_ABORT: ABORT,
             opb.INFLIGHT_POLICY_RECOMPUTE: RECOMPUTE}


class ReloadServicerMixin:
    """ReloadWeights and PushWeights; put before the generated servicer base."""

    core: Any

    def ReloadWeights(self, request: opb.ReloadWeightsRequest, context: grpc.ServicerContext):
        """Streams the reload's events as they happen; ends with the failure's status code."""
        spec = ReloadSpec(request.target_path, request.version, _enum(_MODES, opb.ReloadMode, request.mode),
                          _enum(_POLICIES, opb.InflightPolicy, request.inflight), request.draft_path, request.preload)
        events: queue.SimpleQueue = queue.SimpleQueue()
        failure: list[ReloadError] = []

        def run() -> None:
            try:
                self.core.reloader.reload(spec, events.put)
            except ReloadError as exc:
                failure.append(exc)
            except Exception as exc:  # noqa: BLE001 - reported as INTERNAL
                log.exception("reload_crashed")
                failure.append(ReloadError("INTERNAL", f"{type(exc).__name__}: {exc}"))
            finally:
                events.put(None)

        # NOTE: the reload runs on its own thread: a client that goes away mid-reload
        # must not stop it half-way (it always ends rolled forward or rolled back).
        threading.Thread(target=run, name="reload", daemon=True).start()
        while (ev := events.get()) is not None:
            yield _event_proto(ev)
        if failure:
            context.abort(grpc.StatusCode[failure[0].code], failure[0].message)

    def PushWeights(self, request_iterator, context: grpc.ServicerContext) -> opb.PushWeightsResponse:
        core = self.core
        try:
            staged = self._stage(request_iterator)
        except (PushError, ReloadError) as exc:
            log.warning("push_refused", code=exc.code, error=exc.message)
            context.abort(grpc.StatusCode[exc.code], exc.message)
        events: list[ReloadEvent] = []
        try:
            version = core.reloader.reload(ReloadSpec(staged.path, staged.version, staged.mode, staged.inflight),
                                           events.append)
        except ReloadError as exc:
            if not exc.rollback_failed:                    # never served: drop it
                core.push.discard(staged.path)
            context.abort(grpc.StatusCode[exc.code], exc.message)
        core.push.prune()
        return opb.PushWeightsResponse(weights_version=version, staged_path=staged.path,
                                       bytes_received=staged.bytes_received, num_tensors=staged.num_tensors,
                                       events=[_event_proto(ev) for ev in events])

    def _stage(self, request_iterator):
        session = self.core.push.begin()
        try:
            for msg in request_iterator:
                part = msg.WhichOneof("part")
                if part == "header":
                    h = msg.header
                    mode, policy = _enum(_MODES, opb.ReloadMode, h.mode), _enum(_POLICIES, opb.InflightPolicy,
                                                                               h.inflight)
                    ReloadSpec("<pushed>", h.version or "<unset>", mode, policy).check()
                    if self.core.reloader.active:
                        raise PushError("FAILED_PRECONDITION", "a reload is running (one at a time): retry later")
                    session.header(h.version, h.target_config_json, mode, policy)
                elif part == "chunk":
                    c = msg.chunk
                    session.chunk(c.name, c.dtype, tuple(c.shape), c.offset, c.data)
                elif part == "commit":
                    return session.commit(msg.commit.num_tensors)
                else:
                    raise PushError("INVALID_ARGUMENT", "a PushWeightsRequest with no part set")
            raise PushError("INVALID_ARGUMENT", "the stream ended without a commit message")
        except BaseException:
            session.abort()
            raise


def _enum(names: dict[int, str], enum: Any, value: int) -> str:
    """Proto enum -> the reload module's name; an unset/unknown value keeps its proto name (refused later)."""
    return names.get(value) or (enum.Name(value) if value in enum.values() else str(value))


def _event_proto(ev: ReloadEvent) -> opb.ReloadWeightsResponse:
    out = opb.ReloadWeightsResponse(phase=ev.phase, service=ev.service, seconds=ev.seconds, message=ev.message,
                                    done=ev.done, weights_version=ev.weights_version)
    if ev.error_code:
        out.error.CopyFrom(common_pb2.ItemError(code=grpc.StatusCode[ev.error_code].value[0],
                                                message=ev.error_message))
    return out
