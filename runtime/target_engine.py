"""Target-side work: prefill, batched verification and acceptance.

Owns: the target's weights on the device, its KV cache, per-request decoding
state (committed length, last token, sampling params, seeded RNG) and the
step kinds the graph registry captures (``verify`` at k+1 positions); what
each of its requests must satisfy (``check_prefill`` / ``check_verify``, run
by the worker before a batch; one bad item never fails the others).

Must not know: gRPC, lifecycle states, scheduling or the draft's internals;
those live in ``target_service`` and the round driver. Framework calls go
through ``Ops`` only.

What comes back to the host (DESIGN § Keeping the GPU busy): greedy rows
bring only the argmax ids [k+1] and the hidden rows; sampled rows are
accepted on the device when the backend has a sampler (``ops.sampler``:
Torch), else by the numpy oracle (Paddle). Prefill runs the output head on
each prompt's last position only. One host synchronisation per verify.

State per request (DESIGN § The speculative round): committed tokens
t_0..t_n, KV valid for positions 0..n-1, ``last_token`` = t_n.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime import acceptance, sampling
from runtime.backends.base import Ops
from runtime.batch_layout import Row, attend_need, attend_span, context_spans, layout_rows
from core.params import SamplingParams
from runtime.config import CacheConfig, ModelConfig
from runtime.graphs import GraphRegistry, InputSpec, StepKind
from runtime.kv_cache import CapacityError, KVCache, UnknownRequestError
from runtime.model import Params, Rope, build_attn_meta, fuse_projections, lm_head, target_forward
from runtime.request_checks import check_batch, check_token_range
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
        # Checkpoint names (views after fusing: in-place updates go through them)
        # plus the fused q/k/v and gate/up buffers the forward uses.
        fused = fuse_projections(ops, params, [f"model.layers.{i}." for i in range(cfg.num_hidden_layers)])
        self._weights = {**params, **fused}
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
            fn=ops.compile_step(self._step),
            inputs=(InputSpec("tokens", (width,), "int64", 0),
                    InputSpec("write_slots", (width,), "int64", scratch),
                    InputSpec("positions", (width,), "int64", 0),
                    InputSpec("read_slots", (), "int64", scratch)),
            eager_kwargs=lambda x: {"attend_len": attend_span(x["positions"], self.cache.max_len)},
            spans=context_spans(self.cache.max_len),
            span_of=lambda x: attend_need(x["positions"]),
        ))
        self._verify_kind = f"verify{width}"

    # --- the captured step ---------------------------------------------------
    def _step(self, tokens, write_slots, positions, read_slots, attend_len=None):
        """tokens/write_slots/positions [B, T], read_slots [B]
        -> hidden [B, T, d], argmax int64 [B, T], logits float32 [B, T, V] (stay on the device)."""
        meta = build_attn_meta(self.ops, self.rope, write_slots, positions, read_slots,
                               self.cache.max_len, attend_len or self.cache.max_len)
        hidden = target_forward(self.ops, self._weights, self.cfg, tokens, meta, self.cache.layers)
        logits = lm_head(self.ops, self._weights, self.cfg, hidden)
        return hidden, self.ops.argmax(logits, -1), logits

    def _prefill_step(self, tokens, write_slots, positions, read_slots, last_index, attend_len):
        """As ``_step``, but the output head runs on each row's last real position only:
        -> hidden [B, T, d], argmax int64 [B], logits float32 [B, V]."""
        meta = build_attn_meta(self.ops, self.rope, write_slots, positions, read_slots,
                               self.cache.max_len, attend_len)
        hidden = target_forward(self.ops, self._weights, self.cfg, tokens, meta, self.cache.layers)
        b, t, d = self.ops.shape(hidden)
        last = self.ops.index_select(self.ops.reshape(hidden, (b * t, d)), last_index, 0)     # [B, d]
        logits = lm_head(self.ops, self._weights, self.cfg, last)
        return hidden, self.ops.argmax(logits, -1), logits

    # --- requests --------------------------------------------------------------
    # --- what a request must satisfy (run before the batch; a refused item never joins it) ----
    def check_prefill(self, items: list[tuple[int, PrefillRequest]]
                      ) -> tuple[list[tuple[int, PrefillRequest]], dict[int, Exception]]:
        def one(i: int, it: PrefillRequest, admitted: int) -> PrefillRequest:
            vocab = self.cfg.vocab_size
            if self.cache.has(it.request_id):
                raise ValueError(f"items[{i}].request_id: {it.request_id!r} is already active here")
            n = len(it.prompt)
            if n == 0:
                raise ValueError(f"items[{i}].prompt: must hold at least one token (empty)")
            check_token_range(it.prompt, vocab, f"items[{i}].prompt")
            if it.resume_token is not None and not 0 <= it.resume_token < vocab:
                raise ValueError(f"items[{i}].resume_token: {it.resume_token} is out of range [0, {vocab})")
            if n + 1 > self.cache.max_len:
                raise CapacityError(f"items[{i}].prompt: {n} tokens need {n + 1} cache positions; "
                                    f"cache.max_len is {self.cache.max_len}")
            if admitted >= self.cache.free_slots:
                raise CapacityError(f"items[{i}]: no free KV cache slot "
                                    f"({self.cache.max_slots} slots, all in use)")
            return it

        return check_batch(items, one)

    def check_verify(self, items: list[tuple[int, VerifyRequest]]
                     ) -> tuple[list[tuple[int, VerifyRequest]], dict[int, Exception]]:
        def one(i: int, it: VerifyRequest, _admitted: int) -> VerifyRequest:
            vocab = self.cfg.vocab_size
            if not self.cache.has(it.request_id):
                raise UnknownRequestError(f"items[{i}].request_id: {it.request_id!r} is unknown here "
                                          "(never prefilled, or already released)")
            length = self.cache.get(it.request_id).length
            k = len(it.drafts)
            if k > self.max_k:
                raise ValueError(f"items[{i}].drafts: {k} drafts exceed max_k={self.max_k}")
            check_token_range(it.drafts, vocab, f"items[{i}].drafts")
            if it.draft_probs is not None:
                _check_probs(it.draft_probs, k, vocab, f"items[{i}].draft_probs")
            if length + k + 1 > self.cache.max_len:
                raise CapacityError(f"items[{i}]: request {it.request_id!r} needs {length + k + 1} cache "
                                    f"positions; cache.max_len is {self.cache.max_len}")
            return it

        return check_batch(items, one)

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
                hidden, best, logits = self._prefill_step(
                    t(lay.tokens), t(lay.write_slots), t(lay.positions), t(lay.read_slots), t(lay.last_index),
                    attend_len=attend_span(lay.positions, self.cache.max_len))
            rngs = [request_rng(r.params.seed, 0) for r in reqs]
            sampled = [i for i, r in enumerate(reqs) if r.resume_token is None and not r.params.greedy]
            extra, logits_np = [], None
            if sampled and self.ops.sampler is not None:
                rows = self.ops.from_numpy(np.asarray(sampled, dtype=np.int64), "int64")
                ps = [reqs[i].params for i in sampled]
                extra = [self.ops.sampler.sample(
                    self.ops.index_select(logits, rows, 0), [p.temperature for p in ps], [p.top_k for p in ps],
                    [p.top_p for p in ps], [rngs[i].random() for i in sampled])]
            elif sampled:
                extra = [logits]
            # One synchronisation: hidden (bf16 as bits), argmax, and the sampled tokens or logits.
            hidden_np, best_np, *rest = self.ops.to_numpy_many([hidden, best, *extra], bf16_bits=True)
            if sampled and self.ops.sampler is not None:
                drawn = dict(zip(sampled, (int(x) for x in rest[0])))
            elif sampled:
                logits_np = rest[0]                                      # [B, V]
        except Exception:
            for r in reqs:
                self.cache.free(r.request_id)
            raise
        out = []
        for i, (r, s) in enumerate(zip(reqs, states)):
            n = len(r.prompt)
            s.length = n
            rng = rngs[i]
            if r.resume_token is not None:
                first = int(r.resume_token)
            elif r.params.greedy:
                first = int(best_np[i])
            elif logits_np is not None:
                first = self._sample(logits_np[i], r.params, rng)
            else:
                first = drawn[i]
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
        (hidden, best, logits), _ = self.registry.run(self._verify_kind, {
            "tokens": lay.tokens, "write_slots": lay.write_slots,
            "positions": lay.positions, "read_slots": lay.read_slots})
        states = [self.requests[r.request_id] for r in reqs]
        sampled = [i for i, st in enumerate(states) if not st.params.greedy]
        extra, device_acc, logits_np = [], None, None
        if sampled and self.ops.sampler is not None:
            extra = list(self._verify_on_device(reqs, states, sampled, logits))
        elif sampled:
            extra = [logits]
        # NOTE: one synchronisation per verify, after everything is enqueued:
        # hidden [B, k+1, d] (bf16 as bits), argmax [B, k+1], and the sampled
        # rows' (a, token) from the device sampler or their logits for numpy.
        hidden_np, best_np, *rest = self.ops.to_numpy_many([hidden, best, *extra], bf16_bits=True)
        if sampled and self.ops.sampler is not None:
            device_acc = {i: (int(a), int(tok)) for i, a, tok in zip(sampled, rest[0], rest[1])}
        elif sampled:
            logits_np = rest[0]                                            # [B, k+1, V]
        out = []
        for i, (r, req) in enumerate(zip(reqs, states)):
            k = len(r.drafts)
            if req.params.greedy:
                acc = acceptance.accept_greedy_ids(list(r.drafts), best_np[i, : k + 1])
            elif device_acc is not None:
                a, tok = device_acc[i]
                acc = acceptance.Acceptance(a, tuple(int(d) for d in r.drafts[:a]) + (tok,))
            else:
                p = sampling.process_logits(logits_np[i, : k + 1], req.params.temperature, req.params.top_k,
                                            req.params.top_p)
                acc = acceptance.accept_rejection(list(r.drafts), r.draft_probs, p, req.rng)
            a = acc.num_accepted
            state = self.cache.get(r.request_id)
            # NOTE: commit = length update. Rows n..n+a now hold t_n, d_1..d_a
            # (all committed); rows past n+a are stale and get overwritten.
            state.length += a + 1
            req.last_token = acc.tokens[-1]
            out.append(VerifyResult(r.request_id, a, tuple(acc.tokens), hidden_np[i, : a + 1].copy()))
        return out

    def _verify_on_device(self, reqs, states, sampled: list[int], logits):
        """Leviathan acceptance of the sampled rows on the device -> (a [S], token [S]) tensors.
        Each row draws k_max+1 uniforms from its request's RNG (see torch_sampling)."""
        width = self.max_k + 1
        kmax = max(len(reqs[i].drafts) for i in sampled)
        drafts = np.zeros((len(sampled), kmax), dtype=np.int64)
        for row, i in enumerate(sampled):
            drafts[row, : len(reqs[i].drafts)] = reqs[i].drafts
        ps = [states[i].params for i in sampled]
        u = np.stack([states[i].rng.random(kmax + 1) for i in sampled])               # [S, kmax+1]
        rows = self.ops.from_numpy(np.asarray(sampled, dtype=np.int64), "int64")
        sel = self.ops.index_select(logits, rows, 0)                                     # [S, k+1, V]
        if kmax + 1 < width:
            sel = sel[:, : kmax + 1]
        return self.ops.sampler.verify(sel, drafts, np.asarray([len(reqs[i].drafts) for i in sampled]),
                                       [reqs[i].draft_probs for i in sampled], [p.temperature for p in ps],
                                       [p.top_k for p in ps], [p.top_p for p in ps], u)

    def release(self, request_id: str) -> bool:
        self.requests.pop(request_id, None)
        return self.cache.free(request_id)


def _check_probs(q: np.ndarray, k: int, vocab: int, field: str) -> None:
    """Draft distributions: float [k, vocab], finite, non-negative."""
    if q.dtype.kind != "f":
        raise ValueError(f"{field}: dtype {q.dtype} is not a float type")
    if q.shape != (k, vocab):
        raise ValueError(f"{field}: shape {list(q.shape)}, expected [{k}, {vocab}] (one row per draft)")
    if not np.isfinite(q).all() or (q < 0).any():
        raise ValueError(f"{field}: must be finite and non-negative")
