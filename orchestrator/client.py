"""Typed Python client of the orchestrator, for programs (the CLI uses it too).

Owns: the channel to one orchestrator, request building from keyword
arguments, turning the Generate stream into ``GenerateEvent``s and a whole
generation into a ``GenerationResult``, the cluster status as a dict, weight
reloads (``reload``: progress events; ``push_weights``: numpy tensors sent in
chunks), and a deadline on every call. gRPC errors surface as ``SpecsplitError`` with the
status code and the server's message.

Must not know: the orchestrator's internals, models, frameworks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict

from core.bf16 import float32_to_bf16_bits
from specsplit.v1 import common_pb2, orchestrator_pb2 as opb, orchestrator_pb2_grpc

_FINISH_NAMES = {opb.FINISH_REASON_STOP: "stop", opb.FINISH_REASON_LENGTH: "length",
                 opb.FINISH_REASON_ABORTED: "aborted"}
_MODES = {"recapture": opb.RELOAD_MODE_RECAPTURE, "in_place": opb.RELOAD_MODE_IN_PLACE,
          "in-place": opb.RELOAD_MODE_IN_PLACE}
_POLICIES = {"wait": opb.INFLIGHT_POLICY_WAIT, "abort": opb.INFLIGHT_POLICY_ABORT,
             "recompute": opb.INFLIGHT_POLICY_RECOMPUTE}
_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}
PUSH_CHUNK_BYTES = 4 * 1024 * 1024


class SpecsplitError(RuntimeError):
    """A call failed; ``code`` is the grpc.StatusCode, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


@dataclass(frozen=True)
class GenerateEvent:
    """One streamed event. Chunks: this round's tokens and text. The final event
    (``final=True``): every generated token, the whole text and the statistics."""

    final: bool
    tokens: tuple[int, ...]
    text: str
    round: int = 0
    num_accepted: int = 0
    num_drafted: int = 0
    weights_version: str = ""
    # final event only
    request_id: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    acceptance_per_position: tuple[float, ...] = ()
    rounds: int = 0
    ahead_asked: int = 0             # rounds that drafted ahead, and rounds that used those drafts
    ahead_used: int = 0
    watch_probes: int = 0            # adaptive k: rounds the draft drafted beside a target-only step


@dataclass(frozen=True)
class GenerationResult:
    tokens: tuple[int, ...]
    text: str
    finish_reason: str
    acceptance_rate: float
    mean_accepted_length: float
    per_position: tuple[float, ...]
    usage: dict[str, int] = field(default_factory=dict)      # prompt_tokens, completion_tokens
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    chunks: int = 0
    request_id: str = ""
    weights_version: str = ""
    ahead_asked: int = 0
    ahead_used: int = 0
    watch_probes: int = 0


@dataclass(frozen=True)
class ReloadEvent:
    """One progress event of a reload (``phase`` on ``service``); ``error_code`` set when it failed there."""

    phase: str
    service: str
    seconds: float
    message: str = ""
    done: bool = False
    weights_version: str = ""
    error_code: str = ""
    error_message: str = ""


class ReloadFailed(SpecsplitError):
    """A reload or push failed; ``events`` are the progress events received before the error."""

    def __init__(self, code: grpc.StatusCode, details: str, events: tuple[ReloadEvent, ...]) -> None:
        super().__init__(code, details)
        self.events = events


@dataclass(frozen=True)
class PushResult:
    weights_version: str
    staged_path: str
    bytes_received: int
    num_tensors: int
    events: tuple[ReloadEvent, ...]


def _event(m: opb.ReloadWeightsResponse) -> ReloadEvent:
    err = m.error if m.HasField("error") else None
    return ReloadEvent(m.phase, m.service, m.seconds, m.message, m.done, m.weights_version,
                       _CODE_NAMES.get(err.code, "UNKNOWN") if err else "", err.message if err else "")


def _choice(table: dict[str, int], value: str, what: str) -> int:
    if value not in table:
        raise ValueError(f"{what}: {value!r} is not one of {sorted(table)}")
    return table[value]


def _wire_bytes(arr: np.ndarray, bfloat16: bool) -> tuple[str, bytes]:
    """(dtype name, little-endian bytes): float32/float16 as is, uint16 as bf16 bits,
    floats rounded to bf16 (nearest even) when ``bfloat16``."""
    arr = np.ascontiguousarray(arr)
    if arr.dtype == np.uint16:
        return "bfloat16", arr.astype("<u2").tobytes()
    if bfloat16:
        return "bfloat16", float32_to_bf16_bits(arr).astype("<u2").tobytes()
    if arr.dtype == np.float16:
        return "float16", arr.astype("<f2").tobytes()
    return "float32", arr.astype("<f4").tobytes()


