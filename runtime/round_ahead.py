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
copies of its outputs to the host are queued, the draft engine replays one ``chain{k}`` graph
(``chain_step``): the accepted counts ``a`` on the device, the catch-up they give
(``catchup_inputs``), the ``propose{k}`` step on it and the next verify's token rows and
positions (``next_verify``); the target queues its verify graph on those. The host then waits
for round r's copies only, accepts on the host as always and settles the pending round: the
committed lengths and catch-up tokens. The next ``propose`` takes the queued drafts when it asks
for exactly those requests, pairs, k and tokens and the device's counts (read back then, a round
later) are the host's; the next ``verify`` takes the queued outputs when it verifies exactly
those drafts at exactly those lengths. Anything else drops them.

Exactness: a taken round ran the very graphs (kind, batch bucket and context span) on the very
inputs the host path would have uploaded: the queue declines when the span a row may need
could differ with its accepted count. A dropped round only wrote KV rows past its rows'
committed lengths (stale, overwritten later) and the scratch slot, given that the device's
counts are the host's: they are by construction (the same leading-match count of the same ids),
and each queued round is judged when it is taken or dropped; a request a miscounted round wrote
fails its next verify (``RoundChain.take``) instead of decoding on from rows it cannot trust.

Must not know: gRPC, scheduling, frameworks (everything goes through ``Ops``), the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from runtime.backends.base import Ops
from runtime.batch_layout import Row, attend_need, attend_span, context_spans
from runtime.decode_ahead import AheadGate, AheadStats
from runtime.graphs import GraphRegistry, InputSpec, StepKind


def accepted_counts(ops: Ops, tokens: Any, best: Any, k: int) -> Any:
    """Greedy acceptance on the device: a [B] int64, the number of leading drafts equal to the
    target's argmax. tokens [B, W] = [t_n, d_1..d_k, padding], best [B, W]: row j's argmax is
    the target's token after d_j, so d_{j+1} is accepted iff it equals best[:, j] and every
    draft before it was: a = the length of the leading run of matches (``Ops.leading_equal``)."""
    return ops.leading_equal(tokens[:, 1:k + 1], best[:, :k])


@dataclass(frozen=True)
class ChainConsts:
    """The device constants of a chain step (k drafts, verify width W), made once: inside a
    captured graph every ``arange`` is a kernel at each replay, and a round's chain is a few
    dozen tiny kernels whose launches set much of a batch-1 round's device time (~250 kernels a
    round on the H100, docs/performance.md § Session 28)."""

    ramp: Any            # int64 [W]: 0..W-1
    ramp_k: Any          # int64 [W]: min(j, k)
    sub_zero: Any        # int64 [k-1]: zeros
    sub_one: Any         # int64 [k-1]: 1..k-1


def chain_consts(ops: Ops, k: int, width: int) -> ChainConsts:
    ramp = ops.arange(width)
    sub = ops.arange(max(k - 1, 0))
    return ChainConsts(ramp, ops.clip(ramp, 0, k), sub * 0, sub + 1)


def catchup_inputs(ops: Ops, a: Any, best: Any, hidden: Any, slots: Any, pairs: Any, k: int,
                   width: int, scratch: int, c: ChainConsts | None = None) -> dict[str, Any]:
    """The inputs of the draft's ``propose{k}`` step for the next round (runtime/fused_propose.py):
    row i catches up its a_i + 1 committed pairs (h_{n+j}, best_j), j = 0..a_i, from position P_i,
    padded to ``width`` as ``batch_layout.layout_rows`` pads (token 0, the scratch slot, the
    position clamped at the row's last one, a zero hidden row), then k - 1 substeps from
    position P_i + a_i + 1. best [B, W >= width] int64, hidden [B, W, d], ``slots`` and ``pairs``
    [B] int64 (the draft's slot and pair count P of each row): all device tensors; ``c`` the
    step's constants (made here when not given)."""
    c = c or chain_consts(ops, k, width)
    b = ops.shape(best)[0]
    a_col = ops.reshape(a, (b, 1))
    keep = ops.less_equal(c.ramp, a_col)                     # [B, W]: rows 0..a are the catch-up's
    slot_col, pairs_col = ops.reshape(slots, (b, 1)), ops.reshape(pairs, (b, 1))
    last = ops.arange(b) * width + a                         # each row's last catch-up row, flat
    out = {"prev_hidden": ops.where(ops.reshape(keep, (b, width, 1)), hidden[:, :width], 0.0),
           "tokens": ops.where(keep, best[:, :width], 0),
           "write_slots": ops.where(keep, slot_col, scratch),
           "positions": pairs_col + ops.minimum(c.ramp, a_col),    # min(P + j, P + a)
           "read_slots": slots,
           "last_index": last}
    if k > 1:
        out["sub_write_slots"] = slot_col + c.sub_zero                 # [B, k-1]
        out["sub_positions"] = (pairs_col + a_col) + c.sub_one         # substep s at P + a + 1 + s - 1
    return out


