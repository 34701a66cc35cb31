"""OpenAI-compatible request and response bodies <-> specsplit's Generate (no HTTP, no gRPC).

Owns: validating ``/v1/completions`` and ``/v1/chat/completions`` bodies
(fields we map: ``model``, ``prompt`` / ``messages``, ``max_tokens``
(``max_completion_tokens`` for chat), ``temperature``, ``top_p``, ``seed``,
``stop``, ``n`` (= 1), ``stream``, ``stream_options.include_usage``,
``user``; extensions ``top_k``, ``k``, ``ignore_eos``, ``sampling_mode``
("rejection" | "coupled"; absent = the server's default); fields that only
default to "off" are accepted at that value; anything else is a 400 naming
the field), text stop sequences (``StopMatcher``: text held back while it may
still become a stop sequence), speculation statistics (``SpecStats``: the
``specsplit`` extension object), response and stream-chunk bodies, and the
gRPC status code -> HTTP status / OpenAI error type table.

Must not know: HTTP frameworks, gRPC channels, the orchestrator's internals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

DEFAULT_COMPLETION_MAX_TOKENS = 16      # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 256           # OpenAI has no fixed default for chat; ours, documented
MAX_STOP_SEQUENCES = 4

_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
                     "user", "top_k", "k", "ignore_eos", "sampling_mode"})
COMPLETION_FIELDS = _COMMON | {"prompt"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}
# Fields accepted only at their "off" value (what SDKs and tools often send explicitly).
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "logprobs": lambda v: v is None or v is False, "top_logprobs": lambda v: v is None,
    "echo": lambda v: v is None or v is False, "best_of": lambda v: v is None or v == 1,
    "suffix": lambda v: v is None, "presence_penalty": lambda v: v is None or v == 0,
    "frequency_penalty": lambda v: v is None or v == 0, "logit_bias": lambda v: not v,
    "tools": lambda v: not v, "tool_choice": lambda v: v is None or v == "none",
    "parallel_tool_calls": lambda v: v is None,
    "response_format": lambda v: v is None or v == {"type": "text"},
}
_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})

# gRPC status code name -> (HTTP status, OpenAI error type)
HTTP_STATUS = {"INVALID_ARGUMENT": (400, "invalid_request_error"), "OUT_OF_RANGE": (400, "invalid_request_error"),
               "FAILED_PRECONDITION": (400, "invalid_request_error"), "NOT_FOUND": (404, "not_found_error"),
               "UNAUTHENTICATED": (401, "authentication_error"), "PERMISSION_DENIED": (403, "permission_error"),
               "RESOURCE_EXHAUSTED": (429, "rate_limit_error"), "UNAVAILABLE": (503, "service_unavailable"),
               "DEADLINE_EXCEEDED": (504, "timeout_error"), "CANCELLED": (499, "cancelled")}
FINISH_REASONS = {"stop": "stop", "length": "length", "aborted": "abort"}


class ApiError(Exception):
    """An error answer: HTTP ``status`` and the OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_grpc(cls, code_name: str, details: str) -> "ApiError":
        status, type_ = HTTP_STATUS.get(code_name, (500, "server_error"))
        return cls(status, details or code_name, type_, code=code_name)


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True)
class CompletionParams:
    """A validated request, in Generate's terms."""

    prompt: str | tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    top_k: int = 0
    k: int | None = None
    ignore_eos: bool = False
    sampling_mode: str | None = None

    def generate_kwargs(self) -> dict[str, Any]:
        """Keywords of ``SpecsplitClient.generate`` / ``AsyncSpecsplitClient.generate``."""
        return dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                    top_k=self.top_k, k=self.k, ignore_eos=self.ignore_eos, sampling_mode=self.sampling_mode)


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v > hi or v < lo or (lo_open and v == lo):
        raise bad(f"{name}={v!r} is invalid: must be a number in {'(' if lo_open else '['}{lo}, {hi}]", name)
    return float(v)


def _int(body: dict, name: str, default: int | None, lo: int, hi: int = 1 << 62) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise bad(f"{name}={v!r} is invalid: must be an integer in [{lo}, {hi}]", name)
    return v


def _check_fields(body: Any, allowed: frozenset[str]) -> None:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unsupported = sorted(k for k in body if k not in allowed and not (k in _NEUTRAL and _NEUTRAL[k](body[k])))
    if unsupported:
        shown = ", ".join(f"{k}={body[k]!r}" if k in _NEUTRAL else k for k in unsupported)
        raise bad(f"unsupported field(s): {shown}; specsplit supports {', '.join(sorted(allowed))}",
                  unsupported[0])