class SpecsplitClient:
    """``with SpecsplitClient("127.0.0.1:50051") as c: print(c.generate_text("hi", max_tokens=16).text)``"""

    def __init__(self, address: str, timeout: float = 60.0, tls_ca: str | None = None, token: str | None = None,
                 max_message_bytes: int = 64 * 1024 * 1024, tls_cert: str | None = None,
                 tls_key: str | None = None) -> None:
        """TLS when ``tls_ca`` is set; ``tls_cert``/``tls_key``: the client certificate (mutual TLS).
        ``token`` None: the token file of a service at a loopback address, if there is one."""
        self.address, self.timeout = address, timeout
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)]
        if tls_ca:
            creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes(),
                                                 private_key=Path(tls_key).read_bytes() if tls_key else None,
                                                 certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None)
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = orchestrator_pb2_grpc.OrchestratorStub(self._channel)
        if token is None:
            # The Jupyter pattern: a local service's generated admin token is in its token file.
            from core.admin_token import find_admin_token

            token = find_admin_token(address)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None

    # --- generation -------------------------------------------------------------------
    @staticmethod
    def build_request(prompt: str | Sequence[int], max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                      top_p: float = 1.0, seed: int | None = None, k: int | None = None,
                      stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, draft_sampling: bool = False,
                      request_id: str = "", stop: Sequence[str] = (),
                      sampling_mode: str | None = None, fixed_k: bool = False) -> opb.GenerateRequest:
        """``prompt``: text, token ids, or chat messages ``[{"role": ..., "content": ...}]``
        (rendered with the model's chat template by the server). ``sampling_mode``: "rejection",
        "coupled", or None for the server's default. ``fixed_k``: draft k every round even where
        the server adapts k."""
        modes = {None: common_pb2.SAMPLING_MODE_UNSPECIFIED, "rejection": common_pb2.SAMPLING_MODE_REJECTION,
                 "coupled": common_pb2.SAMPLING_MODE_COUPLED}
        if sampling_mode not in modes:
            raise ValueError(f"sampling_mode: {sampling_mode!r} is not one of rejection, coupled")
        sampling = common_pb2.SamplingParams(temperature=temperature, top_k=top_k,
                                             top_p=0.0 if top_p == 1.0 else top_p, draft_sampling=draft_sampling,
                                             sampling_mode=modes[sampling_mode])
        if seed is not None:
            sampling.seed = seed
        req = opb.GenerateRequest(request_id=request_id, max_tokens=max_tokens, sampling=sampling,
                                  stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos, stop=list(stop),
                                  fixed_k=fixed_k)
        if isinstance(prompt, str):
            req.prompt = prompt
        elif prompt and isinstance(prompt[0], Mapping):
            req.messages.extend(opb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
        else:
            req.prompt_token_ids.extend(int(t) for t in prompt)
        if k is not None:
            req.k = k
        return req

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 64, *, timeout: float | None = None,
                 **kw: Any) -> Iterator[GenerateEvent]:
        """Stream a generation: chunk events, then one final event. Leaving the loop early
        (or closing the iterator) cancels the call, which frees its slots on the workers.
        Keywords: temperature, top_k, top_p, seed, k, fixed_k, stop_token_ids, stop (strings), ignore_eos,
        draft_sampling, sampling_mode, request_id."""
        return self.stream(self.build_request(prompt, max_tokens, **kw), timeout=timeout)

    def stream(self, request: opb.GenerateRequest, timeout: float | None = None) -> Iterator[GenerateEvent]:
        call = self._stub.Generate(request, timeout=timeout or self.timeout, metadata=self._metadata)
        tokens: list[int] = []
        try:
            for resp in call:
                if resp.HasField("chunk"):
                    c = resp.chunk
                    tokens.extend(c.token_ids)
                    yield GenerateEvent(False, tuple(c.token_ids), c.text, c.round, c.num_accepted, c.num_drafted,
                                        c.weights_version)
                else:
                    f = resp.final
                    s = f.stats
                    yield GenerateEvent(
                        True, tuple(tokens), f.text, weights_version=f.weights_version, request_id=f.request_id,
                        finish_reason=_FINISH_NAMES.get(f.finish_reason, "unspecified"),
                        prompt_tokens=f.usage.prompt_tokens, completion_tokens=f.usage.completion_tokens,
                        drafted=s.drafted, accepted=s.accepted, acceptance_rate=s.acceptance_rate,
                        mean_accepted_length=s.mean_accepted_length,
                        acceptance_per_position=tuple(s.acceptance_per_position), rounds=s.rounds,
                        ahead_asked=s.ahead_asked, ahead_used=s.ahead_used, watch_probes=s.watch_probes)
        except grpc.RpcError as exc:
            raise SpecsplitError(exc.code(), exc.details() or "") from None
        finally:
            call.cancel()                      # no-op once the stream has ended

    def generate_text(self, prompt: str | Sequence[int], max_tokens: int = 64, *, timeout: float | None = None,
                      **kw: Any) -> GenerationResult:
        """Run a generation to the end and return its tokens, text and statistics."""
        chunks = 0
        for ev in self.generate(prompt, max_tokens, timeout=timeout, **kw):
            if not ev.final:
                chunks += 1
                continue
            return GenerationResult(ev.tokens, ev.text, ev.finish_reason or "unspecified", ev.acceptance_rate,
                                    ev.mean_accepted_length, ev.acceptance_per_position,
                                    {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens},
                                    ev.drafted, ev.accepted, ev.rounds, chunks, ev.request_id, ev.weights_version,
                                    ev.ahead_asked, ev.ahead_used, ev.watch_probes)
        raise SpecsplitError(grpc.StatusCode.INTERNAL, "the stream ended without a final message")

    # --- status -----------------------------------------------------------------------
    def status_proto(self, timeout: float | None = None) -> opb.ClusterStatus:
        try:
            return self._stub.GetStatus(common_pb2.GetStatusRequest(), timeout=timeout or self.timeout,
                                        metadata=self._metadata)
        except grpc.RpcError as exc:
            raise SpecsplitError(exc.code(), exc.details() or "") from None

    def status(self, timeout: float | None = None) -> dict[str, Any]:
        """{"orchestrator": {...}, "target": {...}, "draft": {...}, "target_error": str, "draft_error": str};
        a worker's entry is missing when it could not be reached (see its *_error)."""
        msg = self.status_proto(timeout)
        out: dict[str, Any] = {"target_error": msg.target_error, "draft_error": msg.draft_error}
        for name in ("orchestrator", "target", "draft"):
            if msg.HasField(name):
                out[name] = MessageToDict(getattr(msg, name), preserving_proto_field_name=True,
                                          always_print_fields_with_no_presence=True)
        return out

    # --- weight reload (admin: the client's token must be the orchestrator's admin token) ----
    def reload_events(self, target_path: str, version: str, *, draft_path: str = "", mode: str = "recapture",
                      inflight: str = "wait", preload: bool = False,
                      timeout: float | None = None) -> Iterator[ReloadEvent]:
        """Stream a reload's progress events. mode: recapture | in_place; inflight: wait |
        abort | recompute. A failed reload raises ReloadFailed (with the events) at the end."""
        req = opb.ReloadWeightsRequest(target_path=target_path, draft_path=draft_path, version=version,
                                       mode=_choice(_MODES, mode, "mode"),
                                       inflight=_choice(_POLICIES, inflight, "inflight"), preload=preload)
        call = self._stub.ReloadWeights(req, timeout=timeout or self.timeout, metadata=self._metadata)
        seen: list[ReloadEvent] = []
        try:
            for m in call:
                seen.append(_event(m))
                yield seen[-1]
        except grpc.RpcError as exc:
            raise ReloadFailed(exc.code(), exc.details() or "", tuple(seen)) from None

    def reload(self, target_path: str, version: str, **kw: Any) -> tuple[ReloadEvent, ...]:
        """Run a reload to the end; returns its events (the last has done=True). Raises ReloadFailed."""
        return tuple(self.reload_events(target_path, version, **kw))

    def push_weights(self, tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
                     target_config: Mapping[str, Any] | str, version: str, *, mode: str = "recapture",
                     inflight: str = "wait", bfloat16: bool = False, chunk_bytes: int = PUSH_CHUNK_BYTES,
                     timeout: float | None = None) -> PushResult:
        """Send named tensors (target names + the MTP's "mtp." names) and the target's
        config.json (dict or JSON text); the orchestrator stages and applies them as a reload.
        Arrays are sent lazily, one chunk of ``chunk_bytes`` at a time. Raises ReloadFailed."""
        config_json = target_config if isinstance(target_config, str) else json.dumps(dict(target_config))
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        header = opb.PushWeightsHeader(version=version, target_config_json=config_json,
                                       mode=_choice(_MODES, mode, "mode"),
                                       inflight=_choice(_POLICIES, inflight, "inflight"))

        def messages() -> Iterator[opb.PushWeightsRequest]:
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
            resp = self._stub.PushWeights(messages(), timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise ReloadFailed(exc.code(), exc.details() or "", ()) from None
        return PushResult(resp.weights_version, resp.staged_path, resp.bytes_received, resp.num_tensors,
                          tuple(_event(m) for m in resp.events))

    # --- lifetime ---------------------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> "SpecsplitClient":
        """Connect now (a channel otherwise connects on its first call); SpecsplitError
        UNAVAILABLE when the orchestrator cannot be reached within ``timeout``."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout or self.timeout)
        except grpc.FutureTimeoutError:
            raise SpecsplitError(grpc.StatusCode.UNAVAILABLE, "the orchestrator could not be reached "
                                 f"within {timeout or self.timeout:g}s") from None
        return self

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "SpecsplitClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