def next_verify(ops: Ops, a: Any, best: Any, drafts: Any, starts: Any, k: int, width: int,
                c: ChainConsts | None = None, last_index: Any = None) -> tuple[Any, Any]:
    """The next round's verify rows: row i verifies [best_{a_i}, d'_1..d'_k] from its new committed
    length n_i + a_i + 1, padded to ``width`` as ``layout_rows`` pads -> (tokens, positions)
    [B, width]. drafts [B, >= k], ``starts`` [B] = n_i + 1 (device). Its write and read slots are
    the host's (they do not depend on the counts). ``last_index``: i * W + a_i, when the caller
    has it (``catchup_inputs``' ``last_index``)."""
    c = c or chain_consts(ops, k, width)
    b = ops.shape(best)[0]
    flat = last_index if last_index is not None else ops.arange(b) * width + a
    last = ops.index_select(ops.reshape(best[:, :width], (b * width,)), flat, 0)   # [B]
    parts = [ops.reshape(last, (b, 1)), drafts[:, :k]]
    if k + 1 < width:
        parts.append(ops.zeros((b, width - 1 - k), "int64"))
    return ops.cat(parts, 1), ops.reshape(starts + a, (b, 1)) + c.ramp_k       # min(n' + j, n' + k)


def verify_places(slots: list[int], k: int, width: int, scratch: int) -> tuple[np.ndarray, np.ndarray]:
    """The next verify's write and read slots (host): a row's k + 1 tokens in its slot, padding in
    the scratch slot, as ``layout_rows`` places them."""
    tslot = np.asarray(slots, dtype=np.int64)
    return np.where(np.arange(width)[None, :] <= k, tslot[:, None], scratch).astype(np.int64), tslot


def chain_step(ops: Ops, propose: Callable[..., tuple], k: int, width: int, scratch: int) -> Callable[..., tuple]:
    """One captured step for the next round of a chained batch: the accepted counts of round r
    (``accepted_counts``), the draft's ``propose`` (a ``propose{k}`` step function) on the
    catch-up they give, and the next verify's token rows and positions.
    (vtokens, vbest [B, W] int64, vhidden [B, W, d]: round r's verify input and outputs;
    dslot, pairs, tstart [B] int64: the draft's slot and pair count, the target's length + 1)
    -> drafts [B, k], next verify tokens [B, W], its positions [B, W], the counts a [B]."""
    c = chain_consts(ops, k, width)       # NOTE: made here, before any capture: static in the graphs

    def step(vtokens, vbest, vhidden, dslot, pairs, tstart, attend_len=None):
        a = accepted_counts(ops, vtokens, vbest, k)
        inputs = catchup_inputs(ops, a, vbest, vhidden, dslot, pairs, k, width, scratch, c)
        drafts, _g, _tok = propose(**inputs, attend_len=attend_len)
        tokens, positions = next_verify(ops, a, vbest, drafts, tstart, k, width, c, inputs["last_index"])
        return drafts, tokens, positions, a
    return step


CHAIN_PREFIX = "chain"


def chain_kind_name(k: int) -> str:
    return f"{CHAIN_PREFIX}{k}"


