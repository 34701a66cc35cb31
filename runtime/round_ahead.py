"""A greedy speculative round queued on the device before the host has read the round before it.

Owns: what the next round of a chained greedy batch (its drafts on the device,
runtime/device_drafts.py) is made of on the device: each row's accepted count, computed there
from the verify's tokens and argmax; the draft's catch-up for the next propose (the accepted
rows' hidden states and tokens, at the positions the host layout would give them); the next
verify's token rows and positions; the records of that round (``NextPropose`` on the draft's
side, ``PendingRound`` on the target's) and the rules that decide whether the next propose and
verify may take them.

Why: with the draft in the target's process on the target's device, a greedy round is one
propose graph, one verify graph and one host synchronisation; then the host accepts, commits,
streams and builds the next round while the device has nothing queued. On an H100 with the
bundled model at batch 1 that was 0.87 ms a round for 0.47 ms of kernels (docs/performance.md
§ Session 27). Queued ahead, the next round's propose and verify run while the host does that.

How (``TargetEngine.verify`` with a ``DeviceDrafts.source``): once round r's verify and the
copies of its outputs to the host are queued, the accepted counts ``a`` are computed on the
device; the draft engine queues its ``propose{k}`` graph on the catch-up built from them
(``catchup_inputs``); the target queues its verify graph on the token rows and positions built
from them and the new drafts (``verify_inputs``). The host then waits for round r's copies
only, accepts on the host as always, checks its counts against the device's (they are read
back with round r's outputs) and settles the pending round: the committed lengths and tokens
it assumed. The next ``propose`` takes the queued drafts when it asks for exactly those
requests, pairs and tokens; the next ``verify`` takes the queued outputs when it verifies
exactly those drafts at exactly those lengths. Anything else drops them.

Exactness: a taken round ran the very graphs (kind, batch bucket and context span) on the very
inputs the host path would have uploaded: the queue declines when the span a row may need
could differ with its accepted count. A dropped round only wrote KV rows past its rows'
committed lengths (stale, overwritten later) and the scratch slot.

Must not know: gRPC, scheduling, frameworks (everything goes through ``Ops``), the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.backends.base import Ops


def upload_ints(ops: Ops, arr: np.ndarray) -> Any:
    """An int64 host array on the device without waiting for the device's queued work.
    NOTE: not ``ops.from_numpy``: a CUDA copy from pageable memory waits for the stream first,
    that is for the work this upload is to be queued behind."""
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    out = ops.zeros(arr.shape, "int64")
    ops.copy_from_numpy(out, arr)
    return out


def accepted_counts(ops: Ops, tokens: Any, best: Any, k: int) -> Any:
    """Greedy acceptance on the device: a [B] int64, the number of leading drafts equal to the
    target's argmax. tokens [B, W] = [t_n, d_1..d_k, padding], best [B, W]: row j's argmax is
    the target's token after d_j, so d_{j+1} is accepted iff it equals best[:, j] and every
    draft before it was. a_i = sum_{j<k} prod_{i<=j} match_i (k is small: a few tiny ops)."""
    diff = tokens[:, 1:k + 1] - best[:, :k]                             # [B, k]
    match = 1 - ops.clip(diff * diff, 0, 1)                             # 1 where d_{j+1} == best_j
    run = match[:, 0]
    a = run
    for j in range(1, k):
        run = run * match[:, j]
        a = a + run
    return a


def _columns(ops: Ops, *cols: np.ndarray) -> tuple[np.ndarray, list[Any]]:
    """Per-row host numbers as one upload: (host [B, n], each column as [B, 1] on the device)."""
    host = np.stack([np.asarray(c, dtype=np.int64) for c in cols], 1)
    dev = upload_ints(ops, host)
    return host, [ops.reshape(dev[:, j], (host.shape[0], 1)) for j in range(host.shape[1])]


def catchup_inputs(ops: Ops, a: Any, best: Any, hidden: Any, slots: list[int], pairs: list[int], k: int,
                   width: int, scratch: int) -> dict[str, Any]:
    """The inputs of the draft's ``propose{k}`` step for the next round (runtime/fused_propose.py):
    row i catches up its a_i + 1 committed pairs (h_{n+j}, best_j), j = 0..a_i, from position P_i,
    padded to ``width`` as ``batch_layout.layout_rows`` pads (token 0, the scratch slot, the
    position clamped at the row's last one, a zero hidden row), then k - 1 substeps from
    position P_i + a_i + 1. best [B, W >= width] int64, hidden [B, W, d] (device); ``slots`` and
    ``pairs`` the draft's slot and pair count P of each row (host)."""
    b = len(slots)
    ramp = upload_ints(ops, np.arange(width, dtype=np.int64)) if width > 1 else ops.zeros((1,), "int64")
    a_col = ops.reshape(a, (b, 1))
    over = ops.clip(ramp - a_col, 0, width)                  # [B, W]: j - a past the accepted rows, else 0
    keep = 1 - ops.clip(over, 0, 1)                         # 1 on rows 0..a
    host, (dslot, pairs_col) = _columns(ops, slots, pairs)
    rows = best[:, :width]
    hid = hidden[:, :width]
    keep_h = ops.reshape(ops.cast(keep, ops.dtype_name(hid)), (b, width, 1))
    out = {"prev_hidden": hid * keep_h,
           "tokens": rows * keep,
           "write_slots": keep * (dslot - scratch) + scratch,
           "positions": pairs_col + ramp - over,             # min(P + j, P + a)
           "read_slots": host[:, 0].copy(),
           "last_index": ops.arange(b) * width + a}
    if k > 1:
        out["sub_write_slots"] = np.repeat(host[:, :1], k - 1, 1)
        out["sub_positions"] = pairs_col + a_col + 1 + ramp[: k - 1]   # substep s at P + a + 1 + s - 1
    return out


def verify_inputs(ops: Ops, a: Any, best: Any, drafts: Any, slots: list[int], lengths: list[int], k: int,
                  width: int, scratch: int) -> dict[str, Any]:
    """The inputs of the target's verify step for the next round: row i verifies
    [best_{a_i}, d'_1..d'_k] from its new committed length n_i + a_i + 1, padded to ``width``
    as ``layout_rows`` pads. drafts [B, >= k] (device); ``slots`` and ``lengths`` each row's
    target slot and committed length n before round r's commit (host)."""
    b = len(slots)
    ramp = np.arange(width, dtype=np.int64)
    last = ops.index_select(ops.reshape(best[:, :width], (b * width,)), ops.arange(b) * width + a, 0)   # [B]
    parts = [ops.reshape(last, (b, 1)), drafts[:, :k]]
    if k + 1 < width:
        parts.append(ops.zeros((b, width - 1 - k), "int64"))
    host = np.asarray(lengths, dtype=np.int64)[:, None] + 1 + np.minimum(ramp, k)   # n + 1 + min(j, k)
    tslot = np.asarray(slots, dtype=np.int64)
    return {"tokens": ops.cat(parts, 1),
            "write_slots": np.where(ramp[None, :] <= k, tslot[:, None], scratch).astype(np.int64),
            "positions": upload_ints(ops, host) + ops.reshape(a, (b, 1)),   # min(n' + j, n' + k), n' = n + a + 1
            "read_slots": tslot}


@dataclass
class NextPropose:
    """A propose the draft queued for the next round: its drafts (a device tensor [B, k] that
    nothing else writes), the requests and pair counts it started from, and, once the target
    has accepted on the host, the catch-up tokens it assumed (``expected``)."""

    ids: tuple[str, ...]
    pairs: tuple[int, ...]
    k: int
    drafts: Any
    expected: tuple[tuple[int, ...], ...] | None = None

    def matches(self, reqs: list) -> bool:
        """Whether a propose of ``reqs`` (``ProposeRequest``) is this one."""
        if self.expected is None or len(reqs) != len(self.ids):
            return False
        for r, rid, p, want in zip(reqs, self.ids, self.pairs, self.expected):
            if (r.request_id != rid or r.start_position != p or r.k != self.k or not r.on_device or r.ahead
                    or r.keep_tail or len(r.tokens) != len(want) or tuple(int(t) for t in r.tokens) != want):
                return False
        return True


@dataclass
class PendingRound:
    """The next round's verify, queued: outputs (hidden, argmax, logits device views), its token
    rows (the drafts come from ``propose``), and the lengths it assumed once settled."""

    ids: tuple[str, ...]
    k: int
    tokens: Any                          # int64 [B, W] on the device: the verify's input rows
    outputs: tuple[Any, ...]
    propose: NextPropose
    accepted: Any                        # int64 [B] on the device: round r's counts (read back with it)
    lengths: tuple[int, ...] | None = field(default=None)

    def settle(self, lengths: list[int], tokens: list[tuple[int, ...]]) -> None:
        """Round r accepted on the host: the committed lengths and catch-up tokens it assumed."""
        self.lengths = tuple(lengths)
        self.propose.expected = tuple(tokens)

    def matches(self, ids: tuple[str, ...], lengths: tuple[int, ...], drafts: Any, ks: list[int]) -> bool:
        """Whether a verify of ``ids`` at ``lengths`` with drafts tensor ``drafts`` (each row's k
        in ``ks``) is this one."""
        return (self.lengths is not None and ids == self.ids and lengths == self.lengths
                and drafts is self.propose.drafts and all(k == self.k for k in ks))
