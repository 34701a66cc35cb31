"""Host-side layout of a ragged batch onto fixed [B, T] arrays.

Owns: turning per-request (slot, start position, tokens) rows into the
padded int64 arrays the step functions take, and the attention span an eager
run needs. Padding positions write to the scratch slot, so they can never
touch a live request's KV rows.

Must not know: frameworks, models, gRPC. numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ATTEND_ALIGN = 64  # eager attention spans are rounded up to this (fewer distinct shapes)
SPAN_MIN = 256     # smallest context bucket captured as a graph


@dataclass(slots=True)                 # per request per round, not frozen: runtime/types.py's module doc
class Row:
    slot: int
    start: int              # position of the row's first token
    tokens: np.ndarray      # int64 [m], m >= 1


@dataclass(frozen=True)
class Layout:
    tokens: np.ndarray       # int64 [B, T]
    write_slots: np.ndarray  # int64 [B, T]   scratch slot on padding
    positions: np.ndarray    # int64 [B, T]
    read_slots: np.ndarray   # int64 [B]
    last_index: np.ndarray   # int64 [B]      flat index (b*T + m_b - 1) of each row's last real token
    lengths: np.ndarray      # int64 [B]      m_b


VECTOR_ROWS = 4     # from this many rows a layout is built with whole-array numpy calls


def layout_rows(rows: list[Row], width: int, scratch_slot: int, max_len: int) -> Layout:
    """Pack rows into [B, width]; every row must have 1 <= m <= width tokens."""
    b = len(rows)
    if width == 1:
        return _one_token_rows(rows)
    if b >= VECTOR_ROWS:
        return _many_rows(rows, width, scratch_slot)
    tokens = np.zeros((b, width), dtype=np.int64)
    # Padding: scratch slot, positions 0..width-1 (distinct, always in range).
    write_slots = np.full((b, width), scratch_slot, dtype=np.int64)
    positions = np.empty((b, width), dtype=np.int64)
    read_slots = np.empty(b, dtype=np.int64)
    lengths = np.empty(b, dtype=np.int64)
    ramp = np.arange(width, dtype=np.int64)
    for i, r in enumerate(rows):
        m = len(r.tokens)
        if not 1 <= m <= width:
            raise ValueError(f"row {i} has {m} tokens; expected 1..{width}")
        tokens[i, :m] = r.tokens
        write_slots[i, :m] = r.slot
        # Positions start..start+m-1; padding queries of a live row sit at the
        # row's last position: their (ignored) outputs stay finite and they
        # read only that row's rows.
        np.minimum(ramp + r.start, r.start + m - 1, out=positions[i])
        read_slots[i] = r.slot
        lengths[i] = m
    last_index = np.arange(b, dtype=np.int64) * width + lengths - 1
    return Layout(tokens, write_slots, positions, read_slots, last_index, lengths)


def _many_rows(rows: list[Row], width: int, scratch_slot: int) -> Layout:
    """``layout_rows`` with a fixed number of numpy calls, whatever the batch: cheaper than the
    row loop from ``VECTOR_ROWS`` rows on (2-core CPU, width 4: 18.5 against 15.1 µs at 8 rows,
    53 against 20 µs at 32; at one row 6.3 against 12.6). Same arrays."""
    b = len(rows)
    lengths = np.fromiter((len(r.tokens) for r in rows), dtype=np.int64, count=b)
    bad = (lengths < 1) | (lengths > width)
    if bad.any():
        i = int(bad.argmax())
        raise ValueError(f"row {i} has {lengths[i]} tokens; expected 1..{width}")
    slots = np.fromiter((r.slot for r in rows), dtype=np.int64, count=b)
    starts = np.fromiter((r.start for r in rows), dtype=np.int64, count=b)
    ramp = np.arange(width, dtype=np.int64)
    real = ramp < lengths[:, None]                                    # [B, W]: the rows' own tokens
    tokens = np.zeros((b, width), dtype=np.int64)
    tokens[real] = np.concatenate([r.tokens for r in rows])          # row-major: each row's in order
    write_slots = np.where(real, slots[:, None], scratch_slot)
    # Padding queries of a live row sit at its last position (as in the row loop).
    positions = np.minimum(ramp + starts[:, None], (starts + lengths - 1)[:, None])
    last_index = np.arange(b, dtype=np.int64) * width + lengths - 1
    return Layout(tokens, write_slots, positions, slots, last_index, lengths)


def _one_token_rows(rows: list[Row]) -> Layout:
    """``layout_rows`` at width 1 (a decode step: every round of a target-only batch), the same
    arrays without the per-row slicing: no padding to write, each row its one token."""
    b = len(rows)
    for i, r in enumerate(rows):
        if len(r.tokens) != 1:
            raise ValueError(f"row {i} has {len(r.tokens)} tokens; expected 1..1")
    slots = np.fromiter((r.slot for r in rows), dtype=np.int64, count=b)
    tokens = np.fromiter((r.tokens[0] for r in rows), dtype=np.int64, count=b).reshape(b, 1)
    positions = np.fromiter((r.start for r in rows), dtype=np.int64, count=b).reshape(b, 1)
    return Layout(tokens, slots.reshape(b, 1).copy(), positions, slots, np.arange(b, dtype=np.int64),
                  np.ones(b, dtype=np.int64))


def attend_span(positions: np.ndarray, max_len: int) -> int:
    """Cache rows an eager step must read: max position + 1, rounded up."""
    need = int(positions.max()) + 1 if positions.size else 1
    return min(max_len, -(-need // ATTEND_ALIGN) * ATTEND_ALIGN)


def attend_need(positions: np.ndarray) -> int:
    """Cache rows a step must read: max position + 1."""
    return int(positions.max()) + 1 if positions.size else 1


def context_spans(max_len: int) -> tuple[int, ...]:
    """Context-length buckets captured as graphs: 256, 384, 512, 768, 1024, ... and max_len.

    Steps of x1.5 and x4/3 keep the capture count logarithmic in max_len while a
    step never reads more than 1.5x its real context (beyond SPAN_MIN). Measured:
    with doubling spans, a 1B verify at context 2,048 (span 4,096) took 1.50x
    its time at 256; attention there is bandwidth-bound, so the over-read costs."""
    spans, i = [], 0
    while (SPAN_MIN << i) < max_len:
        spans += [s for s in (SPAN_MIN << i, (SPAN_MIN * 3 // 2) << i) if s < max_len]
        i += 1
    return tuple(spans) + (max_len,)


def prefill_graph_widths(widths: tuple[int, ...], tokens: int, max_len: int,
                         buckets: tuple[int, ...]) -> dict[int, int]:
    """Prompt widths captured as prefill graphs -> the largest batch bucket each is captured
    at: buckets with bucket * width <= ``tokens`` (the widest graph's rows), widths <= max_len.
    A width no bucket fits is left out (those prompts run eagerly)."""
    out = {}
    for w in sorted(widths):
        fit = [b for b in buckets if b * w <= tokens]
        if w <= max_len and fit:
            out[w] = fit[-1]
    return out


def prefill_width(widths: dict[int, int], n: int, batch: int) -> int | None:
    """The smallest captured prefill width holding ``n`` tokens at this batch, or None (eager)."""
    return next((w for w, top in widths.items() if w >= n and batch <= top), None)


def single_token_places(places: list[tuple[int, int] | None], scratch_slot: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """One token per row at (slot, position) = places[i], or on the scratch slot at position 0
    where places[i] is None: what ``layout_rows`` gives at width 1 (tokens aside), without
    building rows. -> write_slots [B, 1], positions [B, 1], read_slots [B], last_index [B]
    (int64) and the cache rows the step reads (max position + 1)."""
    b = len(places)
    slots = np.fromiter((p[0] if p is not None else scratch_slot for p in places), dtype=np.int64, count=b)
    pos = np.fromiter((p[1] if p is not None else 0 for p in places), dtype=np.int64, count=b)
    need = int(max((p[1] for p in places if p is not None), default=0)) + 1
    return slots.reshape(b, 1), pos.reshape(b, 1), slots, np.arange(b, dtype=np.int64), need
