"""One captured graph for a whole greedy Propose: the catch-up pass, then k-1 substeps.

Owns: the ``propose{k}`` step kinds (k = 1..max_k), their step function (the
draft's catch-up step over W = max_k+1 padded positions, its argmax d_1, then
k-1 single-token substeps, each fed the previous substep's MTP hidden g and
argmax on the device), and the host layout of their substep inputs
(``substep_places``: write slot / position per row and substep).

Must not know: gRPC, requests or their sampling params, the registry's
internals, frameworks (the step is written against ``Ops``).

Why one kind per k and not only max_k: one k serves a whole round (adaptive
k picks k* <= max_k for the batch, runtime/adaptive_k.py), so a max_k-only
graph would run max_k - k substeps of wasted device work on every round at a
smaller k. Rows of one batch that ask for fewer drafts than its largest k
still run every substep, on the scratch slot at position 0 (as the
per-substep path does). Graph count: buckets x spans x (3 + max_k) for the
draft (catch-up, head pass, substep; +1 with ahead drafting), i.e. max_k kinds more than before; capture
work of a propose{k} graph is k steps, so the propose kinds add about
max_k(max_k+1)/2 step captures per (bucket, span) to the two of catch-up and
substep. They are captured after those two (registration order) and warm up
once instead of twice: every step inside them has just run at the same
shapes (docs/performance.md has the measured capture times).

Context span: one graph reads one span, while the per-substep path picks each
step's own. Where a propose crosses a span boundary (its catch-up fits a
smaller span than its last substep) the two would read different numbers of
masked-out key rows, which rounds differently (seen on CPU: ~1e-7 relative in
g, same drafts); such a propose takes the per-substep path (``one_span``), so
the fused path computes exactly what the per-substep path does. That is one
propose per request per span boundary.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Callable

import numpy as np

from runtime.backends.base import Ops
from runtime.batch_layout import VECTOR_ROWS, attend_need, attend_span
from runtime.graphs import InputSpec, StepKind

PROPOSE_PREFIX = "propose"


def propose_kind_name(k: int) -> str:
    return f"{PROPOSE_PREFIX}{k}"


def substep_places(slots: list[int], pairs: list[int], ks: list[int], kmax: int,
                   scratch_slot: int) -> tuple[np.ndarray, np.ndarray]:
    """Substep s (1..kmax-1) of row i writes pair (g_s, d_s) at (slots[i], pairs[i] + s - 1)
    when ks[i] > s; a row with its drafts complete writes the scratch slot at position 0.
    -> write_slots, positions int64 [B, kmax-1]."""
    b = len(slots)
    if b >= VECTOR_ROWS:                 # whole-array calls: cheaper from this many rows on
        ramp = np.arange(kmax - 1, dtype=np.int64)
        live = ramp < (np.asarray(ks, dtype=np.int64) - 1)[:, None]        # [B, kmax-1]: substep s = j+1 runs
        return (np.where(live, np.asarray(slots, dtype=np.int64)[:, None], scratch_slot),
                np.where(live, np.asarray(pairs, dtype=np.int64)[:, None] + ramp, 0))
    write = np.empty((b, kmax - 1), dtype=np.int64)
    pos = np.empty((b, kmax - 1), dtype=np.int64)
    ramp = np.arange(kmax - 1, dtype=np.int64)
    for i in range(b):
        k, p = ks[i], pairs[i]
        write[i] = slots[i]
        pos[i] = ramp + p
        if k < kmax:
            write[i, k - 1:] = scratch_slot
            pos[i, k - 1:] = 0
    return write, pos


class FusedPropose:
    """The ``propose{k}`` kinds of one draft engine.

    step: the draft's step (prev_hidden [B, T, d], tokens / write_slots / positions [B, T],
    read_slots / last_index [B], attend_len) -> (g_last [B, d], logits_last [B, V]).
    """

    def __init__(self, ops: Ops, step: Callable[..., tuple], hidden_size: int, width: int,
                 max_k: int, scratch_slot: int, max_len: int, spans: tuple[int, ...]) -> None:
        self.ops, self._step, self.d, self.width = ops, step, hidden_size, width
        self.max_k, self.scratch, self.max_len, self.spans = max_k, scratch_slot, max_len, tuple(sorted(spans))

    def one_span(self, catchup_need: int, need: int) -> bool:
        """Whether the catch-up (reading ``catchup_need`` cache rows) and the last substep
        (``need``) fall in the same context span, as every step of the propose then does."""
        return bisect_left(self.spans, catchup_need) == bisect_left(self.spans, need)

    def step_fn(self, k: int) -> Callable[..., tuple]:
        """The ``propose{k}`` step function (catch-up [B, W] then k-1 substeps)."""
        return self._make_fn(k)

    def kinds(self) -> list[StepKind]:
        return [self._kind(k) for k in range(1, self.max_k + 1)]

    def _kind(self, k: int) -> StepKind:
        w, scratch = self.width, self.scratch
        inputs = [InputSpec("prev_hidden", (w, self.d), "compute", 0.0),
                  InputSpec("tokens", (w,), "int64", 0),
                  InputSpec("write_slots", (w,), "int64", scratch),
                  InputSpec("positions", (w,), "int64", 0),
                  InputSpec("read_slots", (), "int64", scratch),
                  InputSpec("last_index", (), "int64", 0)]
        if k > 1:
            # Padding rows: every substep on the scratch slot at position 0.
            inputs += [InputSpec("sub_write_slots", (k - 1,), "int64", scratch),
                       InputSpec("sub_positions", (k - 1,), "int64", 0)]
        return StepKind(
            name=propose_kind_name(k),
            fn=self._make_fn(k),
            inputs=tuple(inputs),
            eager_kwargs=lambda x: {"attend_len": attend_span(self._positions(x), self.max_len)},
            spans=self.spans,
            span_of=lambda x: attend_need(self._positions(x)),
            warmup=1,
        )

    @staticmethod
    def _positions(x: dict) -> np.ndarray:
        sub = x.get("sub_positions")
        return x["positions"] if sub is None else np.concatenate([x["positions"].reshape(-1), sub.reshape(-1)])

    def _make_fn(self, k: int) -> Callable[..., tuple]:
        ops, step, d = self.ops, self._step, self.d

        def propose(prev_hidden, tokens, write_slots, positions, read_slots, last_index,
                    sub_write_slots=None, sub_positions=None, attend_len=None):
            """Catch-up [B, W] then k-1 substeps -> drafts int64 [B, k], g [B, d] and the last
            draft [B] (the end of the proposal, for ahead drafting)."""
            b = ops.shape(tokens)[0]
            g, logits = step(prev_hidden, tokens, write_slots, positions, read_slots, last_index,
                             attend_len=attend_len)                              # [B, d], [B, V]
            tok = ops.argmax(logits, -1)                                          # [B] d_1
            drafts = [ops.reshape(tok, (b, 1))]
            if k > 1:
                rows = ops.arange(b)                                             # [B] last_index of width 1
            for s in range(k - 1):
                # Substep s+1: pair (g_s, d_s); a row's read slot is its write slot (the
                # scratch slot for rows whose drafts are complete and for padding rows).
                ws = sub_write_slots[:, s:s + 1]                                 # [B, 1]
                g, logits = step(ops.reshape(g, (b, 1, d)), ops.reshape(tok, (b, 1)), ws,
                                 sub_positions[:, s:s + 1], ops.reshape(ws, (b,)), rows,
                                 attend_len=attend_len)
                tok = ops.argmax(logits, -1)                                      # [B] d_{s+2}
                drafts.append(ops.reshape(tok, (b, 1)))
            return (drafts[0] if k == 1 else ops.cat(drafts, 1)), g, tok         # [B, k], [B, d], [B]

        return propose
