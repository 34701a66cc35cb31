"""Target-side work: prefill, batched verification and acceptance.

Owns: the target's weights on the device, its KV cache, per-request decoding
state (committed length, last token, sampling params, seed) and the
step kinds the graph registry captures (``verify`` at k+1 positions, ``prefill{W}``
per prompt width W); what
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

Randomness (runtime/random_stream.py): the token at absolute position p is
drawn with the counter-based numbers of (seed, p, purpose), never from a
generator's state. Prefill decides position n = len(prompt); verify row j
decides position n+1+j. A RECOMPUTE resume re-prefills prompt + output[:-1]
with the known last token, so the next verify decides the same positions
with the same numbers as without the reload.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime import acceptance, device_drafts, random_stream, sampling, verify_sampled
from runtime.backends.base import Ops
from runtime.batch_layout import (Row, attend_need, attend_span, context_spans, layout_rows, prefill_graph_widths,
                                  prefill_width)
from core.params import SamplingParams
from runtime.config import CacheConfig, ModelConfig
from runtime.decode_ahead import AheadStats, StepChain
from runtime.graphs import GraphRegistry, InputSpec, StepKind
from runtime.kv_cache import CapacityError, KVCache, UnknownRequestError
from runtime.model import Params, Rope, build_attn_meta, fuse_projections, head_argmax, lm_head, target_forward
from runtime.request_checks import check_batch, check_token_range
from runtime.round_ahead import RoundChain
from runtime.types import PrefillRequest, PrefillResult, VerifyRequest, VerifyResult


@dataclass
class _TargetRequest:
    params: SamplingParams
    seed: int                          # params.seed, or a fresh one chosen at prefill
    last_token: int


def request_seed(params: SamplingParams) -> int:
    """The seed a request's draws are keyed by: its own, or a fresh random one (the round driver
    fills in a seed before prefill, so this fallback serves direct engine callers only)."""
    return random_stream.fresh_seed() if params.seed is None else params.seed


class TargetEngine:
    def __init__(self, ops: Ops, cfg: ModelConfig, params: Params, cache_cfg: CacheConfig,
                 max_k: int, registry: GraphRegistry, decode_ahead: bool | None = None,
                 prefill_widths: tuple[int, ...] = (), prefill_tokens: int = 1024,
                 round_ahead: bool | None = None) -> None:
        self.ops, self.cfg, self.params = ops, cfg, params
        # Target-only greedy rounds queue their next step ahead (runtime/decode_ahead.py), and
        # greedy rounds whose drafts stay on the device their next round (runtime/round_ahead.py).
        # None: on CUDA only (on a CPU the "graph" is the step itself, nothing overlaps).
        on_gpu = ops.device.startswith("cuda")
        self.decode_ahead = on_gpu if decode_ahead is None else decode_ahead
        self.round_ahead = on_gpu if round_ahead is None else round_ahead
        self.device_draft_verifies = 0           # verifies that read their drafts on the device (device_drafts)
        self._fetch_ring = ops.fetch_ring()      # a verify's read-back buffers, reused (torch_host.FetchRing)
        # Checkpoint names (views after fusing: in-place updates go through them)
        # plus the fused q/k/v and gate/up buffers the forward uses.
        fused = fuse_projections(ops, params, [f"model.layers.{i}." for i in range(cfg.num_hidden_layers)])
        self._weights = {**params, **fused}
        self._groups = cfg.num_attention_heads // cfg.num_key_value_heads   # query heads per K/V head
        self.max_k = max_k
        self.cache = KVCache(ops, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                             cache_cfg.max_slots, cache_cfg.max_len)
        self.rope = Rope(ops, cfg, cache_cfg.max_len)
        self.requests: dict[str, _TargetRequest] = {}
        self.registry = registry
        scratch = self.cache.scratch_slot
        self.rounds = RoundChain(registry, f"verify{max_k + 1}", max_k + 1, scratch, cache_cfg.max_len)
        step = ops.compile_step(self._step)
        for width in sorted({max_k + 1, 1}, reverse=True):
            registry.register(StepKind(
                name=f"verify{width}",
                fn=step,
                inputs=(InputSpec("tokens", (width,), "int64", 0),
                        InputSpec("write_slots", (width,), "int64", scratch),
                        InputSpec("positions", (width,), "int64", 0),
                        InputSpec("read_slots", (), "int64", scratch)),
                eager_kwargs=lambda x: {"attend_len": attend_span(x["positions"], self.cache.max_len)},
                spans=context_spans(self.cache.max_len),
                span_of=lambda x: attend_need(x["positions"]),
            ))
        # NOTE: a verify in which no row drafts (target-only requests, adaptive k = 0 rounds, a
        # detached draft) runs the width-1 step, never the max_k + 1 one padded: at batch 8 of
        # the bundled float32 model a padded step was 32 rows, on a slower GEMM than 8 rows'.
        self._verify_kind, self._decode_kind = f"verify{max_k + 1}", "verify1"
        self.steps = StepChain(registry, self._decode_kind, scratch, cache_cfg.max_len)
        self._widths = {"verify1": 1, self._verify_kind: max_k + 1}
        # Prefill graphs: one kind per prompt width, captured at the buckets that fit
        # prefill_tokens; a prompt is padded to the smallest width that holds it. A prefill
        # starts at position 0, so a width-W prompt reads W cache rows: one span, W.
        # NOTE: never through ops.compile_step: each width would be another torch.compile of
        # the forward (runtime.compile's start-up went past 300 s on an H200 with them); the
        # graph alone removes the Python per op, which is what a prefill pays eagerly.
        self._prefill_widths = prefill_graph_widths(prefill_widths, prefill_tokens, self.cache.max_len,
                                                    registry.buckets)
        for w, top in self._prefill_widths.items():
            registry.register(StepKind(
                name=f"prefill{w}",
                fn=lambda _w=w, **kw: self._prefill_step(**kw, attend_len=_w),
                inputs=(InputSpec("tokens", (w,), "int64", 0),
                        InputSpec("write_slots", (w,), "int64", scratch),
                        InputSpec("positions", (w,), "int64", 0),
                        InputSpec("read_slots", (), "int64", scratch),
                        InputSpec("last_index", (), "int64", 0)),
                max_batch=top,
            ))

    # --- the captured step ---------------------------------------------------
    def _step(self, tokens, write_slots, positions, read_slots, attend_len=None):
        """tokens/write_slots/positions [B, T], read_slots [B]
        -> hidden [B, T, d], argmax int64 [B, T], logits float32 [B, T, V] (stay on the device)."""
        # NOTE: with runtime.batch_invariant, every decode and verify (captured, replayed or
        # eager) runs inside ``invariant_steps``: a row's bits then do not depend on the batch.
        with self.ops.invariant_steps():
            meta = build_attn_meta(self.ops, self.rope, write_slots, positions, read_slots,
                                   self.cache.max_len, attend_len or self.cache.max_len, self._groups)
            hidden, normed = target_forward(self.ops, self._weights, self.cfg, tokens, meta, self.cache.layers,
                                            final_norm=True)
            logits, best = head_argmax(self.ops, self._weights, self.cfg, normed)
        return hidden, best, logits

    def _prefill_step(self, tokens, write_slots, positions, read_slots, last_index, attend_len):
        """As ``_step``, but the output head runs on each row's last real position only:
        -> hidden [B, T, d], argmax int64 [B], logits float32 [B, V]."""
        meta = build_attn_meta(self.ops, self.rope, write_slots, positions, read_slots,
                               self.cache.max_len, attend_len, self._groups)
        hidden = target_forward(self.ops, self._weights, self.cfg, tokens, meta, self.cache.layers)
        b, t, d = self.ops.shape(hidden)
        last = self.ops.index_select(self.ops.reshape(hidden, (b * t, d)), last_index, 0)     # [B, d]
        logits = lm_head(self.ops, self._weights, self.cfg, last)
        return hidden, self.ops.argmax(logits, -1), logits

    def _run_prefill(self, arrays: dict[str, np.ndarray], attend_len: int) -> tuple:
        """The prefill forward on host int64 arrays (tokens/write_slots/positions [B, T],
        read_slots/last_index [B]); a tensor-parallel engine hands the same arrays to its other ranks."""
        t = lambda a: self.ops.from_numpy(a, "int64")  # noqa: E731
        # NOTE: plain ops outside the captured graphs (runtime/graphs.py GraphRegistry.run).
        with self.ops.no_grad(), self.ops.plain_ops():
            return self._prefill_step(t(arrays["tokens"]), t(arrays["write_slots"]), t(arrays["positions"]),
                                      t(arrays["read_slots"]), t(arrays["last_index"]), attend_len=attend_len)

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
        if self.ops.batch_invariant and len(reqs) > 1:
            # NOTE: batch-invariant, each prompt is its own forward (padded to a width of its
            # own): its KV rows and first token then do not depend on who was admitted with it.
            # All or nothing, as one batch: a request that fails releases those before it.
            done: list[PrefillResult] = []
            try:
                for r in reqs:
                    done += self.prefill([r])
            except BaseException:
                for res in done:
                    self.release(res.request_id)
                raise
            return done
        self.drop_pending()
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
            hidden, best, logits = self._prefill_rows(rows, max(len(r.prompt) for r in reqs))
            seeds = [request_seed(r.params) for r in reqs]
            sampled = [i for i, r in enumerate(reqs) if r.resume_token is None and not r.params.greedy]
            extra, logits_np = [], None
            if sampled and self.ops.sampler is not None:
                rows = self.ops.from_numpy(np.asarray(sampled, dtype=np.int64), "int64")
                ps = [reqs[i].params for i in sampled]
                sel = self.ops.index_select(logits, rows, 0)
                params = ([p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps])
                # Both modes decide position n = len(prompt) on the device: the inverse-CDF draw
                # (rejection) or the Gumbel-max choice (coupled); the mode is per row.
                extra = [self.ops.sampler.sample(sel, *params, [random_stream.uniform(
                    seeds[i], len(reqs[i].prompt), random_stream.PURPOSE_SAMPLE) for i in sampled])]
                if any(p.coupled for p in ps):
                    extra.append(self.ops.sampler.coupled(sel, *params, [seeds[i] for i in sampled],
                                                          [len(reqs[i].prompt) for i in sampled]))
            elif sampled:
                extra = [logits]
            # One synchronisation: hidden (bf16 as bits), argmax, and the sampled tokens or logits.
            hidden_np, best_np, *rest = self.ops.to_numpy_many([hidden, best, *extra], bf16_bits=True)
            if sampled and self.ops.sampler is not None:
                coupled_np = rest[1] if len(rest) > 1 else None
                drawn = {i: int(coupled_np[row] if reqs[i].params.coupled else rest[0][row])
                         for row, i in enumerate(sampled)}
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
            if r.resume_token is not None:
                first = int(r.resume_token)
            elif r.params.greedy:
                first = int(best_np[i])
            elif logits_np is not None:
                first = self._sample(logits_np[i], r.params, seeds[i], n)
            else:
                first = drawn[i]
            self.requests[r.request_id] = _TargetRequest(r.params, seeds[i], first)
            out.append(PrefillResult(r.request_id, first, hidden_np[i, :n].copy()))
        return out

    def _prefill_rows(self, rows: list[Row], width: int) -> tuple:
        """The prefill forward of ``rows`` (the longest ``width`` tokens): a prefill graph's
        replay when one holds them (rows padded to its width), else eager at their own width."""
        w = prefill_width(self._prefill_widths, width, len(rows))
        graph = w is not None and self.registry.can_replay(f"prefill{w}", len(rows))
        lay = layout_rows(rows, w if graph else width, self.cache.scratch_slot, self.cache.max_len)
        arrays = {"tokens": lay.tokens, "write_slots": lay.write_slots, "positions": lay.positions,
                  "read_slots": lay.read_slots, "last_index": lay.last_index}
        if graph:
            return self.registry.run(f"prefill{w}", arrays)[0]
        return self._run_prefill(arrays, attend_span(lay.positions, self.cache.max_len))

    def _sample(self, logits: np.ndarray, params: SamplingParams, seed: int, position: int) -> int:
        """The numpy path's token at ``position`` (logits [V])."""
        if params.greedy:
            return sampling.greedy_token(logits)
        probs = sampling.process_logits(logits, params.temperature, params.top_k, params.top_p)
        if params.coupled:
            return sampling.coupled_token(probs, random_stream.gumbel(seed, position, probs.shape[-1]))
        return sampling.sample_token(probs, random_stream.uniform(seed, position, random_stream.PURPOSE_SAMPLE))

    def verify(self, reqs: list[VerifyRequest]) -> list[VerifyResult]:
        """One forward over [t_n, d_1..d_k] per request, then accept (DESIGN step 3-5)."""
        on_device = None                   # (drafts tensor, its row of each request) when they stay there
        if any(r.device is not None for r in reqs):
            reqs, on_device = device_drafts.chain_or_fetch(
                self.ops, reqs, lambda rid: self.requests[rid].params)
            self.device_draft_verifies += on_device is not None
        rows, kvs, states, sampled, coupled = [], [], [], [], []
        need = 1                                   # cache rows the step reads: max position + 1
        drafted = want_hidden = False
        # One pass over the batch (this runs every round): each request's cache entry and state,
        # its row, whether it samples (device or numpy rejection) or couples its tokens, and
        # whether it wants its hidden rows.
        for i, r in enumerate(reqs):
            kv = self.cache.get(r.request_id)
            req = self.requests[r.request_id]
            k = len(r.drafts)
            if k > self.max_k:
                raise ValueError(f"drafts: {k} drafts exceed max_k={self.max_k}")
            self.cache.check_fits(r.request_id, kv.length + k + 1)
            tokens = np.empty(k + 1, dtype=np.int64)                           # [t_n, d_1..d_k]
            tokens[0] = req.last_token
            tokens[1:] = r.drafts
            rows.append(Row(kv.slot, kv.length, tokens))
            kvs.append(kv)
            states.append(req)
            need = max(need, kv.length + k + 1)
            drafted = drafted or k > 0
            want_hidden = want_hidden or r.hidden
            if req.params.coupled:
                coupled.append(i)
            elif not req.params.greedy:
                sampled.append(i)
        ids = tuple(r.request_id for r in reqs)
        chained = self.rounds.take(ids, rows, reqs, on_device)
        if chained is not None:
            self.steps.drop()
        stepped = None if chained is not None else self.steps.take(ids, tuple(row.start for row in rows), drafted)
        tokens_dev = None                          # the verify's token rows on the device (drafts there)
        if chained is not None:
            hidden, best, logits = chained.outputs     # queued by the previous verify (runtime/round_ahead.py)
            tokens_dev, replayed = chained.tokens, True
        elif stepped is not None:
            hidden, best, logits = stepped                 # queued by the previous verify (no drafts: matches)
            replayed = True
        else:
            kind = self._verify_kind if drafted else self._decode_kind
            lay = layout_rows(rows, self._widths[kind], self.cache.scratch_slot, self.cache.max_len)
            tokens = lay.tokens if on_device is None else device_drafts.verify_tokens(self.ops, lay.tokens, *on_device)
            tokens_dev = None if on_device is None else tokens
            (hidden, best, logits), replayed = self.registry.run(kind, {
                "tokens": tokens, "write_slots": lay.write_slots,
                "positions": lay.positions, "read_slots": lay.read_slots}, need=need)
        starts = [kv.length + 1 for kv in kvs]                # the position row 0 decides
        extra, device_acc, device_coupled, logits_np = [], None, None, None
        sample_on_device = self.ops.sampler is not None
        if sampled and sample_on_device:
            extra += list(verify_sampled.rejection_on_device(self.ops, reqs, states, starts, sampled, logits))
        if coupled and sample_on_device:
            extra.append(verify_sampled.coupled_on_device(self.ops, reqs, states, starts, coupled, logits))
        if (sampled or coupled) and not sample_on_device:
            extra = [logits]
        # NOTE: one synchronisation per verify, after everything is enqueued:
        # hidden [B, k+1, d] (bf16 as bits; only when a request asks for its rows),
        # argmax [B, k+1], and the sampled rows' (a, token) and the coupled rows'
        # choices [C, k+1] from the device sampler, or the logits for numpy; last,
        # the drafts the draft left on the device (the round's only synchronisation).
        # A target-only greedy batch queues its next step after these copies and
        # before the wait.
        tail = [] if on_device is None else [on_device[0]]
        fetch = self.ops.to_numpy_many_async([hidden, best, *extra, *tail] if want_hidden else [best, *extra, *tail],
                                             bf16_bits=True, ring=self._fetch_ring)
        if replayed and self.decode_ahead and not (drafted or sampled or coupled) and all(r.chain for r in reqs):
            self.steps.queue(ids, rows, best)
        # With the drafts' source able to queue a propose (the draft in this process), a greedy
        # round of one k queues the next round now (runtime/round_ahead.py), behind these copies.
        k0 = len(reqs[0].drafts)
        source = reqs[0].device.source if on_device is not None and reqs[0].device is not None else None
        chain = (source is not None and self.round_ahead and replayed and k0 >= 1 and not (sampled or coupled)
                 and all(len(r.drafts) == k0 and r.hidden and r.chain for r in reqs) and self.rounds.allow())
        queued = self.rounds.queue(ids, rows, tokens_dev, hidden, best, k0, source) if chain else None
        got = fetch()
        drafts_np = None
        if on_device is not None:
            *got, drafts_np = got
        hidden_np, (best_np, *rest) = (got[0], got[1:]) if want_hidden else (None, got)
        if sample_on_device:
            if sampled:
                device_acc = {i: (int(a), int(tok)) for i, a, tok in zip(sampled, rest[0], rest[1])}
            if coupled:
                device_coupled = dict(zip(coupled, rest[-1]))
        elif sampled or coupled:
            logits_np = rest[0]                                            # [B, k+1, V]
        # Greedy rows of a batch: every row's accepted count in one pass (row i emits
        # best[i, : a_i + 1]; the layout's tokens are [t_n, d_1..d_k, padding] per row). A lone
        # request takes the per-row rule: the same result, fewer numpy calls for one row. Drafts
        # that stayed on the device are counted from their host copy, at any batch: only greedy
        # rows draft in such a batch (device_drafts.chain_or_fetch), so no row reads ``r.drafts``.
        if drafts_np is not None:
            ks = np.fromiter((len(r.drafts) for r in reqs), dtype=np.int64, count=len(reqs))
            greedy_a = device_drafts.accepted(drafts_np, on_device[1], ks, best_np)
        else:
            greedy_a = (acceptance.accepted_greedy_rows(lay.tokens[:, 1:], lay.lengths - 1, best_np)
                        if drafted and len(reqs) > 1 else None)
        # Per row below: Python lists of the argmax rows (one conversion for the batch), and the
        # hidden rows as views of one copy out of the fetch ring's buffer (which a later fetch reuses).
        best_rows = best_np.tolist() if greedy_a is not None else None
        hidden_kept = hidden_np.copy() if hidden_np is not None else None
        out = []
        for i, (r, req) in enumerate(zip(reqs, states)):
            k = len(r.drafts)
            if req.params.greedy and greedy_a is not None:
                a = int(greedy_a[i])
                acc = acceptance.Acceptance(a, tuple(best_rows[i][: a + 1]))
            elif req.params.greedy:
                acc = acceptance.accept_greedy_ids(r.drafts, best_np[i, : k + 1])
            elif device_coupled is not None and i in device_coupled:
                acc = acceptance.accept_greedy_ids(list(r.drafts), device_coupled[i][: k + 1])
            elif device_acc is not None and i in device_acc:
                a, tok = device_acc[i]
                acc = acceptance.Acceptance(a, tuple(int(d) for d in r.drafts[:a]) + (tok,))
            else:
                p = sampling.process_logits(logits_np[i, : k + 1], req.params.temperature, req.params.top_k,
                                            req.params.top_p)
                pos = starts[i] + np.arange(k + 1)                         # positions rows 0..k decide
                if req.params.coupled:
                    noise = random_stream.gumbel(req.seed, pos, p.shape[-1])   # [k+1, V]
                    acc = acceptance.accept_coupled(list(r.drafts), p, noise)
                else:
                    acc = acceptance.accept_rejection(
                        list(r.drafts), r.draft_probs, p,
                        random_stream.uniforms(req.seed, pos[:k], random_stream.PURPOSE_ACCEPT),
                        random_stream.uniforms(req.seed, pos, random_stream.PURPOSE_SAMPLE))
            a = acc.num_accepted
            # NOTE: commit = length update. Rows n..n+a now hold t_n, d_1..d_a
            # (all committed); rows past n+a are stale and get overwritten.
            kvs[i].length += a + 1
            req.last_token = acc.tokens[-1]
            out.append(VerifyResult(r.request_id, a, tuple(acc.tokens), hidden_kept[i, : a + 1] if r.hidden else None))
        if queued is not None:
            # NOTE: what the host committed; the draft takes its queued propose only if the counts
            # the device used agree (``NextPropose.matches``), else it proposes afresh and the
            # queued verify, whose drafts those are not, is dropped.
            queued.settle([kv.length for kv in kvs], [res.tokens for res in out])
            self.rounds.pending = queued
        return out

    @property
    def ahead_stats(self) -> AheadStats:
        """Target-only steps queued ahead (runtime/decode_ahead.py): launched / used / dropped."""
        return self.steps.stats

    @property
    def round_stats(self) -> AheadStats:
        """Rounds queued ahead (runtime/round_ahead.py): launched / used / dropped."""
        return self.rounds.stats

    def drop_pending(self) -> None:
        """Forget a step or round queued ahead: the engine's state changes (prefill, release, new weights)."""
        self.steps.drop()
        self.rounds.drop()

    def release(self, request_id: str) -> bool:
        self.drop_pending()
        self.rounds.forget(request_id)
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
