"""Async (``grpc.aio``) Python client of the orchestrator: ``SpecsplitClient``'s surface, awaitable.

Owns: one ``grpc.aio`` channel to an orchestrator and the same calls as the
blocking client — ``generate`` (async iterator of ``GenerateEvent``),
``generate_text``, ``status``, ``reload_events`` / ``reload``,
``push_weights`` — with a deadline on every call and gRPC errors raised as
``SpecsplitError`` / ``ReloadFailed``. ``with_token`` gives a view of the
same channel that presents another bearer token (the HTTP API forwards each
caller's token this way).

Must not know: the orchestrator's internals, models, frameworks. Request
building and the event records are the blocking client's (``client.py``).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, AsyncIterator, Iterable, Mapping, Sequence

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict

from orchestrator.client import (_FINISH_NAMES, _MODES, _POLICIES, PUSH_CHUNK_BYTES, GenerateEvent, GenerationResult,
                                 PushResult, ReloadEvent, ReloadFailed, SpecsplitClient, SpecsplitError, _choice,
                                 _event, _wire_bytes)
from specsplit.v1 import common_pb2, orchestrator_pb2 as opb, orchestrator_pb2_grpc


def _error(exc: grpc.aio.AioRpcError) -> SpecsplitError:
    return SpecsplitError(exc.code(), exc.details() or "")


class AsyncSpecsplitClient:
    """``async with AsyncSpecsplitClient("127.0.0.1:50051") as c: print((await c.generate_text("hi")).text)``

    Create it inside the event loop that uses it (a ``grpc.aio`` channel belongs to one loop).
    """

    def __init__(self, address: str, timeout: float = 60.0, tls_ca: str | None = None, token: str | None = None,
                 max_message_bytes: int = 64 * 1024 * 1024, tls_cert: str | None = None,
                 tls_key: str | None = None) -> None:
        """TLS when ``tls_ca`` is set; ``tls_cert``/``tls_key``: the client certificate (mutual TLS)."""
        self.address, self.timeout = address, timeout
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)]
        if tls_ca:
            creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes(),
                                                 private_key=Path(tls_key).read_bytes() if tls_key else None,
                                                 certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None)
            self._channel = grpc.aio.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        self._stub = orchestrator_pb2_grpc.OrchestratorStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._owner = True

    def with_token(self, token: str | None) -> "AsyncSpecsplitClient":
        """The same channel presenting ``token`` (None: none). Closing the view leaves the channel open."""
        view = object.__new__(AsyncSpecsplitClient)
        view.address, view.timeout, view._channel, view._stub = self.address, self.timeout, self._channel, self._stub
        view._metadata = (("authorization", f"Bearer {token}"),) if token else None
        view._owner = False
        return view

    # --- generation -------------------------------------------------------------------
    build_request = staticmethod(SpecsplitClient.build_request)

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 64, *, timeout: float | None = None,
                 **kw: Any) -> AsyncIterator[GenerateEvent]:
        """Stream a generation: chunk events, then one final event (``async for ev in c.generate(...)``).
        Leaving the loop early (or ``aclose()``) cancels the call, which frees its slots on the
        workers. Keywords as ``SpecsplitClient.generate``."""
        return self.stream(self.build_request(prompt, max_tokens, **kw), timeout=timeout)

    async def stream(self, request: opb.GenerateRequest, timeout: float | None = None) -> AsyncIterator[GenerateEvent]:
        call = self._stub.Generate(request, timeout=timeout or self.timeout, metadata=self._metadata)
        tokens: list[int] = []
        try:
            async for resp in call:
                if resp.HasField("chunk"):
                    c = resp.chunk
                    tokens.extend(c.token_ids)
                    yield GenerateEvent(False, tuple(c.token_ids), c.text, c.round, c.num_accepted, c.num_drafted,
                                        c.weights_version)
                else:
                    f, s = resp.final, resp.final.stats
                    yield GenerateEvent(
                        True, tuple(tokens), f.text, weights_version=f.weights_version, request_id=f.request_id,
                        finish_reason=_FINISH_NAMES.get(f.finish_reason, "unspecified"),
                        prompt_tokens=f.usage.prompt_tokens, completion_tokens=f.usage.completion_tokens,
                        drafted=s.drafted, accepted=s.accepted, acceptance_rate=s.acceptance_rate,
                        mean_accepted_length=s.mean_accepted_length,
                        acceptance_per_position=tuple(s.acceptance_per_position), rounds=s.rounds)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()                      # no-op once the stream has ended

    async def generate_text(self, prompt: str | Sequence[int], max_tokens: int = 64, *,
                            timeout: float | None = None, **kw: Any) -> GenerationResult:
        """Run a generation to the end and return its tokens, text and statistics."""
        chunks = 0
        events = self.generate(prompt, max_tokens, timeout=timeout, **kw)
        try:
            async for ev in events:
                if not ev.final:
                    chunks += 1
                    continue
                return GenerationResult(ev.tokens, ev.text, ev.finish_reason or "unspecified", ev.acceptance_rate,
                                        ev.mean_accepted_length, ev.acceptance_per_position,
                                        {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens},
                                        ev.drafted, ev.accepted, ev.rounds, chunks, ev.request_id, ev.weights_version)
        finally:
            await events.aclose()
        raise SpecsplitError(grpc.StatusCode.INTERNAL, "the stream ended without a final message")

    # --- status -----------------------------------------------------------------------
    async def status_proto(self, timeout: float | None = None) -> opb.ClusterStatus:
        try:
            return await self._stub.GetStatus(common_pb2.GetStatusRequest(), timeout=timeout or self.timeout,
                                              metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    async def status(self, timeout: float | None = None) -> dict[str, Any]:
        """As ``SpecsplitClient.status``: {"orchestrator": {...}, "target": {...}, "draft": {...}, "*_error": str}."""
        msg = await self.status_proto(timeout)
        out: dict[str, Any] = {"target_error": msg.target_error, "draft_error": msg.draft_error}
        for name in ("orchestrator", "target", "draft"):
            if msg.HasField(name):
                out[name] = MessageToDict(getattr(msg, name), preserving_proto_field_name=True,
                                          always_print_fields_with_no_presence=True)
        return out

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        """The grpc.health.v1 status name of ``service`` ("" = the server): SERVING, NOT_SERVING, ..."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            resp = await health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout or self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    # --- weight reload (admin: the client's token must be the orchestrator's admin token) ----
    async def reload_events(self, target_path: str, version: str, *, draft_path: str = "", mode: str = "recapture",
                            inflight: str = "wait", preload: bool = False,
                            timeout: float | None = None) -> AsyncIterator[ReloadEvent]:
        """Stream a reload's progress events; a failed reload raises ReloadFailed (with the events) at the end."""
        req = opb.ReloadWeightsRequest(target_path=target_path, draft_path=draft_path, version=version,
                                       mode=_choice(_MODES, mode, "mode"),
                                       inflight=_choice(_POLICIES, inflight, "inflight"), preload=preload)
        call = self._stub.ReloadWeights(req, timeout=timeout or self.timeout, metadata=self._metadata)
        seen: list[ReloadEvent] = []
        try:
            async for m in call:
                seen.append(_event(m))
                yield seen[-1]
        except grpc.aio.AioRpcError as exc:
            raise ReloadFailed(exc.code(), exc.details() or "", tuple(seen)) from None

    async def reload(self, target_path: str, version: str, **kw: Any) -> tuple[ReloadEvent, ...]:
        """Run a reload to the end; returns its events (the last has done=True). Raises ReloadFailed."""
        return tuple([ev async for ev in self.reload_events(target_path, version, **kw)])

    async def push_weights(self, tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
                           target_config: Mapping[str, Any] | str, version: str, *, mode: str = "recapture",
                           inflight: str = "wait", bfloat16: bool = False, chunk_bytes: int = PUSH_CHUNK_BYTES,
                           timeout: float | None = None) -> PushResult:
        """As ``SpecsplitClient.push_weights``: named tensors (target + "mtp." names) and the target's
        config.json, sent lazily in chunks, staged and applied as a reload. Raises ReloadFailed."""
        config_json = target_config if isinstance(target_config, str) else json.dumps(dict(target_config))
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        header = opb.PushWeightsHeader(version=version, target_config_json=config_json,
                                       mode=_choice(_MODES, mode, "mode"),
                                       inflight=_choice(_POLICIES, inflight, "inflight"))

        async def messages() -> AsyncIterator[opb.PushWeightsRequest]:
            yield opb.PushWeightsRequest(header=header)
            n = 0
            for name, arr in items:
                dtype, data = _wire_bytes(np.asarray(arr), bfloat16)
                shape = list(np.shape(arr))
                for off in range(0, max(len(data), 1), chunk_bytes):
                    yield opb.PushWeightsRequest(chunk=opb.TensorChunk(name=name, dtype=dtype, shape=shape,
                                                                       offset=off, data=data[off:off + chunk_bytes]))
                n += 1
            yield opb.PushWeightsRequest(commit=opb.PushWeightsCommit(num_tensors=n))

        try:
            resp = await self._stub.PushWeights(messages(), timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise ReloadFailed(exc.code(), exc.details() or "", ()) from None
        return PushResult(resp.weights_version, resp.staged_path, resp.bytes_received, resp.num_tensors,
                          tuple(_event(m) for m in resp.events))

    # --- lifetime ---------------------------------------------------------------------
    async def wait_ready(self, timeout: float | None = None) -> "AsyncSpecsplitClient":
        """Connect now (a channel otherwise connects on its first call); SpecsplitError
        UNAVAILABLE when the orchestrator cannot be reached within ``timeout``."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout or self.timeout)
        except asyncio.TimeoutError:
            raise SpecsplitError(grpc.StatusCode.UNAVAILABLE, "the orchestrator could not be reached "
                                 f"within {timeout or self.timeout:g}s") from None
        return self

    async def close(self) -> None:
        if self._owner:
            await self._channel.close()

    async def __aenter__(self) -> "AsyncSpecsplitClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
