"""The round-cost model of adaptive speculation length: what a round of k drafts costs.

Owns: the running estimates of a round's parts (a drafting round's verify, a
target-only round's step and host work, the draft time per k, the draft
exchange) and of whole rounds (start-to-start periods), and T(k) from them.
Pure Python, no frameworks: the round loop reports every round with
``RoundCosts.observe``; ``runtime.adaptive_k`` asks ``RoundCosts.cost``.

Must not know: acceptance, requests, probes, workers, gRPC, tensors.

A round's cost by its parts (runtime/adaptive_k.py's doc has the whole model):

    T(k) = t_verify(k) + [k > 0] * (t_exchange + draft_time(k))

What a round really costs: the sum above leaves out what happens around the
parts (the loop's own work between rounds, streaming the chunks, threads
competing for the interpreter), and that is not the same for both kinds of
round: measured on an H200 with the bundled model, a target-only round took
1.17 ms inside but 1.38 ms start to start, a k = 3 round 3.69 vs 3.72 ms.
So once both kinds have been seen (``MIN_PERIODS`` each), T(0) is the median
start-to-start period of target-only rounds, and T(k > 0) the median period of
drafting rounds less their draft time, plus the draft time of k drafts.
Before that, T(0) is the parts' sum of target-only rounds (their step and
the host work around it), or a drafting round's verify while none was timed:
never less, and what a target-only round cost before it had a step of its own.

The draft time of k drafts (``RoundCosts.draft_time``) is one catch-up pass
(the pending pairs, giving draft 1) plus k - 1 substeps: a + b k, not k times
one price. Measured per k (the median of the last rounds that drafted k); a k
not measured yet comes from the line through the measured ones (least
squares), and k * t_draft only while a single k has been timed. Regression it
fixes: charging a round's draft time per draft made a k = 1 round's catch-up
(about 2.9 ms on 2 CPU cores, against about 1.2 ms per later substep, by the
loop's own estimates) the price of every draft, so the longer a request stayed
at k = 1, the dearer k = 3 looked (5.8 ms above k = 1 where it cost 2.4).

Which rounds feed the cost estimates: a drafting round right after rounds
that did not draft (a probe's first round, the first round of the loop) is
not steady state — its catch-up carries every pair the skipped rounds left
(wider than any captured width: the draft runs it eagerly) and the first
exchange on a fresh stream pays its opening. Its verify time counts, its
draft and exchange times do not. Nor is a target-only round right after a
drafting one: with rounds queued ahead (runtime/round_ahead.py) it waits for
the round the drafting one queued, which it drops. Its parts stand for T(0)
only while no steady target-only round was timed (``target_only_unsteady``).
Regression: in the trace simulation of the H100 regime (docs/performance.md §
Session 32) such rounds were the only T(0) a mostly drafting loop had, up to
twice the steady figure, and it drafted on random bytes at 0.78-0.81 of
target-only's speed (0.82 measured on the H100). What either round of a change
of kind costs beyond the steady round of its kind is kept apart
(``entry_extra``, ``leave_extra``: runtime/adaptive_k.py charges it to the k
that changes kind). And no start-to-start period spans a change of the batch
(requests retired and admitted in between).
"""

from __future__ import annotations

import collections
import statistics

MIN_PERIODS = 3              # measured round periods of each kind before they replace the part sums


def round_cost(k: int, t_verify: float, t_draft: float, t_exchange: float) -> float:
    """T(k): a verify, plus (when k > 0) one draft exchange and k draft substeps."""
    return t_verify + (t_exchange + k * t_draft if k > 0 else 0.0)


def line_fit(points: dict[int, float]) -> tuple[float, float]:
    """Least squares y = a + b k through {k: y} (two or more k), with a, b >= 0: a draft time
    neither shrinks with k nor goes below zero."""
    n = len(points)
    mk = sum(points) / n
    my = sum(points.values()) / n
    var = sum((k - mk) ** 2 for k in points)
    b = max(sum((k - mk) * (y - my) for k, y in points.items()) / var, 0.0)
    a = my - b * mk
    if a < 0:                                  # through the origin instead
        a, b = 0.0, sum(k * y for k, y in points.items()) / sum(k * k for k in points)
    return a, b