def chain_kind(step: Callable[..., tuple], k: int, width: int, hidden_size: int, scratch: int,
               spans: tuple[int, ...], max_len: int) -> StepKind:
    """The ``chain{k}`` step kind (``chain_step``), captured per batch bucket and context span
    like ``propose{k}``; padding rows draft on the scratch slot from position 0."""
    return StepKind(
        name=chain_kind_name(k),
        fn=step,
        inputs=(InputSpec("vtokens", (width,), "int64", 0),
                InputSpec("vbest", (width,), "int64", 0),
                InputSpec("vhidden", (width, hidden_size), "compute", 0.0),
                InputSpec("dslot", (), "int64", scratch),
                InputSpec("pairs", (), "int64", 0),
                InputSpec("tstart", (), "int64", 0)),
        # Eagerly (no graph): the span the propose's last substep may read, P + 2k rows.
        eager_kwargs=lambda x: {"attend_len": attend_span(x["pairs"] + 2 * k - 1, max_len)},
        spans=spans,
        span_of=lambda x: attend_need(x["pairs"] + 2 * k - 1),
        warmup=1,
    )


@dataclass
class NextPropose:
    """A propose the draft queued for the next round: its drafts (a device tensor [B, k] that
    nothing else writes), the next verify's token rows and positions (device [B, W]), the
    accepted counts it computed (``counts()`` waits for them: one int per row), the requests and pair
    counts it started from, and, once the target has accepted on the host, the catch-up tokens
    that acceptance committed (``expected``): the queued propose is taken only when they are the
    request's and the device's counts agree with them."""

    ids: tuple[str, ...]
    pairs: tuple[int, ...]
    k: int
    drafts: Any
    tokens: Any
    positions: Any
    counts: Callable[[], list[int]]      # may be called more than once (read from the device once)
    expected: tuple[tuple[int, ...], ...] | None = None
    _judged: tuple[tuple, Any, bool] | None = field(default=None, repr=False)   # (reqs, expected, verdict)

    def matches(self, reqs: list) -> bool:
        """Whether a propose of ``reqs`` (``ProposeRequest``) is this one. Asked again of the very
        same requests (a batch's check, then its propose) before anything changed, the answer
        is the first's."""
        j = self._judged
        if (j is None or j[1] is not self.expected or len(j[0]) != len(reqs)
                or not all(a is b for a, b in zip(j[0], reqs))):
            j = self._judged = (tuple(reqs), self.expected, self._matches(reqs))
        return j[2]

    def _matches(self, reqs: list) -> bool:
        if self.expected is None or len(reqs) != len(self.ids):
            return False
        for r, rid, p, want in zip(reqs, self.ids, self.pairs, self.expected):
            if (r.request_id != rid or r.start_position != p or r.k != self.k or not r.on_device or r.ahead
                    or r.keep_tail or len(r.tokens) != len(want) or tuple(r.tokens.tolist()) != want):
                return False
        # NOTE: last, and only here: the counts the queued catch-up used must be the host's (they
        # are by construction). Read now, a round after they were queued, the wait is over.
        return self.counts() == [len(want) - 1 for want in self.expected]