def _common(body: dict, model_name: str, default_max_tokens: int, max_tokens_key: str = "max_tokens") -> dict:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required (a string)", "model")
    if model != model_name:
        raise ApiError(404, f"model {model!r} does not exist: this server serves {model_name!r}", "not_found_error",
                       "model", "model_not_found")
    n = _int(body, "n", 1, 1)
    if n != 1:
        raise bad(f"n={n} is not supported: specsplit returns one choice (n=1)", "n")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad(f"stream={stream!r} is invalid: must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise bad(f"stream_options={options!r} is invalid: only {{\"include_usage\": bool}} is supported",
                  "stream_options")
    if options is not None and not stream:
        raise bad("stream_options is only allowed with stream=true", "stream_options")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else () if stop is None else None
    if stops is None or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP_SEQUENCES:
        raise bad(f"stop={stop!r} is invalid: must be a non-empty string or a list of at most "
                  f"{MAX_STOP_SEQUENCES} non-empty strings", "stop")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad(f"ignore_eos={ignore_eos!r} is invalid: must be true or false", "ignore_eos")
    if not isinstance(body.get("user", ""), str):
        raise bad("user must be a string", "user")
    mode = body.get("sampling_mode")
    if mode is not None and mode not in ("rejection", "coupled"):
        raise bad(f"sampling_mode={mode!r} is invalid: must be \"rejection\" or \"coupled\"", "sampling_mode")
    return dict(max_tokens=_int(body, max_tokens_key, default_max_tokens, 1),
                temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), seed=_int(body, "seed", None, 0, 2**63 - 1),
                stop=stops, stream=bool(stream), include_usage=bool((options or {}).get("include_usage")),
                top_k=_int(body, "top_k", 0, 0), k=_int(body, "k", None, 0), ignore_eos=ignore_eos,
                sampling_mode=mode)


def parse_completion(body: Any, model_name: str) -> CompletionParams:
    """A ``/v1/completions`` body -> CompletionParams; ApiError (400/404) naming the bad field."""
    _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                      # a batch of one prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt) and prompt:
        prompt = tuple(prompt)
    elif not isinstance(prompt, str):
        raise bad("prompt must be a string, a list of token ids, or a list holding one of those "
                  "(batches of several prompts are not supported)", "prompt")
    return CompletionParams(prompt=prompt, **_common(body, model_name, DEFAULT_COMPLETION_MAX_TOKENS))


def parse_chat(body: Any, model_name: str, render: Callable[[list[dict[str, Any]]], str]) -> CompletionParams:
    """A ``/v1/chat/completions`` body -> CompletionParams, the prompt rendered by ``render``
    (the chat template; it raises ``chat.NoChatTemplate`` for a model without one)."""
    _check_fields(body, CHAT_FIELDS)
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise bad("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _CHAT_ROLES or not isinstance(m.get("content"), str) \
                or set(m) - {"role", "content", "name"}:
            raise bad(f"messages[{i}] is invalid: must be {{\"role\": one of {sorted(_CHAT_ROLES)}, "
                      "\"content\": string}} (tool calls and content parts are not supported)", "messages")
    common = _common(body, model_name, DEFAULT_CHAT_MAX_TOKENS,
                     "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens")
    return CompletionParams(prompt=render(messages), **common)


class StopMatcher:
    """Cuts generated text at the first stop sequence. ``feed`` returns the text safe to emit
    now (text that may still grow into a stop sequence is held back); ``flush`` the rest."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops, self.pending, self.stopped = tuple(stops), "", False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self.pending + text
        # NOTE: generation stops where a stop sequence is first *completed* (earliest end; of
        # those ending together, the longest), so the cut does not depend on how the text was
        # split into chunks: a longer stop that began earlier but is not complete yet loses.
        hits = [(i + len(s), -len(s), i) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return buf[:min(hits)[2]]
        hold = 0
        for s in self.stops:                    # longest tail of buf that begins some stop sequence
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


@dataclass
class SpecStats:
    """Speculation statistics of one request: from the final event, or summed over the chunks
    seen when the stream was cut short (a stop sequence)."""

    request_id: str = ""
    weights_version: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    acceptance_per_position: list[float] = field(default_factory=list)

    def add_chunk(self, ev: Any) -> None:
        """One chunk: the first is the prefill's token, each later one a speculative round."""
        if self.completion_tokens:
            self.rounds += 1
        self.completion_tokens += len(ev.tokens)
        self.drafted += ev.num_drafted
        self.accepted += ev.num_accepted
        self.weights_version = ev.weights_version or self.weights_version
        self.acceptance_rate = self.accepted / self.drafted if self.drafted else 0.0
        self.mean_accepted_length = (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    def set_final(self, ev: Any) -> None:
        self.request_id, self.weights_version = ev.request_id, ev.weights_version
        self.prompt_tokens, self.completion_tokens = ev.prompt_tokens, ev.completion_tokens
        self.drafted, self.accepted, self.rounds = ev.drafted, ev.accepted, ev.rounds
        self.acceptance_rate, self.mean_accepted_length = ev.acceptance_rate, ev.mean_accepted_length
        self.acceptance_per_position = list(ev.acceptance_per_position)

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def extension(self) -> dict[str, Any]:
        """The ``specsplit`` object of a response."""
        return {"request_id": self.request_id, "weights_version": self.weights_version, "drafted": self.drafted,
                "accepted": self.accepted, "rounds": self.rounds, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length,
                "acceptance_per_position": self.acceptance_per_position}


def completion_body(rid: str, model: str, created: int, text: str, finish: str, stats: SpecStats,
                    chat: bool) -> dict[str, Any]:
    choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                               "finish_reason": finish} if chat else
                              {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": stats.usage(), "specsplit": stats.extension()}


def chunk_body(rid: str, model: str, created: int, text: str | None, finish: str | None, chat: bool,
               first: bool = False) -> dict[str, Any]:
    """One stream chunk: a text delta, or (``finish`` set) the last choice chunk."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}


def now() -> int:
    return int(time.time())
