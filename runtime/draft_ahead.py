"""Ahead drafting on the draft side: continuing a request's last greedy proposal.

Owns: the kept end of each request's last proposal (kept when the proposal asked for it:
``ProposeRequest.keep_tail``, and ran all of the batch's substeps) — the MTP output hidden
state g [d] and the last draft, by cache slot (row ``max_slots`` is the scratch slot's), and the
draft position the continuation writes first; what an ahead item must satisfy (``check``); and
the continuation itself (``continue_``): k greedy substeps from the kept end, as if every draft
of the proposal had been accepted (runtime/round_driver.py ``run_round``, post-verify drafting).

Must not know: gRPC, scheduling, the cache's layout, how a substep runs (the engine passes its
substep in), the host side of the drafts (the engine reads them back).

Substep j of a continuation writes (g, d) at the kept position + j: rows that hold guesses and
are overwritten by the next catch-up, exactly like a proposal's own substeps.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from runtime.backends.base import Ops
from runtime.types import ProposeRequest

Substep = Callable[[Any, Any, list], tuple]      # (g [B, d], tok [B], places) -> (g', argmax) on the device


class KeptEnds:
    """The kept ends of one draft engine's proposals (module doc)."""

    def __init__(self, ops: Ops, max_slots: int, hidden_size: int) -> None:
        self.ops = ops
        self._g = ops.zeros((max_slots + 1, hidden_size))          # [S+1, d]
        self._tok = ops.zeros((max_slots + 1,), "int64")           # [S+1]
        self.positions: dict[str, int] = {}                        # request id -> position it continues at

    def keep(self, rids: list[str], slots: list[int], g, tok, rows: list[int], positions: list[int]) -> None:
        """Store rows ``rows`` of g [B, d] / tok [B] (device) as the ends of ``rids`` (by slot)."""
        idx = self.ops.from_numpy(np.asarray(rows, dtype=np.int64), "int64")
        at = self.ops.from_numpy(np.asarray(slots, dtype=np.int64), "int64")
        self.ops.scatter_rows_(self._g, at, self.ops.index_select(g, idx, 0))
        self.ops.scatter_rows_(self._tok, at, self.ops.index_select(tok, idx, 0))
        for rid, pos in zip(rids, positions):
            self.positions[rid] = pos

    def forget(self, request_id: str) -> None:
        self.positions.pop(request_id, None)

    def check(self, request_id: str, k: int, max_k: int, field: str, samples_on_host: bool) -> int:
        """The position ``request_id``'s continuation by ``k`` drafts starts at; ValueError unless it
        can continue its last proposal (1 <= k <= max_k + 1, an end kept, greedy drafts)."""
        if not 1 <= k <= max_k + 1:
            raise ValueError(f"{field}.k: {k} is out of range [1, {max_k + 1}] for an ahead item")
        if request_id not in self.positions:
            raise ValueError(f"{field}.ahead: request {request_id!r} has no kept proposal end to continue "
                             "(keep_tail on its last proposal, greedy drafts only)")
        if samples_on_host:
            raise ValueError(f"{field}.ahead: request {request_id!r} samples its drafts; ahead drafting is greedy only")
        return self.positions[request_id]

    def continue_(self, reqs: list[ProposeRequest], slots: list[int], substep: Substep) -> Any:
        """Continue each request's kept end by its k greedy substeps (``slots``: their cache slots,
        checked by the caller); the new ends are kept for the batch's longest rows. -> the drafts
        [B, kmax] on the device (row i's first k are request i's)."""
        kmax = max(r.k for r in reqs)
        b = len(reqs)
        at = self.ops.from_numpy(np.asarray(slots, dtype=np.int64), "int64")
        g = self.ops.index_select(self._g, at, 0)                        # [B, d]
        tok = self.ops.index_select(self._tok, at, 0)                    # [B]
        start = [self.positions[r.request_id] for r in reqs]
        drafts = []
        for j in range(kmax):
            g, tok = substep(g, tok, [(slots[i], start[i] + j) if r.k > j else None for i, r in enumerate(reqs)])
            drafts.append(tok)
        for r in reqs:
            self.forget(r.request_id)
        keep = [i for i, r in enumerate(reqs) if r.k == kmax]
        if keep:
            self.keep([reqs[i].request_id for i in keep], [slots[i] for i in keep], g, tok, keep,
                      [start[i] + kmax for i in keep])
        return self.ops.cat([self.ops.reshape(t, (b, 1)) for t in drafts], 1)