class DraftChain:
    """The draft's side of rounds queued ahead (``DraftEngine.chain``): its ``chain{k}`` kinds, one per
    k (registered here, after the propose kinds they build on), the propose it queued for the next
    round and whether a propose may take it. ``guard`` runs each queue: directly (the in-process
    engine), or the owning worker's guard (its device thread idle, weights serving; else nothing
    runs and nothing is queued)."""

    def __init__(self, ops: Ops, registry: GraphRegistry, fused: Any, cache: Any, width: int, hidden_size: int,
                 max_k: int) -> None:
        self.ops, self.registry, self.fused, self.cache, self.max_k = ops, registry, fused, cache, max_k
        scratch = cache.scratch_slot
        for k in range(1, max_k + 1):
            registry.register(chain_kind(chain_step(ops, fused.step_fn(k), k, width, scratch), k, width, hidden_size,
                                         scratch, context_spans(cache.max_len), cache.max_len))
        self.pending: NextPropose | None = None
        self.taken = 0                   # proposes answered with drafts queued ahead
        # The counts' read-back buffers, reused (a fresh pinned buffer every round cost ~0.1 ms of
        # host time on the H100 host): each queued round's counts are read (``NextPropose.counts``,
        # once) before the next round is queued, well within the ring's ``FetchRing.SLOTS`` fetches.
        self._ring = ops.fetch_ring()
        self.guard: Callable[[Callable[[], Any]], Any] = lambda fn: fn()

    def queue(self, ids: tuple[str, ...], tokens: Any, best: Any, hidden: Any, starts: list[int], k: int
              ) -> NextPropose | None:
        """Queue the next round of ``ids`` (k drafts each): one ``chain{k}`` replay computes round r's
        accepted counts from its verify's ``tokens`` and argmax ``best`` [B, W], proposes on the
        catch-up they give (``hidden`` [B, W, d] its hidden rows) and lays out the next verify's
        rows from ``starts`` (each request's target length + 1). None when that would not replay
        a graph the host path would (a request unknown here, the cache too short, a context span
        that depends on the counts). Greedy by construction: its caller's drafts stayed on the
        device, which only greedy ones do."""
        self.pending = None
        if not 1 <= k <= self.max_k or not all(self.cache.has(rid) for rid in ids):
            return None
        states = [self.cache.get(rid) for rid in ids]
        pairs = [st.length for st in states]
        top, kind = max(pairs), chain_kind_name(k)
        # NOTE: as ``DraftEngine.propose`` decides: the catch-up's a + 1 pairs end at P + a + 1, its
        # last substep reads P + a + k rows; for every a in 0..k all of it must sit in one span,
        # the span the host path would pick whatever a turns out to be.
        lo, hi = top + 1, top + 2 * k
        if (top + 2 * k + 1 > self.cache.max_len or not self.fused.one_span(lo, hi)
                or not self.registry.can_replay(kind, len(ids), hi)):
            return None
        (drafts, vtokens, vpositions, counts), replayed = self.registry.run(kind, {
            "vtokens": tokens, "vbest": best, "vhidden": hidden,
            "dslot": np.asarray([st.slot for st in states], dtype=np.int64),
            "pairs": np.asarray(pairs, dtype=np.int64), "tstart": np.asarray(starts, dtype=np.int64)}, need=hi)
        if not replayed:
            return None
        # NOTE: queued right behind the replay, before any later replay rewrites its outputs.
        kept = self.ops.clone(drafts)
        fetch = self.ops.to_numpy_many_async([counts], ring=self._ring)
        read: list[list[int]] = []

        def device_counts() -> list[int]:
            # NOTE: read once (the draft's take and the target's judging both ask): the copy
            # out of the ring's buffer, which a later queue reuses.
            if not read:
                read.append(fetch()[0].tolist())
            return read[0]
        self.pending = NextPropose(tuple(ids), tuple(pairs), k, kept, vtokens, vpositions, device_counts)
        return self.pending

    def answers(self, reqs: list) -> bool:
        """Whether the queued propose is the one of ``reqs`` (``NextPropose.matches``), without
        taking it."""
        return self.pending is not None and self.pending.matches(reqs)

    def take(self, reqs: list) -> NextPropose | None:
        """The queued propose when a propose of ``reqs`` (``ProposeRequest``) is it
        (``NextPropose.matches``), else None; either way nothing stays queued."""
        nxt, self.pending = self.pending, None
        if nxt is None or not nxt.matches(reqs):
            return None
        self.taken += 1
        return nxt

    def drop(self) -> None:
        """Forget the queued propose (a release, graphs cleared, weights changed)."""
        self.pending = None


@dataclass
class PendingRound:
    """The next round's verify, queued: outputs (hidden, argmax, logits device views), its token
    rows (with the drafts of ``propose``), and the lengths it assumed once settled."""

    ids: tuple[str, ...]
    k: int
    tokens: Any                          # int64 [B, W] on the device: the verify's input rows
    outputs: tuple[Any, ...]
    propose: NextPropose
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

    def miscounted(self) -> list[str]:
        """The requests whose accepted count on the device was not the host's (none, by
        construction: the same leading-match count of the same ids). Such a request's queued
        verify wrote from n + a' + 1, below its committed length when a' < a: its KV rows may be
        wrong. Only a settled round is judged (an unsettled one was never accepted)."""
        if self.propose.expected is None:
            return []
        got = self.propose.counts()
        return [rid for rid, a, want in zip(self.ids, got, self.propose.expected) if a != len(want) - 1]


