"""Target-side work: prefill, batched verification and acceptance.

Owns: the target's weights on the device, its KV cache, per-request decoding
state (committed length, last token, sampling params, seeded RNG) and the
step kinds the graph registry captures (``verify`` at k+1 positions).

Must not know: gRPC, lifecycle states, scheduling or the draft's internals;
those live in ``target_service`` and the round driver. Framework calls go
through ``Ops`` only.

State per request (DESIGN § The speculative round): committed tokens
t_0..t_n, KV valid for positions 0..n-1, ``last_token`` = t_n.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime import acceptance, sampling
from runtime.backends.base import Ops
from runtime.batch_layout import Row, attend_span, layout_rows
from runtime.config import CacheConfig, ModelConfig, SamplingParams
from runtime.graphs import GraphRegistry, InputSpec, StepKind
from runtime.kv_cache import CapacityError, KVCache
from runtime.model import Params, Rope, build_attn_meta, lm_head, target_forward
from runtime.types import PrefillRequest, PrefillResult, VerifyRequest, VerifyResult


@dataclass
class _TargetRequest:
    params: SamplingParams
    rng: np.random.Generator
    last_token: int


def request_rng(seed: int | None, stream: int) -> np.random.Generator:
    """Per-request RNG; the target and the draft use different streams of one seed."""
    return np.random.default_rng(None if seed is None else [seed, stream])


class TargetEngine:
    def __init__(self, ops: Ops, cfg: ModelConfig, params: Params, cache_cfg: CacheConfig,
                 max_k: int, registry: GraphRegistry) -> None:
        self.ops, self.cfg, self.params = ops, cfg, params
        self.max_k = max_k
        self.cache = KVCache(ops, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                             cache_cfg.max_slots, cache_cfg.max_len)
        self.rope = Rope(ops, cfg, cache_cfg.max_len)
        self.requests: dict[str, _TargetRequest] = {}
        self.registry = registry
        width = max_k + 1
        scratch = self.cache.scratch_slot
        registry.register(StepKind(
            name=f"verify{width}",
            fn=self._step,
            inputs=(InputSpec("tokens", (width,), "int64", 0),
                    InputSpec("write_slots", (width,), "int64", scratch),
                    InputSpec("positions", (width,), "int64", 0),
                    InputSpec("read_slots", (), "int64", scratch)),
            eager_kwargs=lambda x: {"attend_len": attend_span(x["positions"], self.cache.max_len)},
        ))
        self._verify_kind = f"verify{width}"

    # --- the captured step ---------------------------------------------------
    def _step(self, tokens, write_slots, positions, read_slots, attend_len=None):
        """tokens/write_slots/positions [B, T], read_slots [B] -> hidden [B, T, d], logits [B, T, V]."""
        meta = build_attn_meta(self.ops, self.rope, write_slots, positions, read_slots,
                               self.cache.max_len, attend_len or self.cache.max_len)
        hidden = target_forward(self.ops, self.params, self.cfg, tokens, meta, self.cache.layers)
        return hidden, lm_head(self.ops, self.params, self.cfg, hidden)

    # --- requests --------------------------------------------------------------
    def prefill(self, reqs: list[PrefillRequest]) -> list[PrefillResult]:
        """Run each prompt t_0..t_{n-1}; sample t_n (or take ``resume_token``)."""
        for r in reqs:
            if self.cache.has(r.request_id):
                raise ValueError(f"request_id {r.request_id!r} is already active")
            n = len(r.prompt)
            if n == 0:
                raise ValueError("prompt must hold at least one token")
            self.cache.check_fits(r.request_id, n + 1)
        if self.cache.free_slots < len(reqs):
            raise CapacityError(f"KV cache full: {len(reqs)} requests need slots, {self.cache.free_slots} free")
        states = [self.cache.allocate(r.request_id) for r in reqs]
        try:
            rows = [Row(s.slot, 0, np.asarray(r.prompt, dtype=np.int64)) for s, r in zip(states, reqs)]
            width = max(len(r.prompt) for r in reqs)
            lay = layout_rows(rows, width, self.cache.scratch_slot, self.cache.max_len)
            t = lambda a: self.ops.from_numpy(a, "int64")  # noqa: E731
            with self.ops.no_grad():
                hidden, logits = self._step(t(lay.tokens), t(lay.write_slots), t(lay.positions), t(lay.read_slots),
                                            attend_len=attend_span(lay.positions, self.cache.max_len))
            hidden_np = self.ops.to_numpy(hidden)                        # [B, T, d]
            logits_np = self.ops.to_numpy(logits)                        # [B, T, V]
        except Exception:
            for r in reqs:
                self.cache.free(r.request_id)
            raise
        out = []
        for i, (r, s) in enumerate(zip(reqs, states)):
            n = len(r.prompt)
            s.length = n
            rng = request_rng(r.params.seed, 0)
            if r.resume_token is not None:
                first = int(r.resume_token)
            else:
                first = self._sample(logits_np[i, n - 1], r.params, rng)
            self.requests[r.request_id] = _TargetRequest(r.params, rng, first)
            out.append(PrefillResult(r.request_id, first, hidden_np[i, :n].copy()))
        return out

    def _sample(self, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
        if params.greedy:
            return sampling.greedy_token(logits)
        probs = sampling.process_logits(logits, params.temperature, params.top_k, params.top_p)
        return sampling.sample_token(probs, rng)

    def verify(self, reqs: list[VerifyRequest]) -> list[VerifyResult]:
        """One forward over [t_n, d_1..d_k] per request, then accept (DESIGN step 3-5)."""
        rows = []
        for r in reqs:
            state = self.cache.get(r.request_id)
            k = len(r.drafts)
            if k > self.max_k:
                raise ValueError(f"drafts: {k} drafts exceed max_k={self.max_k}")
            self.cache.check_fits(r.request_id, state.length + k + 1)
            tokens = np.concatenate([[self.requests[r.request_id].last_token], np.asarray(r.drafts, dtype=np.int64)])
            rows.append(Row(state.slot, state.length, tokens))
        lay = layout_rows(rows, self.max_k + 1, self.cache.scratch_slot, self.cache.max_len)
        (hidden, logits), _ = self.registry.run(self._verify_kind, {
            "tokens": lay.tokens, "write_slots": lay.write_slots,
            "positions": lay.positions, "read_slots": lay.read_slots})
        hidden_np = self.ops.to_numpy(hidden)                              # [B, k+1, d]
        logits_np = self.ops.to_numpy(logits)                              # [B, k+1, V]
        out = []
        for i, r in enumerate(reqs):
            req = self.requests[r.request_id]
            k = len(r.drafts)
            rows_logits = logits_np[i, : k + 1]                            # [k+1, V]
            if req.params.greedy:
                acc = acceptance.accept_greedy(list(r.drafts), rows_logits)
            else:
                p = sampling.process_logits(rows_logits, req.params.temperature, req.params.top_k, req.params.top_p)
                acc = acceptance.accept_rejection(list(r.drafts), r.draft_probs, p, req.rng)
            a = acc.num_accepted
            state = self.cache.get(r.request_id)
            # NOTE: commit = length update. Rows n..n+a now hold t_n, d_1..d_a
            # (all committed); rows past n+a are stale and get overwritten.
            state.length += a + 1
            req.last_token = acc.tokens[-1]
            out.append(VerifyResult(r.request_id, a, tuple(acc.tokens), hidden_np[i, : a + 1].copy()))
        return out

    def release(self, request_id: str) -> bool:
        self.requests.pop(request_id, None)
        return self.cache.free(request_id)
