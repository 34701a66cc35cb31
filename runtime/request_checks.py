"""Checks every engine applies to the items of a batched request, and the batch loop around them.

Owns: the field checks shared by the engines (request id, token range, hidden rows) and
``check_batch``: one pass over a batch that runs the engine's per-item check, refuses repeated
request ids, and returns the valid items apart from the refused ones (with their exceptions).
The engines own what each of their requests must satisfy (``DraftEngine.check_prefill`` ...);
workers only run these checks, they add none.

Must not know: gRPC, status codes (exceptions map to them in ``core.wire``), frameworks.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

MAX_REQUEST_ID_CHARS = 256


def check_request_id(request_id: str, field: str) -> None:
    if not request_id:
        raise ValueError(f"{field}: request_id is required (empty)")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"{field}: request_id is {len(request_id)} characters, at most {MAX_REQUEST_ID_CHARS}")


def check_token_range(tokens: np.ndarray, vocab_size: int, field: str) -> None:
    """Every id in [0, vocab_size); names the first offender."""
    n = tokens.size
    if n == 0:
        return
    # NOTE: the common case at once (every round checks every item): a round's few ids as Python
    # ints (a third of a numpy reduction's time up to ~16 ids on the 2-core CPU), more in one
    # reduction, int64 ids seen as unsigned putting the negative ones above any vocabulary.
    if n <= 16 and tokens.dtype.kind in "iu":
        ids = tokens.reshape(-1).tolist()
        if min(ids) >= 0 and max(ids) < vocab_size:
            return
    elif tokens.dtype == np.int64 and tokens.view(np.uint64).max() < vocab_size:
        return
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{field}[{i}]: token id {int(tokens[i])} is out of range [0, {vocab_size})")


def check_hidden(hidden: np.ndarray, rows: int, width: int, field: str) -> None:
    """hidden must be float [rows, width] (or uint16 bf16 bit patterns) and finite."""
    if hidden.dtype.kind != "f" and hidden.dtype != np.uint16:
        raise ValueError(f"{field}: dtype {hidden.dtype} is not a float type")
    if hidden.shape != (rows, width):
        raise ValueError(f"{field}: shape {list(hidden.shape)}, expected [{rows}, {width}]")
    # bf16 bits: exponent all ones is inf or NaN.
    finite = (hidden & 0x7F80) != 0x7F80 if hidden.dtype == np.uint16 else np.isfinite(hidden)
    if not finite.all():
        raise ValueError(f"{field}: contains NaN or infinite values")


def repeated_ids(ids: list[str]) -> set[str]:
    seen: set[str] = set()
    dup: set[str] = set()
    for rid in ids:
        (dup if rid in seen else seen).add(rid)
    return dup


# check_one(i, item, n_valid_so_far) -> the item to run (possibly normalised); raises to refuse it.
ItemCheck = Callable[[int, Any, int], Any]


def check_batch(items: list[tuple[int, Any]], check_one: ItemCheck) -> tuple[list[tuple[int, Any]],
                                                                                 dict[int, Exception]]:
    """(valid (i, item) pairs in order, {i: why item i is refused}). ``i`` is the item's index in
    the request (``items[i]`` in messages). A request id may appear once per batch."""
    dups = repeated_ids([it.request_id for _, it in items])
    good: list[tuple[int, Any]] = []
    refused: dict[int, Exception] = {}
    for i, it in items:
        try:
            check_request_id(it.request_id, f"items[{i}].request_id")
            if it.request_id in dups:
                raise ValueError(f"items[{i}].request_id: {it.request_id!r} appears more than once in the batch")
            good.append((i, check_one(i, it, len(good))))
        except Exception as exc:  # noqa: BLE001 - becomes the item's error
            refused[i] = exc
    return good, refused
