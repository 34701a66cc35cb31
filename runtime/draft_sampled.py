"""Drafts sampled (or coupled) from q on the host, one substep at a time.

Owns: a propose whose batch has a row that samples its draft (``draft_sampling``) or couples it
(``sampling_mode`` "coupled"): after the catch-up, each substep's logits come to the host (the
argmax only when no row needs q), each such row draws its draft from q at its absolute position
with runtime/random_stream.py's numbers, greedy rows take the argmax, and the next substep runs
on the drafts so far; rows whose k drafts are complete leave the batch. Draft s of request i
sits at token position pairs_i + s (runtime/draft_engine.py's module doc). The fused and greedy
paths keep their drafts on the device instead (runtime/fused_propose.py, ``DraftEngine``).

Must not know: gRPC, scheduling, the target, which framework (everything goes through ``Ops``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from runtime import random_stream, sampling
from runtime.backends.base import Ops
from runtime.batch_layout import Row, layout_rows
from runtime.graphs import GraphRegistry
from runtime.kv_cache import KVCache
from runtime.types import Proposal, ProposeRequest


class SampledDrafts:
    """The host-side propose loop of a draft engine: its ops, graph registry (the ``substep``
    kind), cache and hidden size."""

    def __init__(self, ops: Ops, registry: GraphRegistry, cache: KVCache, hidden_size: int, substep: str) -> None:
        self.ops, self.registry, self.cache, self.hidden_size, self.substep = ops, registry, cache, hidden_size, substep

    def propose(self, requests: dict[str, Any], reqs: list[ProposeRequest], slots: list[int], g, logits
                ) -> list[Proposal]:
        """The drafts of ``reqs`` (their catch-up done: ``g``, ``logits`` its last rows on the
        device; ``slots`` their cache slots); ``requests``: the engine's per-request state
        (``params``, ``seed``, ``on_host``)."""
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[np.ndarray]] = [[] for _ in reqs]
        active = list(range(len(reqs)))                                  # rows of g/logits -> request index
        for s in range(1, max(r.k for r in reqs) + 1):
            # Greedy drafts need only the argmax ([A] to the host); the full
            # logits ([A, V]) come over only when some row samples its draft.
            states = [requests[reqs[i].request_id] for i in active]
            sampled = [st.on_host for st in states]
            greedy = self.ops.to_numpy(self.ops.argmax(logits, -1))       # [A]
            logits_np = self.ops.to_numpy(logits) if any(sampled) else None  # [A, V]
            for row, i in enumerate(active):
                if sampled[row]:
                    tok, q = sample_draft(logits_np[row], states[row].params, states[row].seed,
                                          self.cache.get(reqs[i].request_id).length + s)
                    if q is not None:
                        probs[i].append(q)
                else:
                    tok = int(greedy[row])
                drafts[i].append(tok)
            keep = [row for row, i in enumerate(active) if reqs[i].k > s]
            if not keep:
                break
            if len(keep) != len(active):
                g = self.ops.index_select(g, self.ops.from_numpy(np.asarray(keep, dtype=np.int64), "int64"), 0)
            active = [active[row] for row in keep]
            # Substep s: pair (g_s, d_s) at position pairs + s - 1.
            rows = [Row(slots[i], self.cache.get(reqs[i].request_id).length + s - 1,
                        np.asarray([drafts[i][-1]], dtype=np.int64)) for i in active]
            lay = layout_rows(rows, 1, self.cache.scratch_slot, self.cache.max_len)
            (g, logits), _ = self.registry.run(self.substep, {
                "prev_hidden": self.ops.reshape(g, (len(active), 1, self.hidden_size)),
                "tokens": lay.tokens, "write_slots": lay.write_slots, "positions": lay.positions,
                "read_slots": lay.read_slots, "last_index": lay.last_index})
        return [Proposal(r.request_id, np.asarray(drafts[i], dtype=np.int64),
                         np.stack(probs[i]).astype(np.float32) if probs[i] else None)
                for i, r in enumerate(reqs)]


def sample_draft(logits: np.ndarray, params: Any, seed: int, position: int) -> tuple[int, np.ndarray | None]:
    """The draft at ``position`` from q. Coupled: argmax(log q + g) with the target's noise at
    that position (nothing sent: the target does not use q). Sampled: the inverse-CDF draw
    of the position's PURPOSE_DRAFT uniform (q is sent along for rejection sampling). Greedy
    drafts (q one-hot, nothing sent) are the device-side argmax of the engine's propose."""
    q = sampling.process_logits(logits, params.temperature, params.top_k, params.top_p)
    if params.coupled:
        return sampling.coupled_token(q, random_stream.gumbel(seed, position, q.shape[-1])), None
    return sampling.sample_token(q, random_stream.uniform(seed, position, random_stream.PURPOSE_DRAFT)), q
