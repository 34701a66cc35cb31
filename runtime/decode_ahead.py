"""Target-only decoding one step ahead: the next greedy step is queued on the device
before the host has read this one's tokens.

Owns: the pending step of a target-only greedy batch — which requests it continues,
the committed lengths it assumes, the device outputs its graph replay writes — the
rule that decides whether a verify may take it (``PendingStep.matches``), and the
target engine's side of it (``StepChain``: queue, take, drop, counts, gate).

Why: a target-only round is one verify graph plus host work on both sides of it
(layout and upload before, the D2H copy, acceptance, the scheduler and the token
stream after). At batch 1 that host work is 0.2–0.5 ms against a ~1 ms step of the
~1B config on an H200, and the GPU idles through it. With a step pending, the
next round's verify finds its outputs already computed (or computing) while the
host did the rest of the round, so host work hides behind the device.

How (``TargetEngine.verify``): after the replay of step r, its outputs' copies to the
host are queued, then step r+1 is queued with the same rows one position further
and its token read on the device from step r's argmax (stream order: the copies
run before the replay that overwrites the static outputs). The host then waits
for step r's copies only. The next verify takes step r+1 when it asks for the same
requests, in the same order, with no drafts, at exactly those lengths, and no
other engine call came between (prefill, release, an in-place weight copy and any
verify that does not match drop it; ``TargetEngine.drop_pending``).

When more than half of the recent queued steps were dropped, ``AheadGate`` stops
queuing for a while: a dropped step is a whole step of device time spent for nothing.

Exactness: the pending step is the very graph, inputs and weights the next verify
would run; greedy tokens are identical. A dropped step only wrote KV rows past its
rows' committed lengths (stale rows, overwritten later) or the scratch slot.

Must not know: gRPC, scheduling, frameworks, the model (the engine hands in its
registry call).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from runtime.batch_layout import Row, layout_rows
from runtime.graphs import GraphRegistry

WINDOW = 16      # the last queued steps whose fate the gate looks at
PAUSE = 64       # eligible rounds without queuing ahead after the window saw mostly drops ...
MAX_PAUSE = 4096  # ... doubled after each such window in a row, up to this


@dataclass(frozen=True)
class PendingStep:
    """A target-only greedy step queued ahead: rows ``ids`` at committed ``lengths``."""

    ids: tuple[str, ...]
    lengths: tuple[int, ...]     # each row's committed length (= the position its token is written at)
    outputs: tuple[Any, ...]     # (hidden [B, W, d], argmax [B, W], logits [B, W, V]) device views

    def matches(self, ids: tuple[str, ...], lengths: tuple[int, ...], drafted: bool) -> bool:
        """Whether a verify of ``ids`` at ``lengths`` (``drafted``: any row has drafts) is this step."""
        return not drafted and ids == self.ids and lengths == self.lengths


@dataclass
class AheadStats:
    launched: int = 0            # steps queued ahead
    used: int = 0                # taken by the next verify
    dropped: int = 0             # discarded (batch changed, drafts, prefill / release / reload between)


class AheadGate:
    """Whether to queue the next step ahead, from how the recent queued steps ended.

    A dropped step cost one step of device time that the next call's work waits
    behind (stream order). When more than half of the last ``WINDOW`` queued steps
    were dropped (a churning batch, adaptive k switching between drafting and
    target-only, two micro-batches alternating), queuing pauses for ``PAUSE``
    eligible rounds, then starts again with a fresh window; each such window in a
    row doubles the pause (up to ``MAX_PAUSE``: two alternating micro-batches then
    waste under 1 % of their steps), and a window with at most a quarter dropped
    resets it.
    """

    def __init__(self) -> None:
        self._outcomes: deque[bool] = deque(maxlen=WINDOW)
        self._paused = 0
        self._next_pause = PAUSE
        self.pauses = 0

    def allow(self) -> bool:
        """Called once per eligible round (target-only, greedy, replayed)."""
        if self._paused:
            self._paused -= 1
            return False
        return True

    def record(self, used: bool) -> None:
        self._outcomes.append(used)
        if len(self._outcomes) < WINDOW:
            return
        dropped = sum(not u for u in self._outcomes)
        if dropped > WINDOW // 2:
            self._paused, self.pauses = self._next_pause, self.pauses + 1
            self._next_pause = min(2 * self._next_pause, MAX_PAUSE)
            self._outcomes.clear()
        elif dropped <= WINDOW // 4:
            self._next_pause = PAUSE


class StepChain:
    """The target engine's side of decode-ahead (``TargetEngine.steps``): the pending step, whether
    a verify may take it, the counts (``stats``: launched / used / dropped) and the gate."""

    def __init__(self, registry: GraphRegistry, kind: str, scratch: int, max_len: int) -> None:
        self.registry, self.kind, self.scratch, self.max_len = registry, kind, scratch, max_len
        self.pending: PendingStep | None = None
        self.stats = AheadStats()
        self.gate = AheadGate()

    def queue(self, ids: tuple[str, ...], rows: list[Row], best: Any) -> None:
        """Queue the next target-only step of these verify ``rows``, when the gate allows: each
        row's token is this step's argmax at its first position (k = 0: no draft, the bonus is it),
        written one position further. Nothing when that step would not replay a graph or would
        not fit a row's cache. best: argmax int64 [B, W] (device) of the step just queued."""
        if not self.gate.allow():
            return
        nxt = [Row(r.slot, r.start + 1, r.tokens[:1]) for r in rows]
        need = max(r.start + 1 for r in nxt)
        if need > self.max_len or not self.registry.can_replay(self.kind, len(rows), need):
            return
        lay = layout_rows(nxt, 1, self.scratch, self.max_len)
        # NOTE: the replay copies the token column into its static input before it
        # overwrites ``best`` (stream order), and after the host copies of this step.
        outputs, replayed = self.registry.run(self.kind, {
            "tokens": best[:, :1], "write_slots": lay.write_slots, "positions": lay.positions,
            "read_slots": lay.read_slots}, need=need)
        if replayed:
            self.stats.launched += 1
            self.pending = PendingStep(ids, tuple(r.start for r in nxt), tuple(outputs))

    def take(self, ids: tuple[str, ...], lengths: tuple[int, ...], drafted: bool) -> tuple[Any, ...] | None:
        """The pending step's outputs when a verify of ``ids`` at ``lengths`` (``drafted``: any row
        has drafts) is it (``PendingStep.matches``); else None, and the pending step is dropped."""
        pending = self.pending
        if pending is None or not pending.matches(ids, lengths, drafted):
            self.drop()
            return None
        self.pending = None
        self.stats.used += 1
        self.gate.record(True)
        return pending.outputs

    def drop(self) -> None:
        """Forget the pending step (the engine's state changed, or a verify ran something else)."""
        if self.pending is not None:
            self.pending = None
            self.stats.dropped += 1
            self.gate.record(False)
