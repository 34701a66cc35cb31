"""Validation of client Generate requests against the model the workers serve.

Owns: ``ModelFacts`` (what requests are checked against, from the workers'
GetStatus) and ``validate`` (GenerateRequest -> GenerationRequest, or a
RequestError naming the bad field: INVALID_ARGUMENT, or RESOURCE_EXHAUSTED
when the request cannot fit the workers' caches).

Must not know: how requests run, gRPC servicers, tensors.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

from rounds.scheduler_types import GenerationRequest, RequestError
from orchestrator.config import OrchestratorConfig
from runtime.tokenizer import Tokenizer
from core import wire
from specsplit.v1 import orchestrator_pb2 as opb

MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256


@dataclass(frozen=True)
class ModelFacts:
    """What requests are validated against, from the workers' GetStatus."""

    vocab_size: int
    max_len: int                   # smallest cache length of the workers a request uses
    eos_token_id: int | None
    weights_version: str
    slots: int                     # smallest slot count of the workers
    draft_max_k: int | None        # None: no draft reachable
    max_position_embeddings: int = 0  # longest prompt the model takes (0: unknown)
    eos_token_ids: tuple[int, ...] = ()


# --- validation --------------------------------------------------------------------------
def _bad(message: str) -> RequestError:
    return RequestError("INVALID_ARGUMENT", message)


def validate(req: opb.GenerateRequest, cfg: OrchestratorConfig, facts: ModelFacts, has_draft: bool,
             tokenizer: Tokenizer) -> GenerationRequest:
    """GenerateRequest -> GenerationRequest, or RequestError naming the bad field."""
    rid = req.request_id or uuid.uuid4().hex
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise _bad(f"request_id: {len(rid)} characters, at most {MAX_REQUEST_ID_CHARS} allowed")
    given = [name for name, v in (("prompt", req.prompt), ("prompt_token_ids", req.prompt_token_ids),
                                  ("messages", req.messages)) if v]
    if len(given) > 1:
        raise _bad(f"{'/'.join(given)}: set exactly one of prompt, prompt_token_ids, messages")
    if not given:
        raise _bad("prompt: empty prompt (set prompt, prompt_token_ids or messages)")
    field = given[0]
    if field == "messages":
        try:
            prompt = tuple(tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in req.messages]))
        except ValueError as exc:
            raise _bad(f"messages: {exc}") from None
    else:
        prompt = tuple(tokenizer.encode(req.prompt)) if req.prompt else tuple(int(t) for t in req.prompt_token_ids)
    if len(prompt) > cfg.max_prompt_tokens:
        raise _bad(f"{field}: {len(prompt)} tokens exceed max_prompt_tokens={cfg.max_prompt_tokens}")
    if facts.max_position_embeddings and len(prompt) > facts.max_position_embeddings:
        raise _bad(f"{field}: a prompt of {len(prompt)} tokens exceeds the model's max_position_embeddings="
                   f"{facts.max_position_embeddings}")
    if len(req.stop) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in req.stop):
        raise _bad(f"stop: at most {MAX_STOP_STRINGS} strings of 1..{MAX_STOP_CHARS} characters")
    for i, t in enumerate(prompt):
        if not 0 <= t < facts.vocab_size:
            raise _bad(f"{field}[{i}]: token id {t} is out of range [0, {facts.vocab_size})")
    if not 1 <= req.max_tokens <= cfg.max_tokens_limit:
        raise _bad(f"max_tokens: {req.max_tokens} is out of range [1, {cfg.max_tokens_limit}]")
    max_k = cfg.max_k if facts.draft_max_k is None else min(cfg.max_k, facts.draft_max_k)
    k = req.k if req.HasField("k") else min(cfg.default_k, max_k)
    if not 0 <= k <= max_k:
        raise _bad(f"k: {k} is out of range [0, {max_k}]")
    for i, t in enumerate(req.stop_token_ids):
        if not 0 <= t < facts.vocab_size:
            raise _bad(f"stop_token_ids[{i}]: token id {t} is out of range [0, {facts.vocab_size})")
    try:
        base = wire.params_from_proto(req.sampling, "sampling", cfg.default_sampling_mode)
        # NOTE: a model with several EOS ids (config.json list): the target's round loop stops
        # on each of them; they are also sent as stop tokens so a target that knows only the
        # first (an older worker) stops on all of them too.
        extra_eos = () if req.ignore_eos else tuple(facts.eos_token_ids[1:])
        params = dataclasses.replace(base, max_tokens=req.max_tokens,
                                     stop_token_ids=tuple(req.stop_token_ids) + extra_eos, ignore_eos=req.ignore_eos)
    except ValueError as exc:
        raise _bad(str(exc)) from None
    k_eff = k if has_draft else 0
    # Positions a request may touch: prompt + every generated token + the drafts of a round.
    need = len(prompt) + params.max_tokens + k_eff
    if need > facts.max_len:
        raise RequestError("RESOURCE_EXHAUSTED",
                           f"{field}/max_tokens: a prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} "
                           f"+ k={k_eff} needs {need} cache positions; the workers hold {facts.max_len}")
    return GenerationRequest(rid, prompt, params, k, fixed_k=req.fixed_k)


