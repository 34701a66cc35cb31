"""Draft-side work: the MTP head's catch-up pass and k-1 single-token substeps.

Owns: the MTP weights plus the draft's own copy of the target's embedding,
final norm and output head; the draft KV cache; per-request draft state
(pairs written, sampling params, seed); the step kinds the graph registry
captures: ``catchup`` (k+1 padded positions), the head passes of a longer
catch-up (``HEAD_PASS_WIDTHS`` x (k+1), ``_catch_up_head``), ``substep`` (1) and, for a
whole greedy propose in one graph, ``propose{k}`` (runtime/fused_propose.py),
and ``prefill{W}`` per prompt width W (a prefill's pairs from position 0);
what each of its requests must satisfy (``check_prefill`` / ``check_propose``,
run by the worker before a batch; one bad item never fails the others). Ahead
items (continuing a proposal's kept end) run through runtime/draft_ahead.py.

Must not know: gRPC, lifecycle states, scheduling, the target's layers.

Hidden rows come in as float32 or as uint16 bf16 bit patterns (see
``runtime/types.py``); they are decoded only here, on the device.

Greedy drafts stay on the device: each substep's argmax is fed to the next
substep as a device tensor, and one host synchronisation per ``propose``
brings all k drafts back. With graphs live, a greedy propose whose catch-up
fits the narrow width and whose steps share one context span replays one
``propose{k}`` graph (catch-up, argmax and k-1 substeps); otherwise the
catch-up graph and k-1 substep graphs run. Sampled drafts
(``draft_sampling``) and coupled drafts (``sampling_mode`` "coupled") need q
on the host, so that path reads the logits back after every substep (runtime/draft_sampled.py).

Randomness (runtime/random_stream.py): the draft at absolute token position
p uses the draws of (seed, p, purpose): PURPOSE_DRAFT for a sampled draft,
and for a coupled draft the same Gumbel noise the target uses at p, so that
d = argmax(log q + g) equals the target's argmax(log p + g) whenever q's and
p's perturbed maxima agree. The draft's pair count P after a catch-up covers
t_1..t_P, so draft d_s of a proposal sits at position P + s.

Positions: the pair (h_i, t_{i+1}) lives at draft position i. A request has
``pairs`` correctly written positions 0..pairs-1 (true target hidden states).
Substep s of a round writes position pairs+s-1 from a guessed hidden state;
the next catch-up overwrites it (DESIGN § The speculative round, steps 1-2).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.backends.base import Ops
from runtime.batch_layout import (Row, attend_need, attend_span, context_spans, layout_rows, prefill_graph_widths,
                                  prefill_width, single_token_places)
from core.params import SamplingParams
from runtime.config import CacheConfig, ModelConfig
from runtime.draft_ahead import KeptEnds
from runtime.draft_sampled import SampledDrafts
from runtime.fused_propose import FusedPropose, propose_kind_name, substep_places
from runtime.graphs import GraphRegistry, InputSpec, StepKind
from runtime.kv_cache import CapacityError, KVCache, UnknownRequestError
from runtime.model import MTP_LAYER_PREFIX, Params, Rope, build_attn_meta, fuse_projections, lm_head, mtp_forward
from runtime.request_checks import check_batch, check_hidden, check_token_range
from runtime.round_ahead import DraftChain, NextPropose
from runtime.target_engine import request_seed
from runtime.types import DeviceDrafts, DraftPrefillRequest, Proposal, ProposeRequest, hidden_float32

SUBSTEP = "substep"
HEAD_PASS_WIDTHS = 4      # a head pass of a long catch-up covers this many catch-up widths (max_k + 1 each)


@dataclass
class _DraftRequest:
    params: SamplingParams
    seed: int

    @property
    def on_host(self) -> bool:
        """Drafts made on the host from q: sampled (draft_sampling) or coupled (Gumbel-max)."""
        return self.params.coupled or (self.params.draft_sampling and not self.params.greedy)


@functools.lru_cache(maxsize=None)
def _zeros(k: int) -> np.ndarray:
    """A read-only int64 [k] of zeros: the drafts of a proposal whose drafts stay on the device
    (their count only), one array per k shared by every such proposal."""
    z = np.zeros(k, dtype=np.int64)
    z.flags.writeable = False
    return z


class DraftEngine:
    # The round driver's port question (``run_round``): may greedy drafts stay on the device for
    # the verify? Only an owner that runs the verify in this process on this device sets it
    # (``runtime.engine.SpecEngine``; a service's port is ``rounds.local_draft.LocalDraft``).
    drafts_on_device = False

    def __init__(self, ops: Ops, cfg: ModelConfig, params: Params, cache_cfg: CacheConfig,
                 max_k: int, registry: GraphRegistry, ahead_drafting: bool = False,
                 fused_propose: bool = True, prefill_widths: tuple[int, ...] = (), prefill_tokens: int = 1024,
                 round_ahead: bool = False) -> None:
        self.ops, self.cfg, self.params = ops, cfg, params
        # As the target: checkpoint names as views, plus the fused buffers the forward uses.
        fused = fuse_projections(ops, params, [MTP_LAYER_PREFIX])
        self._weights = {**params, **fused}
        self._groups = cfg.num_attention_heads // cfg.num_key_value_heads   # query heads per K/V head
        self.max_k = max_k
        self.cache = KVCache(ops, 1, cfg.num_key_value_heads, cfg.head_dim, cache_cfg.max_slots, cache_cfg.max_len)
        self.rope = Rope(ops, cfg, cache_cfg.max_len)
        self.requests: dict[str, _DraftRequest] = {}
        self.registry = registry
        self._fetch_ring = ops.fetch_ring()      # a propose's read-back buffer, reused (torch_host.FetchRing)
        self.catchup_width = max_k + 1
        self._catchup_kind = f"catchup{self.catchup_width}"
        self._compiled = ops.compile_step(self._step)
        # With ahead drafting, the catch-up after a round whose drafts came from an ahead
        # call carries two rounds of pairs: a second captured width keeps it off the eager path.
        self._catchup_wide = f"catchup{2 * self.catchup_width}" if ahead_drafting else None
        # A catch-up longer than those (the draft sat out target-only rounds) writes its head in
        # passes of a wider graph first (_catch_up_head): HEAD_PASS_WIDTHS catch-up widths a pass.
        self._head_width = HEAD_PASS_WIDTHS * self.catchup_width
        self._catchup_head = f"catchup{self._head_width}"
        kinds = [(self._catchup_kind, self.catchup_width), (self._catchup_head, self._head_width), (SUBSTEP, 1)]
        if self._catchup_wide is not None:
            kinds.insert(1, (self._catchup_wide, 2 * self.catchup_width))
        for name, width in kinds:
            registry.register(self._kind(name, width))
        # Prefill graphs (as the target's, runtime/target_engine.py): a prompt's pairs start at
        # position 0, so a width-W prefill reads W cache rows: one span, W.
        self._prefill_widths = prefill_graph_widths(prefill_widths, prefill_tokens, self.cache.max_len,
                                                    registry.buckets)
        for w, top in self._prefill_widths.items():
            # NOTE: the plain step, never the compiled one (as the target's prefill kinds).
            registry.register(self._kind(f"prefill{w}", w, spans=(w,), max_batch=top, fn=self._step))
        # NOTE: registered after catch-up and substep: capture_all captures kinds in this
        # order per bucket, and the propose kinds' one warm-up relies on those steps
        # having run at the same shapes first (runtime/fused_propose.py).
        self._fused = (FusedPropose(ops, self._compiled, cfg.hidden_size, self.catchup_width, max_k,
                                    self.cache.scratch_slot, cache_cfg.max_len, context_spans(cache_cfg.max_len))
                       if fused_propose and max_k >= 1 else None)
        for kind in self._fused.kinds() if self._fused is not None else ():
            registry.register(kind)
        # Rounds queued ahead by a target in this process (runtime/round_ahead.py): its ``chain{k}``
        # kinds (the propose{k} step behind the catch-up they compute on the device) and the
        # propose queued for the next round.
        self.chain = (DraftChain(ops, registry, self._fused, self.cache, self.catchup_width, cfg.hidden_size, max_k)
                      if round_ahead and self._fused is not None else None)
        # Ahead drafting: the end of each request's last proposal (runtime/draft_ahead.py).
        self._ends = KeptEnds(ops, cache_cfg.max_slots, cfg.hidden_size)
        # Sampled or coupled drafts: q on the host after every substep (runtime/draft_sampled.py).
        self._sampled = SampledDrafts(ops, registry, self.cache, cfg.hidden_size, SUBSTEP)
        self.fused_proposes = 0          # propose calls that replayed one propose{k} graph

    def _kind(self, name: str, width: int, spans: tuple[int, ...] | None = None,
              max_batch: int | None = None, fn: Any = None) -> StepKind:
        scratch = self.cache.scratch_slot
        return StepKind(
            name=name,
            fn=self._compiled if fn is None else fn,
            inputs=(InputSpec("prev_hidden", (width, self.cfg.hidden_size), "compute", 0.0),
                    InputSpec("tokens", (width,), "int64", 0),
                    InputSpec("write_slots", (width,), "int64", scratch),
                    InputSpec("positions", (width,), "int64", 0),
                    InputSpec("read_slots", (), "int64", scratch),
                    InputSpec("last_index", (), "int64", 0)),
            eager_kwargs=lambda x: {"attend_len": attend_span(x["positions"], self.cache.max_len)},
            spans=context_spans(self.cache.max_len) if spans is None else spans,
            span_of=lambda x: attend_need(x["positions"]),
            max_batch=max_batch,
        )

    # --- the captured step ---------------------------------------------------
    def _step(self, prev_hidden, tokens, write_slots, positions, read_slots, last_index, attend_len=None):
        """prev_hidden [B, T, d], tokens/write_slots/positions [B, T], read_slots/last_index [B]
        -> g_last [B, d] (MTP output hidden at each row's last real pair), logits_last [B, V]."""
        b, t = self.ops.shape(tokens)
        meta = build_attn_meta(self.ops, self.rope, write_slots, positions, read_slots,
                               self.cache.max_len, attend_len or self.cache.max_len, self._groups)
        g = mtp_forward(self.ops, self._weights, self.cfg, prev_hidden, tokens, meta, self.cache.layers[0])
        g_last = self.ops.index_select(self.ops.reshape(g, (b * t, self.cfg.hidden_size)), last_index, 0)
        return g_last, lm_head(self.ops, self._weights, self.cfg, g_last)

    def _run_rows(self, kind: str | None, rows: list[Row], hidden: np.ndarray, width: int):
        lay = layout_rows(rows, width, self.cache.scratch_slot, self.cache.max_len)
        inputs = {"prev_hidden": hidden, "tokens": lay.tokens, "write_slots": lay.write_slots,
                  "positions": lay.positions, "read_slots": lay.read_slots, "last_index": lay.last_index}
        if kind is None:  # wider than any captured kind (prefill, recovery): eager
            t = {k: self.ops.from_numpy(v, None if k == "prev_hidden" else "int64") for k, v in inputs.items()}
            # NOTE: plain ops outside the captured graphs (runtime/graphs.py GraphRegistry.run).
            with self.ops.no_grad(), self.ops.plain_ops():
                return self._step(**t, attend_len=attend_span(lay.positions, self.cache.max_len))
        return self.registry.run(kind, inputs)[0]

    # --- requests --------------------------------------------------------------
    # --- what a request must satisfy (run before the batch; a refused item never joins it) ----
    def check_prefill(self, items: list[tuple[int, DraftPrefillRequest]]
                      ) -> tuple[list[tuple[int, DraftPrefillRequest]], dict[int, Exception]]:
        def one(i: int, it: DraftPrefillRequest, admitted: int) -> DraftPrefillRequest:
            cfg = self.cfg
            if self.cache.has(it.request_id):
                raise ValueError(f"items[{i}].request_id: {it.request_id!r} is already active here")
            check_token_range(it.tokens, cfg.vocab_size, f"items[{i}].tokens")
            if len(it.tokens) == 0 and it.hidden.size == 0:   # one-token prompt: no pairs yet
                it = dataclasses.replace(it, hidden=np.zeros((0, cfg.hidden_size), dtype=np.float32))
            check_hidden(it.hidden, len(it.tokens), cfg.hidden_size, f"items[{i}].hidden")
            need = len(it.tokens) + self.max_k + 1
            if need > self.cache.max_len:
                raise CapacityError(f"items[{i}].tokens: {len(it.tokens)} prompt pairs + max_k "
                                    f"{self.max_k} + 1 need {need} draft cache positions; "
                                    f"cache.max_len is {self.cache.max_len}")
            if admitted >= self.cache.free_slots:
                raise CapacityError(f"items[{i}]: no free draft cache slot "
                                    f"({self.cache.max_slots} slots, all in use)")
            return it

        return check_batch(items, one)

    def check_propose(self, items: list[tuple[int, ProposeRequest]]
                      ) -> tuple[list[tuple[int, ProposeRequest]], dict[int, Exception]]:
        # NOTE: a batch the queued propose answers (round_ahead.NextPropose.matches: the very
        # requests, pair counts, k and catch-up tokens the device's round computed from, and its
        # counts the host's) uses nothing of its items beyond what that match compared: its
        # tokens equal committed ones and its hidden rows are not read. Nothing else to check.
        if self.chain is not None and self.chain.answers([it for _, it in items]):
            return list(items), {}

        def one(i: int, it: ProposeRequest, _admitted: int) -> ProposeRequest:
            if not self.cache.has(it.request_id):
                raise UnknownRequestError(f"items[{i}].request_id: {it.request_id!r} is unknown here "
                                          "(never prefilled, or already released)")
            if it.ahead:                 # ahead items: k up to max_k + 1, continuing a kept proposal
                self.check_ahead(it.request_id, it.k, f"items[{i}]")
                return it
            held = self.cache.get(it.request_id).length
            if it.start_position != held:
                raise ValueError(f"items[{i}].start_position: {it.start_position} != {held} pairs held "
                                 f"for request {it.request_id!r} (lost or repeated round?)")
            if not 1 <= it.k <= self.max_k:
                raise ValueError(f"items[{i}].k: {it.k} is out of range [1, {self.max_k}]")
            if len(it.tokens) < 1:
                raise ValueError(f"items[{i}].tokens: at least one new pair is required")
            check_token_range(it.tokens, self.cfg.vocab_size, f"items[{i}].tokens")
            check_hidden(it.hidden, len(it.tokens), self.cfg.hidden_size, f"items[{i}].hidden")
            need = held + len(it.tokens) + it.k
            if need > self.cache.max_len:
                raise CapacityError(f"items[{i}]: request {it.request_id!r} needs {need} draft cache "
                                    f"positions; cache.max_len is {self.cache.max_len}")
            return it

        return check_batch(items, one)

    def prefill(self, reqs: list[DraftPrefillRequest]) -> None:
        """Allocate each request and write its prompt pairs (h_0,t_1)..(h_{m-1},t_m)."""
        self.drop_pending()
        for r in reqs:
            if self.cache.has(r.request_id):
                raise ValueError(f"request_id {r.request_id!r} is already active")
            self.cache.check_fits(r.request_id, len(r.tokens) + self.max_k + 1)
            if r.hidden.shape != (len(r.tokens), self.cfg.hidden_size):
                raise ValueError(f"hidden: shape {list(r.hidden.shape)} != [{len(r.tokens)}, {self.cfg.hidden_size}]")
        if self.cache.free_slots < len(reqs):
            raise CapacityError(f"draft KV cache full: {len(reqs)} requests need slots, {self.cache.free_slots} free")
        states = {r.request_id: self.cache.allocate(r.request_id) for r in reqs}
        for r in reqs:
            self.requests[r.request_id] = _DraftRequest(r.params, request_seed(r.params))
        body = [r for r in reqs if len(r.tokens) > 0]
        if body:
            try:
                self._catch_up(body, [0] * len(body), [states[r.request_id].slot for r in body], prefill=True)
            except Exception:
                for r in reqs:
                    self.release(r.request_id)
                raise
        for r in body:
            states[r.request_id].length = len(r.tokens)

    def _catch_up(self, reqs, starts: list[int], slots: list[int], prefill: bool = False):
        """Write each request's new pairs from ``starts``; a prefill (every start 0) wider than the
        catch-up kinds replays a prefill graph when one holds it."""
        kind, width = self._catchup_step(max(len(r.tokens) for r in reqs), len(reqs), prefill)
        return self._run_rows(kind, *self._catchup_rows(reqs, starts, slots, width), width)

    def _catchup_step(self, longest: int, batch: int, prefill: bool) -> tuple[str | None, int]:
        """(step kind, width) of a catch-up whose longest row has ``longest`` pairs; kind None: eager."""
        if longest <= self.catchup_width:
            return self._catchup_kind, self.catchup_width
        if self._catchup_wide is not None and longest <= 2 * self.catchup_width:
            return self._catchup_wide, 2 * self.catchup_width
        wide = prefill_width(self._prefill_widths, longest, batch) if prefill else None
        if wide is not None and self.registry.can_replay(f"prefill{wide}", batch, wide):
            return f"prefill{wide}", wide
        return None, longest

    def _catchup_rows(self, reqs, starts: list[int], slots: list[int], width: int) -> tuple[list[Row], np.ndarray]:
        """Each request's new pairs as a Row, and their hidden rows padded to [B, width, d]."""
        rows = [Row(slot, start, np.asarray(r.tokens, dtype=np.int64)) for r, start, slot in zip(reqs, starts, slots)]
        # bf16 bits travel to the device as bits when the draft computes in bf16; otherwise float32.
        bits = self.ops.dtype == "bfloat16" and all(np.asarray(r.hidden).dtype == np.uint16 for r in reqs)
        hidden = np.zeros((len(reqs), width, self.cfg.hidden_size), dtype=np.uint16 if bits else np.float32)  # [B, W, d]
        for i, r in enumerate(reqs):
            hidden[i, : len(r.tokens)] = r.hidden if bits else hidden_float32(r.hidden)
        return rows, hidden

    def propose(self, reqs: list[ProposeRequest]) -> list[Proposal]:
        """Catch-up over each request's new pairs, then k-1 substeps on the MTP's own hidden state.
        Ahead items (``ProposeRequest.ahead``) continue from their last proposal instead."""
        nxt = self.chain.take(reqs) if self.chain is not None else None
        if nxt is not None:
            return self._take_next(nxt, reqs)
        ahead = [r for r in reqs if r.ahead]
        if ahead:
            normal = [r for r in reqs if not r.ahead]
            by_id = {p.request_id: p for p in (self.propose(normal) if normal else []) + self._ahead(ahead)}
            return [by_id[r.request_id] for r in reqs]
        for r in reqs:
            self._ends.forget(r.request_id)              # a new proposal: the old end is gone
        kvs, slots, starts, host_side = [], [], [], False
        for r in reqs:
            state = self.cache.get(r.request_id)
            if r.start_position != state.length:
                raise ValueError(f"start_position: {r.start_position} != {state.length} pairs held "
                                 f"for request {r.request_id!r}")
            if not 1 <= r.k <= self.max_k:
                raise ValueError(f"k: {r.k} is out of range [1, {self.max_k}]")
            if len(r.tokens) < 1 or r.hidden.shape != (len(r.tokens), self.cfg.hidden_size):
                raise ValueError(f"hidden: shape {list(r.hidden.shape)} does not match {len(r.tokens)} new tokens "
                                 f"of width {self.cfg.hidden_size}")
            self.cache.check_fits(r.request_id, state.length + len(r.tokens) + r.k)
            kvs.append(state)
            slots.append(state.slot)
            starts.append(state.length)
            host_side = host_side or self.requests[r.request_id].on_host
        reqs, starts = self._catch_up_head(reqs, starts, slots)
        if self._fused is not None and not host_side:
            kmax, longest, end, need = 0, 0, 0, 0
            for st, r in zip(starts, reqs):
                m = len(r.tokens)
                kmax, longest, end = max(kmax, r.k), max(longest, m), max(end, st + m)
                need = max(need, st + m + r.k - 1)   # cache rows read: the last substep sits at start + m + k - 2
            kind = propose_kind_name(kmax)
            if (longest <= self.catchup_width and self._fused.one_span(end, need)
                    and self.registry.can_replay(kind, len(reqs), need)):
                return self._propose_fused(reqs, kvs, slots, starts, kind, need, kmax)
        g, logits = self._catch_up(reqs, starts, slots)
        for r, state in zip(reqs, kvs):
            state.length += len(r.tokens)
        if not host_side:
            return self._propose_greedy(reqs, slots, g, logits)
        return self._sampled.propose(self.requests, reqs, slots, g, logits)

    def _catch_up_head(self, reqs: list[ProposeRequest], starts: list[int], slots: list[int]
                       ) -> tuple[list[ProposeRequest], list[int]]:
        """A catch-up wider than the catch-up graphs (the draft sat out rounds: adaptive k's
        target-only stretches, a re-attach) writes all but each request's last
        ``catchup_width`` pairs first, in passes of the widest catch-up graph that replays;
        -> the requests cut to those last pairs, and their starts (the cache counts them).

        Why: such a catch-up ran as one eager pass on the plain ops, 3-5 ms on an H200 for the
        bundled model's ~16-128 pairs of a probe after a target-only stretch (once 52 ms: a new
        eager shape), where a drafting round's whole draft takes ~0.5 ms. A pass writes its
        pairs' KV and attends over the rows before them, which the earlier passes wrote: the
        same causal computation as one wide pass, summed in other shapes (drafts only; the
        target verifies every token). Passes use the widest catch-up graph that replays (the
        head kind, HEAD_PASS_WIDTHS catch-up widths); without graphs nothing changes: one eager
        pass."""
        w = self.catchup_width
        heads = [max(len(r.tokens) - w, 0) for r in reqs]
        cut = [i for i, h in enumerate(heads) if h > 0]
        if not cut:
            return reqs, starts
        need = max(starts[i] + heads[i] for i in cut)
        kinds = [(self._catchup_head, self._head_width)]
        if self._catchup_wide is not None:
            kinds.append((self._catchup_wide, 2 * w))
        step = next(((k, kw) for k, kw in kinds + [(self._catchup_kind, w)]
                     if self.registry.can_replay(k, len(cut), need)), None)
        if step is None:
            return reqs, starts
        kind, width = step
        for j in range(0, max(heads), width):
            part = [i for i in cut if heads[i] > j]
            chunk = [dataclasses.replace(reqs[i], tokens=reqs[i].tokens[j:min(j + width, heads[i])],
                                         hidden=reqs[i].hidden[j:min(j + width, heads[i])]) for i in part]
            self._run_rows(kind, *self._catchup_rows(chunk, [starts[i] + j for i in part], [slots[i] for i in part],
                                                     width), width)
        for i in cut:
            self.cache.get(reqs[i].request_id).length += heads[i]
        return ([dataclasses.replace(r, start_position=r.start_position + h, tokens=r.tokens[h:], hidden=r.hidden[h:])
                 if h else r for r, h in zip(reqs, heads)], [st + h for st, h in zip(starts, heads)])

    def _propose_greedy(self, reqs: list[ProposeRequest], slots: list[int], g, logits) -> list[Proposal]:
        """Every row drafts greedily: argmax fed back on the device, one host sync at the end."""
        kmax = max(r.k for r in reqs)
        b = len(reqs)
        tok = self.ops.argmax(logits, -1)                                # [B] d_1 (device)
        drafts = [tok]
        for s in range(1, kmax):
            # Substep s: pair (g_s, d_s) at position pairs + s - 1. A row that
            # already has its k drafts runs on the scratch slot at position 0
            # (its outputs are dropped): shapes stay fixed, no live KV is touched.
            g, tok = self._greedy_substep(g, tok, [(slots[i], self.cache.get(r.request_id).length + s - 1)
                                                   if r.k > s else None for i, r in enumerate(reqs)])
            drafts.append(tok)
        # Rows that ran all kmax substeps end here; their end is kept for ahead drafting.
        keep = [i for i, r in enumerate(reqs) if r.keep_tail and r.k == kmax]
        if keep:
            self._ends.keep([reqs[i].request_id for i in keep], [slots[i] for i in keep], g, tok, keep,
                           [self.cache.get(reqs[i].request_id).length + kmax - 1 for i in keep])
        # NOTE: the only host synchronisation of a greedy propose (none when the drafts stay on the device).
        return self._proposals(reqs, self.ops.cat([self.ops.reshape(t, (b, 1)) for t in drafts], 1))

    def _propose_fused(self, reqs: list[ProposeRequest], kvs: list, slots: list[int], starts: list[int], kind: str,
                       need: int, kmax: int) -> list[Proposal]:
        """Every row greedy, graphs live: one ``propose{kmax}`` replay, one host sync. ``kvs``:
        each request's cache entry."""
        rows, hidden = self._catchup_rows(reqs, starts, slots, self.catchup_width)
        lay = layout_rows(rows, self.catchup_width, self.cache.scratch_slot, self.cache.max_len)
        pairs = [st + len(r.tokens) for st, r in zip(starts, reqs)]
        inputs = {"prev_hidden": hidden, "tokens": lay.tokens, "write_slots": lay.write_slots,
                  "positions": lay.positions, "read_slots": lay.read_slots, "last_index": lay.last_index}
        if kmax > 1:
            inputs["sub_write_slots"], inputs["sub_positions"] = substep_places(
                slots, pairs, [r.k for r in reqs], kmax, self.cache.scratch_slot)      # [B, kmax-1] each
        (drafts, g, tok), _ = self.registry.run(kind, inputs, need=need)            # [B, kmax], [B, d], [B]
        self.fused_proposes += 1
        for state, p in zip(kvs, pairs):
            state.length = p
        # Rows that ran all kmax substeps end here; their end is kept for ahead drafting.
        keep = [i for i, r in enumerate(reqs) if r.keep_tail and r.k == kmax]
        if keep:
            self._ends.keep([reqs[i].request_id for i in keep], [slots[i] for i in keep], g, tok, keep,
                           [pairs[i] + kmax - 1 for i in keep])
        # NOTE: the only host synchronisation of a fused propose (none when the drafts stay on the device).
        return self._proposals(reqs, drafts)

    def _proposals(self, reqs: list[ProposeRequest], drafts) -> list[Proposal]:
        """Greedy drafts [B, kmax] (device) to the host in the engine's read-back ring, each
        request's first k as its proposal (copied: the ring's arrays are reused). When every
        request lets them stay on the device (``ProposeRequest.on_device``), they stay there
        instead: a copy of them that no later step overwrites, no host synchronisation."""
        if all(r.on_device for r in reqs):
            # NOTE: the copy is queued right behind the replay, before this call returns: the
            # next replay of the propose graph rewrites ``drafts`` (a graph's static output)
            # only after it, in stream order.
            kept = self.ops.clone(drafts)
            return [Proposal(r.request_id, _zeros(r.k), None, DeviceDrafts(kept, i, self)) for i, r in enumerate(reqs)]
        (all_np,) = self.ops.to_numpy_many([drafts], ring=self._fetch_ring)
        return [Proposal(r.request_id, all_np[i, : r.k].astype(np.int64), None) for i, r in enumerate(reqs)]

    # --- ahead drafting (runtime/draft_ahead.py) ------------------------------------
    def check_ahead(self, request_id: str, k: int, field: str) -> None:
        """ValueError unless ``request_id`` can continue its last proposal by ``k`` greedy drafts."""
        req = self.requests.get(request_id)
        pos = self._ends.check(request_id, k, self.max_k, field, req is not None and req.on_host)
        self.cache.check_fits(request_id, pos + k)

    def _ahead(self, reqs: list[ProposeRequest]) -> list[Proposal]:
        """Continue each request's last proposal by k greedy substeps on its own hidden states."""
        for r in reqs:
            self.check_ahead(r.request_id, r.k, "ahead")
        # NOTE: the only host synchronisation of an ahead call.
        return self._proposals(reqs, self._ends.continue_(reqs, [self.cache.get(r.request_id).slot for r in reqs],
                                                          self._greedy_substep))

    def _greedy_substep(self, g, tok, places: list[tuple[int, int] | None]):
        """One greedy substep for a batch: pair (g, tok) of row i at (slot, position) = places[i]
        -> (g', argmax) on the device. A row with no place (its drafts are complete) runs on the
        scratch slot at position 0 and its outputs are dropped: shapes stay fixed, no live KV
        is touched. g [B, d], tok [B] device tensors."""
        b, d = len(places), self.cfg.hidden_size
        write_slots, positions, read_slots, last_index, need = single_token_places(places, self.cache.scratch_slot)
        (g, logits), _ = self.registry.run(SUBSTEP, {
            "prev_hidden": self.ops.reshape(g, (b, 1, d)), "tokens": self.ops.reshape(tok, (b, 1)),
            "write_slots": write_slots, "positions": positions,
            "read_slots": read_slots, "last_index": last_index}, need=need)
        return g, self.ops.argmax(logits, -1)

    # --- the next round queued on the device (runtime/round_ahead.py) ------------------------
    @property
    def next_taken(self) -> int:
        """Proposes answered with drafts queued ahead."""
        return self.chain.taken if self.chain is not None else 0

    def queue_next(self, ids: tuple[str, ...], tokens, best, hidden, starts: list[int], k: int) -> NextPropose | None:
        """Queue the next round of ``ids`` (``DraftChain.queue``) under the owner's guard
        (``DraftChain.guard``); None where this engine queues no rounds ahead."""
        chain = self.chain
        return None if chain is None else chain.guard(lambda: chain.queue(ids, tokens, best, hidden, starts, k))

    def _take_next(self, nxt: NextPropose, reqs: list[ProposeRequest]) -> list[Proposal]:
        """Answer a propose with the drafts queued for it (``NextPropose.matches``): its catch-up
        pairs are written (the queued step wrote them), so the cache counts them."""
        for r, p in zip(reqs, nxt.pairs):
            self._ends.forget(r.request_id)
            self.cache.get(r.request_id).length = p + len(r.tokens)
        self.fused_proposes += 1
        counts = _zeros(nxt.k)                 # every request's k is the queued one's (matches)
        return [Proposal(r.request_id, counts, None, DeviceDrafts(nxt.drafts, i, self)) for i, r in enumerate(reqs)]

    def drop_pending(self) -> None:
        """Forget a propose queued for the next round (graphs cleared, weights changed)."""
        if self.chain is not None:
            self.chain.drop()

    def release(self, request_id: str) -> bool:
        self.drop_pending()
        self.requests.pop(request_id, None)
        self._ends.forget(request_id)
        return self.cache.free(request_id)
