"""One rank's target engine in a tensor-parallel group.

Owns: the sharded forward of a ``TargetEngine`` (its decoder layers on this rank's
shards with the row splits summed by the group, the vocabulary-parallel output head
with the logits gathered) and the hooks by which rank 0 hands each step's inputs to
the other ranks (``announce``) and they run the same step (``run_announced``).

Must not know: processes, gRPC, lifecycle, how commands travel (``announce`` is a
callable the worker gives it), frameworks (collectives are the ``group``'s:
``runtime/backends/torch_dist.py``).

Every rank holds a whole ``TargetEngine``: KV cache of its K/V heads, registry,
step kinds. Only rank 0's request bookkeeping is used: the other ranks never see
requests, only the int64 arrays of each forward (tokens, cache rows, positions),
so their caches follow rank 0's slots by construction. Every rank computes the
full logits after the gather; sampling and acceptance run on rank 0 alone.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from runtime.backends.base import Ops
from runtime.config import CacheConfig, ModelConfig
from runtime.graphs import GraphRegistry
from runtime.model import Params, build_attn_meta, head_weight_name, target_forward
from runtime.target_engine import TargetEngine
from runtime.tp_plan import TPPlan

PREFILL = "prefill"


class TPTargetEngine(TargetEngine):
    def __init__(self, ops: Ops, plan: TPPlan, params: Params, cache_cfg: CacheConfig, max_k: int,
                 registry: GraphRegistry, group: Any, prefill_widths: tuple[int, ...] = (),
                 prefill_tokens: int = 1024) -> None:
        self.plan, self.group = plan, group
        # Rank 0 sets this to hand each eager prefill's inputs to the other ranks first.
        self.announce: Callable[[Any], None] | None = None
        # NOTE: the local config (this rank's heads and ffn rows) builds the KV cache and the
        # fused q/k/v, gate/up buffers; vocabulary and width stay whole, so request checks
        # and the logits the host sees are the full model's.
        # NOTE: no decode-ahead on a TP group: a step queued ahead reads its token on the device,
        # and the other ranks take host inputs only (target_service/tp_worker.py).
        # Prefill graphs replay through the registry: rank 0's announcing registry hands each
        # replay to the other ranks as it does the verify's (target_service/tp_worker.py).
        super().__init__(ops, plan.local_cfg(), params, cache_cfg, max_k, registry, decode_ahead=False, round_ahead=False,
                         prefill_widths=prefill_widths, prefill_tokens=prefill_tokens)
        self.full_cfg: ModelConfig = plan.cfg
        a, b = plan.vocab_rows
        if plan.head_is_embedding_view():
            self._head = params["model.embed_tokens.weight"][a:b]       # a view: in-place updates reach it
        else:
            self._head = params[head_weight_name(plan.cfg)]      # its vocabulary rows (zero-padded), or all
        # Uneven vocabulary shares: the gathered logits hold each rank's padding, dropped here.
        counts, width = plan.vocab_counts, plan.vocab_width
        self._vocab_index = None
        if plan.vocab_split and min(counts) < width:
            keep = np.concatenate([r * width + np.arange(n) for r, n in enumerate(counts)])
            self._vocab_index = ops.from_numpy(keep.astype(np.int64))

    # --- the sharded forward (every rank, same order of collectives) -------------------
    def _head_logits(self, hidden):
        """hidden [..., d] -> full logits float32 [..., V]: this rank's vocabulary rows, gathered."""
        ops = self.ops
        normed = ops.rms_norm(hidden, self._weights["model.norm.weight"], self.cfg.rms_norm_eps)
        local = ops.cast(ops.linear(normed, self._head), "float32")                 # [..., V/tp]
        if not self.plan.vocab_split:
            return local
        logits = self.group.gather_last(local)                                      # [..., tp * width]
        return logits if self._vocab_index is None else ops.index_select(logits, self._vocab_index, -1)

    def _step(self, tokens, write_slots, positions, read_slots, attend_len=None):
        meta = build_attn_meta(self.ops, self.rope, write_slots, positions, read_slots,
                               self.cache.max_len, attend_len or self.cache.max_len, self._groups)
        hidden = target_forward(self.ops, self._weights, self.cfg, tokens, meta, self.cache.layers,
                                reduce=self.group.all_reduce)
        logits = self._head_logits(hidden)
        return hidden, self.ops.argmax(logits, -1), logits

    def _prefill_step(self, tokens, write_slots, positions, read_slots, last_index, attend_len):
        meta = build_attn_meta(self.ops, self.rope, write_slots, positions, read_slots,
                               self.cache.max_len, attend_len, self._groups)
        hidden = target_forward(self.ops, self._weights, self.cfg, tokens, meta, self.cache.layers,
                                reduce=self.group.all_reduce)
        b, t, d = self.ops.shape(hidden)
        last = self.ops.index_select(self.ops.reshape(hidden, (b * t, d)), last_index, 0)     # [B, d]
        logits = self._head_logits(last)
        return hidden, self.ops.argmax(logits, -1), logits

    def _run_prefill(self, arrays: dict[str, np.ndarray], attend_len: int) -> tuple:
        # NOTE: announce before the local forward: the other ranks must enter the same
        # collectives, in the same order, or the group deadlocks.
        if self.announce is not None:
            self.announce((PREFILL, arrays, attend_len))
        return super()._run_prefill(arrays, attend_len)

    # --- ranks > 0 -------------------------------------------------------------------------
    def run_announced(self, command: tuple) -> None:
        """Run a step rank 0 announced: ("prefill", arrays, attend_len), or ("run", kind, inputs)
        for a registry step (graph replay or eager). The outputs stay unused on this rank."""
        if command[0] == PREFILL:
            super()._run_prefill(command[1], command[2])
        else:
            self.registry.run(command[1], command[2])