class RoundChain:
    """The target's side of rounds queued ahead: the queued round, whether a verify may take it,
    and the counts (``stats``: launched / used / dropped). As for decode-ahead a gate
    (``decode_ahead.AheadGate``) pauses queuing while most queued rounds are dropped."""

    def __init__(self, registry: GraphRegistry, kind: str, width: int, scratch: int, max_len: int) -> None:
        self.registry, self.kind, self.width, self.scratch, self.max_len = registry, kind, width, scratch, max_len
        self.pending: PendingRound | None = None
        self.stats = AheadStats()
        self._gate = AheadGate()
        self.errors = 0              # queue attempts that raised (the round went on without)
        self._poisoned: set[str] = set()   # requests whose KV a miscounted round may have written

    def allow(self) -> bool:
        """Called once per round that could queue its successor."""
        return self._gate.allow()

    def queue(self, ids: tuple[str, ...], rows: list[Row], tokens: Any, hidden: Any, best: Any, k: int,
              source: Any) -> PendingRound | None:
        """Queue the next round of these verify ``rows`` (k drafts each): the draft's chained
        propose (``source``, the draft engine that made this round's drafts; it also computes
        the accepted counts and the next verify's rows from this verify's ``tokens``, ``best``
        and ``hidden``), then the verify (``kind``) of its drafts. None when the verify would not
        replay the graph the host path would run (the cache too short, a span that depends on
        the counts), the draft declined, or queuing failed (counted in ``errors``: the round
        this verify answers never fails for what is only a head start on the next)."""
        try:
            return self._queue(ids, rows, tokens, hidden, best, k, source)
        except Exception:  # noqa: BLE001 - see the docstring
            self.errors += 1
            return None

    def _queue(self, ids: tuple[str, ...], rows: list[Row], tokens: Any, hidden: Any, best: Any, k: int,
               source: Any) -> PendingRound | None:
        top = max(r.start for r in rows)
        # NOTE: the next verify reads up to n + a + k + 2 rows for a in 0..k: one span for all of
        # them, the one the host path picks whatever the counts are.
        lo, hi = top + k + 2, top + 2 * k + 2
        step = self.registry.kinds[self.kind]
        if (hi > self.max_len or self.registry.span_for(step, lo) != self.registry.span_for(step, hi)
                or not self.registry.can_replay(self.kind, len(rows), hi)):
            return None
        nxt = source.queue_next(ids, tokens, best, hidden, [r.start + 1 for r in rows], k)
        if nxt is None:
            return None
        write, read = verify_places([r.slot for r in rows], k, self.width, self.scratch)
        outputs, replayed = self.registry.run(self.kind, {"tokens": nxt.tokens, "write_slots": write,
                                                          "positions": nxt.positions, "read_slots": read}, need=hi)
        if not replayed:
            return None
        self.stats.launched += 1
        return PendingRound(ids, k, nxt.tokens, tuple(outputs), nxt)

    def take(self, ids: tuple[str, ...], rows: list[Row], reqs: list, on_device: tuple | None) -> PendingRound | None:
        """The queued round, when the verify of ``reqs`` (``VerifyRequest``; ``ids`` theirs, ``rows``
        their verify rows) is it: its drafts the queued ones (``on_device``: the drafts tensor and
        each request's row of it, in the requests' order); else None, and the queued round is
        dropped. Raises RuntimeError for a verify of a request a miscounted round wrote
        (``PendingRound.miscounted``): never a silently wrong token."""
        chained, self.pending = self.pending, None
        if chained is not None:
            self._judge(chained)
        bad = self._poisoned.intersection(ids)
        if bad:
            self._poisoned -= bad
            raise RuntimeError(f"round ahead: the device's accepted counts of {sorted(bad)} were not the "
                               "host's; the round queued on them may have written committed KV rows")
        if chained is None:
            return None
        if (on_device is not None and on_device[1].tolist() == list(range(len(reqs)))
                and chained.matches(ids, tuple(r.start for r in rows), on_device[0], [len(r.drafts) for r in reqs])):
            self.stats.used += 1
            self._gate.record(True)
            return chained
        self.dropped()
        return None

    def drop(self) -> None:
        """Forget the queued round (the engine's state changed); a miscounted one is remembered
        (``take`` refuses its requests' next verify)."""
        if self.pending is not None:
            chained, self.pending = self.pending, None
            self._judge(chained)
            self.dropped()

    def forget(self, request_id: str) -> None:
        """A request left (released): nothing of it is judged any more."""
        self._poisoned.discard(request_id)

    def _judge(self, chained: PendingRound) -> None:
        self._poisoned.update(chained.miscounted())

    def dropped(self) -> None:
        self.stats.dropped += 1
        self._gate.record(False)
