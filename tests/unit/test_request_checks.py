"""``runtime/request_checks.py``'s token check: every id in [0, vocab), the first offender named,
whatever the path it takes (a round's few ids as Python ints, a longer array in one reduction)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.request_checks import check_token_range

VOCAB = 258
SIZES = [1, 3, 16, 17, 200]          # both sides of the Python-int path's 16 ids


@pytest.mark.parametrize("n", SIZES)
def test_ids_in_range_pass(n):
    for dtype in (np.int64, np.int32, np.uint16):
        check_token_range((np.arange(n) * 7 % VOCAB).astype(dtype), VOCAB, "tokens")
    check_token_range(np.zeros(0, np.int64), VOCAB, "tokens")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 5, -1, int(np.iinfo(np.int64).min)])
def test_the_first_offender_is_named(n, bad):
    arr = np.arange(n, dtype=np.int64) % VOCAB
    arr[n // 2] = arr[-1] = bad
    msg = rf"tokens\[{n // 2}\]: token id {bad} is out of range \[0, {VOCAB}\)"
    with pytest.raises(ValueError, match=msg):
        check_token_range(arr, VOCAB, "tokens")
    if bad > 0:
        with pytest.raises(ValueError, match=msg):
            check_token_range(arr.astype(np.int32), VOCAB, "tokens")