class Window:
    """The last ``n`` observations, and their median, computed again only after a change (a
    target-only round changes only its own windows; see ``RoundCosts.observe``). ``n``: how many
    it holds (an attribute: the cost model asks it many times a round, ``len`` is a call)."""

    __slots__ = ("_items", "_median", "n")

    def __init__(self, n: int, items: tuple[float, ...] | list[float] = ()) -> None:
        self._items: collections.deque[float] = collections.deque(items, maxlen=n)
        self._median: float | None = None
        self.n = len(self._items)

    def append(self, x: float) -> None:
        self._items.append(x)
        self._median = None
        self.n = len(self._items)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def median(self) -> float:
        if self._median is None:
            self._median = statistics.median(self._items)
        return self._median


class RoundCosts:
    """Running estimates of the round's parts (seconds), shared by every request of a loop.

    Each part is the median of its last ``WINDOW`` observations: robust to the
    outliers a serving loop sees (a stream opened, a request joining, a GC
    pause), which would otherwise hold an average high for many rounds.
    """

    WINDOW = 31

    def __init__(self, t_verify: float = 1e-3, t_draft: float = 1e-4, t_exchange: float = 3e-4) -> None:
        self._verify = Window(self.WINDOW)                 # drafting rounds' verify (max_k + 1 positions)
        self._verify_guess = t_verify                      # ... before any round was timed
        self._verify0 = Window(self.WINDOW)                # steady target-only rounds' one-position step ...
        self._overhead0 = Window(self.WINDOW)              # ... and what they cost around it
        self._verify0_after = Window(self.WINDOW)          # the same of target-only rounds right after a
        self._overhead0_after = Window(self.WINDOW)        # drafting round (used while no steady one was timed)
        self._draft = Window(self.WINDOW, [t_draft])
        self._draft_by_k: dict[int, collections.deque[float]] = {}     # k -> steady rounds' draft seconds
        self._draft_median: dict[int, float] = {}    # k -> their median, once MIN_PERIODS were timed
        self._exchange = Window(self.WINDOW, [t_exchange])
        self._drafted_last = False     # did the previous observed round draft?
        # Start-to-start periods: of target-only rounds, and of drafting rounds less their draft time.
        self._period0 = Window(self.WINDOW)
        self._fixed_spec = Window(self.WINDOW)
        # What a change of kind costs beyond the steady round of the new kind: a drafting round right
        # after rounds that did not draft (entry), a target-only round right after one that drafted (leave).
        self._entry = Window(self.WINDOW)
        self._leave = Window(self.WINDOW)
        self._last_start: float | None = None
        self._last_batch: frozenset[str] | None = None
        self._prev_k, self._prev_steady, self._prev_draft = 0, False, 0.0
        self._prev_after = False          # the previous round: target-only right after a drafting one
        self._prev_watched = False
        self._prev_parts = 0.0                              # the previous round's verify + everything else
        self._watched = Window(self.WINDOW)                # what rounds that carried a watch took
        self._costs: dict[int, float] = {}   # k -> T(k), until observe changes what it reads
        self.version = 0                      # bumped when T(k > 0) may change (adaptive_k.round_k_star's cache)
        self._line: tuple[float, float] | None = None    # line_fit of the measured draft times, kept

    @property
    def t_verify(self) -> float:
        """A drafting round's verify; until one was timed, a target-only round's step (never
        more) or, before anything was timed, the constructor's guess."""
        if self._verify.n:
            return self._verify.median
        return self._verify0.median if self._verify0.n else self._verify_guess

    @property
    def t_verify0(self) -> float:
        """A round's verify when nobody drafts (the target's one-position step): of steady
        target-only rounds, else of those right after a drafting round, else a drafting round's,
        which is never less, until one was timed."""
        for w in (self._verify0, self._verify0_after):
            if w.n:
                return w.median
        return self.t_verify

    @property
    def t_round0(self) -> float:
        """A target-only round by its parts: the one-position step and the host work around it."""
        over = self._overhead0 if self._overhead0.n else self._overhead0_after
        return self.t_verify0 + (over.median if over.n else 0.0)

    @property
    def t_draft(self) -> float:
        """One draft substep."""
        return self._draft.median

    def draft_time(self, k: int) -> float:
        """Seconds of drafting in a round of k drafts (module doc): measured at k, else the
        line through the k measured so far, else k * t_draft."""
        if k <= 0:
            return 0.0
        measured = self._draft_median
        if k in measured:
            return measured[k]
        if len(measured) >= 2:
            if self._line is None:                # kept until a measured k's median changes
                self._line = line_fit(measured)
            a, b = self._line
            return a + b * k
        return k * self.t_draft

    @property
    def t_exchange(self) -> float:
        """The draft call's fixed cost (transport, catch-up, host work)."""
        return self._exchange.median

    @property
    def drafting_measured(self) -> bool:
        """Have enough steady drafting rounds been timed for the cost model?"""
        return self._fixed_spec.n >= MIN_PERIODS

    @property
    def last_k(self) -> int:
        """The k of the last round observed."""
        return self._prev_k

    @property
    def entry_extra(self) -> float:
        """What a drafting round right after one that did not draft costs beyond T(k) (its catch-up
        carries the skipped pairs; nothing was queued ahead for it): the median, 0 before one was timed."""
        return self._entry.median if self._entry.n else 0.0

    @property
    def leave_extra(self) -> float:
        """What a target-only round right after a drafting one costs beyond T(0) (it waits for the round
        that one queued ahead): the median, 0 before one was timed."""
        return self._leave.median if self._leave.n else 0.0

    @property
    def target_only_unsteady(self) -> bool:
        """Is T(0) only what target-only rounds right after a drafting one took (their time holds
        what that round left on the device), with the last round target-only? Then the next one,
        if target-only too, gives T(0) its first steady figure."""
        return self._prev_k == 0 and not self._verify0.n and self._verify0_after.n > 0

    @property
    def watch_extra(self) -> float | None:
        """What a round that carried a watch probe (runtime.adaptive_k) takes beyond a target-only
        round, T(0); None before one was timed."""
        return max(self._watched.median - self.cost(0), 0.0) if self._watched.n else None

    @property
    def _periods_measured(self) -> bool:
        return self._period0.n >= MIN_PERIODS and self._fixed_spec.n >= MIN_PERIODS

    def cost(self, k: int) -> float:
        """T(k) in seconds (``_cost``), kept until an ``observe`` changes what it reads."""
        got = self._costs.get(k)
        if got is None:
            got = self._costs[k] = self._cost(k)
        return got

    def _cost(self, k: int) -> float:
        """T(k) in seconds: measured periods once both kinds of round were seen, else the parts' sum."""
        if self._periods_measured:
            if k == 0:
                return self._period0.median
            return self._fixed_spec.median + self.draft_time(k)
        return self.t_verify + self.t_exchange + self.draft_time(k) if k > 0 else self.t_round0

    def observe(self, k_max: int, draft_s: float, verify_s: float, overhead_s: float,
                started: float | None = None, batch: frozenset[str] | None = None, watched: bool = False) -> None:
        """One round: its largest k, draft compute, verify compute and everything else; ``started``:
        when it started (perf_counter seconds), for the start-to-start period of the round before;
        ``batch``: its requests' ids; ``watched``: a target-only round that carried a watch probe
        (runtime.adaptive_k), whose time is neither kind's and feeds no estimate."""
        measured = self._periods_measured           # before this round (the kept costs, below)
        prev_start, prev_k, self._last_start = self._last_start, self._prev_k, started
        prev_batch, self._last_batch = self._last_batch, batch
        prev_watched, self._prev_watched = self._prev_watched, watched
        self._prev_k = k_max
        # NOTE: no period across a change of the batch: it holds the retiring of the requests
        # that ended and the prefill of the ones that joined. Regression: at batch 1 a request's
        # last round is often k = 0 (one token left) and the next starts after the next request's
        # admission; on CPU those periods made T(0) ~60 ms where a target-only round took ~8.
        # NOTE: nor one of a round that carried a watch probe: in process its draft runs inside
        # the round (a target-only round then looked ~7x dearer on CPU, and drafting cheap).
        same_batch = started is not None and prev_start is not None and (batch is None or batch == prev_batch)
        if same_batch and not prev_watched:
            period = started - prev_start
            if prev_k == 0:
                if not self._prev_after:
                    self._period0.append(period)
                elif self._periods_measured:
                    self._leave.append(max(period - self._cost(0), 0.0))
            elif self._prev_steady:
                self._fixed_spec.append(period - self._prev_draft)
            elif self._periods_measured:
                self._entry.append(max(period - self._cost(prev_k), 0.0))
        elif prev_watched:               # its period where there is one, else its parts
            self._watched.append(started - prev_start if same_batch else self._prev_parts)
        self._prev_parts = verify_s + overhead_s
        if k_max > 0:
            self._verify.append(verify_s)
        elif not watched and not self._drafted_last:
            self._verify0.append(verify_s)
            self._overhead0.append(overhead_s)
        elif not watched:
            self._verify0_after.append(verify_s)
            self._overhead0_after.append(overhead_s)
        self._prev_after = k_max == 0 and not watched and self._drafted_last
        steady = self._drafted_last        # module doc: neither round right after a change of kind is
        self._drafted_last = k_max > 0
        self._prev_steady, self._prev_draft = k_max > 0 and steady, draft_s
        if k_max > 0 and steady:
            # NOTE: a round's draft time is one catch-up pass plus k-1 substeps: kept whole per k
            # (draft_time), and per draft for t_draft (used while a single k has been timed);
            # the round's overhead (which includes the exchange) goes to the exchange.
            self._draft.append(draft_s / k_max)
            by_k = self._draft_by_k.setdefault(k_max, collections.deque(maxlen=self.WINDOW))
            by_k.append(draft_s)
            if len(by_k) >= MIN_PERIODS:          # kept up to date here: cost() reads it every k, every round
                self._draft_median[k_max] = statistics.median(by_k)
                self._line = None
            self._exchange.append(overhead_s)
        # NOTE: what ``cost`` keeps, dropped once anything it reads changed: a target-only
        # round between target-only rounds changes only T(0) once periods are measured (its
        # verify goes to the target-only window, which T(0) alone reads). Why keep anything: on the
        # H200 host, adaptive rounds' overhead (k = 0 and k = 3 alike) was ~60 us above fixed-k
        # rounds' in one run, ~8 % of a target-only round; the policy's host time per
        # target-only round (request_ks + observe, 2-core CPU, hot loop) went from 19.3 to
        # 3.9 us with T(k), E(k), the medians and the best drafting k (adaptive_k.round_k_star) kept
        # between changes.
        # A target-only round after a target-only one moves T(k > 0) only where that reads a
        # target-only window: before periods were measured while no drafting verify was timed
        # (t_verify), or when this round completed the periods (``_cost`` changes formula).
        # Regression: a loop whose probes are watches on text that never drafts times no steady
        # drafting round, so its periods stay unmeasured, and every round dropped what was kept
        # (the policy's host time per round 5x a measured loop's, 2-core CPU).
        if k_max > 0 or prev_k > 0 or self._periods_measured != measured or not (measured or self._verify.n):
            self._costs.clear()
            self.version += 1
        else:
            self._costs.pop(0, None)

    def __repr__(self) -> str:
        return (f"RoundCosts(t_verify={self.t_verify:.6f}, t_verify0={self.t_verify0:.6f}, "
                f"t_draft={self.t_draft:.6f}, "
                f"t_exchange={self.t_exchange:.6f})")
