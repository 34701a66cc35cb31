"""runtime/batch_layout.py: ``layout_rows`` against a per-row reference (ragged rows, padding, errors)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.batch_layout import VECTOR_ROWS, Row, layout_rows


def reference(rows, width, scratch):
    b = len(rows)
    tokens = np.zeros((b, width), np.int64)
    write = np.full((b, width), scratch, np.int64)
    pos = np.empty((b, width), np.int64)
    for i, r in enumerate(rows):
        m = len(r.tokens)
        tokens[i, :m], write[i, :m] = r.tokens, r.slot
        pos[i] = np.minimum(np.arange(width) + r.start, r.start + m - 1)   # padding at the last position
    return tokens, write, pos


@pytest.mark.parametrize("seed", range(6))
def test_ragged_rows_pack_as_row_by_row(seed):
    rng = np.random.default_rng(seed)
    width, scratch = int(rng.integers(1, 9)), 99
    rows = [Row(int(rng.integers(0, 16)), int(rng.integers(0, 500)), rng.integers(0, 1000, int(rng.integers(1, width + 1))))
            for _ in range(int(rng.integers(1, 12)))]
    lay = layout_rows(rows, width, scratch, 1024)
    tokens, write, pos = reference(rows, width, scratch)
    assert (lay.tokens == tokens).all() and (lay.write_slots == write).all() and (lay.positions == pos).all()
    assert lay.read_slots.tolist() == [r.slot for r in rows] and lay.lengths.tolist() == [len(r.tokens) for r in rows]
    assert lay.last_index.tolist() == [i * width + len(r.tokens) - 1 for i, r in enumerate(rows)]
    assert all(a.dtype == np.int64 for a in (lay.tokens, lay.write_slots, lay.positions, lay.read_slots))


def test_list_tokens_and_an_empty_batch():
    lay = layout_rows([Row(3, 10, [5, 6])], 4, 7, 64)
    assert lay.tokens.tolist() == [[5, 6, 0, 0]] and lay.positions.tolist() == [[10, 11, 11, 11]]
    assert layout_rows([], 4, 7, 64).tokens.shape == (0, 4)


@pytest.mark.parametrize("m", [0, 5])
@pytest.mark.parametrize("others", [0, VECTOR_ROWS])          # the row loop, and the whole-array path
def test_a_row_of_no_tokens_or_too_many_names_it(m, others):
    rows = [Row(0, 0, np.array([1])), Row(1, 0, np.arange(m))] + [Row(2, 0, np.array([3, 4]))] * others
    with pytest.raises(ValueError, match=f"row 1 has {m} tokens; expected 1..4"):
        layout_rows(rows, 4, 7, 64)


@pytest.mark.parametrize("b", [VECTOR_ROWS, 9, 33])
def test_a_batch_of_many_rows_packs_as_row_by_row(b):
    """From VECTOR_ROWS rows on the layout takes whole-array numpy calls: the same arrays."""
    rng = np.random.default_rng(b)
    rows = [Row(int(rng.integers(0, 40)), int(rng.integers(0, 500)),
                list(rng.integers(0, 1000, int(rng.integers(1, 6))))) for _ in range(b)]
    lay = layout_rows(rows, 5, 99, 1024)
    tokens, write, pos = reference(rows, 5, 99)
    assert (lay.tokens == tokens).all() and (lay.write_slots == write).all() and (lay.positions == pos).all()
    assert lay.read_slots.tolist() == [r.slot for r in rows] and lay.lengths.tolist() == [len(r.tokens) for r in rows]
    assert lay.last_index.tolist() == [i * 5 + len(r.tokens) - 1 for i, r in enumerate(rows)]
    assert all(a.dtype == np.int64 for a in (lay.tokens, lay.write_slots, lay.positions, lay.read_slots))


@pytest.mark.parametrize("seed", range(4))
def test_one_token_rows_pack_as_row_by_row(seed):
    """Width 1 (a decode step) takes a path of its own: the same arrays as the reference."""
    rng = np.random.default_rng(seed)
    rows = [Row(int(rng.integers(0, 16)), int(rng.integers(0, 500)), rng.integers(0, 1000, 1))
            for _ in range(int(rng.integers(1, 12)))]
    lay = layout_rows(rows, 1, 99, 1024)
    tokens, write, pos = reference(rows, 1, 99)
    assert (lay.tokens == tokens).all() and (lay.write_slots == write).all() and (lay.positions == pos).all()
    assert lay.read_slots.tolist() == [r.slot for r in rows] and lay.lengths.tolist() == [1] * len(rows)
    assert lay.last_index.tolist() == list(range(len(rows)))
    assert all(a.dtype == np.int64 and a.shape == (len(rows), 1) for a in (lay.tokens, lay.write_slots, lay.positions))
    lay.write_slots[0, 0] = -1                                  # the arrays are the caller's: none shared
    assert lay.read_slots[0] == rows[0].slot
    assert layout_rows([Row(2, 9, [4])], 1, 7, 64).tokens.tolist() == [[4]]
    assert layout_rows([], 1, 7, 64).tokens.shape == (0, 1)


@pytest.mark.parametrize("m", [0, 2])
def test_a_one_token_row_of_no_tokens_or_two_names_it(m):
    with pytest.raises(ValueError, match=f"row 1 has {m} tokens; expected 1..1"):
        layout_rows([Row(0, 0, np.array([1])), Row(1, 0, np.arange(m))], 1, 7, 64)
