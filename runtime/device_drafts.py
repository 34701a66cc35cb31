"""Greedy drafts handed from a draft to a verify on the same device, never through the host.

Owns: what the target engine does with ``VerifyRequest.device`` (drafts a draft engine in this
process left on the device, ``ProposeRequest.on_device``): whether a verify can read them
there, the verify's token rows built on the device from them, and the greedy acceptance of
those drafts once the verify has brought them to the host beside its own outputs.

Why: with the draft in the target's process on the target's device (``colocated_draft``), a
round synchronised with the host twice: after the propose (its drafts to the host) and after
the verify. In between the device waited while the host built the verify and launched it
(on an H100 with the bundled model at batch 1: 0.78 ms a round, 0.46 ms of kernels). Read on
the device, the verify is queued behind the propose at once, and the drafts come back with
the verify's outputs: one synchronisation a round.

Must not know: which framework (everything goes through ``Ops``), graphs, rounds, gRPC.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from core.params import SamplingParams
from runtime import acceptance
from runtime.backends.base import Ops
from runtime.types import VerifyRequest


def chain_or_fetch(ops: Ops, reqs: list[VerifyRequest], params_of: Callable[[str], SamplingParams]
                   ) -> tuple[list[VerifyRequest], tuple[Any, np.ndarray] | None]:
    """(reqs, (drafts tensor [Bp, kmax], the tensor's row of each request)) when every drafting
    request's drafts are rows of one device tensor and it verifies greedily (the acceptance of a
    sampled or coupled row reads its drafts on the host before the verify's outputs are in);
    else (the requests with their drafts brought to the host now, None): one synchronisation
    more, then the verify of host drafts."""
    held = [r.device for r in reqs if len(r.drafts)]
    tensor = held[0].tokens if held and held[0] is not None else None
    if tensor is not None and all(d is not None and d.tokens is tensor for d in held) and all(
            params_of(r.request_id).greedy for r in reqs if len(r.drafts)):
        return reqs, (tensor, np.array([r.device.row if r.device is not None else 0 for r in reqs], np.int64))
    fetched: dict[int, np.ndarray] = {}
    out = []
    for r in reqs:
        if r.device is None:
            out.append(r)
            continue
        key = id(r.device.tokens)
        if key not in fetched:
            fetched[key] = ops.to_numpy(r.device.tokens)
        out.append(dataclasses.replace(r, drafts=fetched[key][r.device.row, : len(r.drafts)].astype(np.int64),
                                       device=None))
    return out, None


def verify_tokens(ops: Ops, host_tokens: np.ndarray, drafts: Any, rows: np.ndarray) -> Any:
    """The verify's tokens [B, W] on the device: column 0 (each row's last token) and the columns
    past kmax from the host layout, columns 1..kmax from the drafts tensor (its row ``rows[i]``
    for request i). Columns past a row's own k are its padding (written to the scratch slot,
    outputs ignored): which drafts sit there changes nothing."""
    width = host_tokens.shape[1]
    n, kmax = ops.shape(drafts)[0], min(ops.shape(drafts)[1], width - 1)
    cols = drafts if rows.tolist() == list(range(n)) else ops.index_select(drafts, _upload(ops, rows), 0)
    host = _upload(ops, host_tokens)                               # one upload; its columns around the drafts
    parts = [host[:, :1], cols[:, :kmax]]
    if kmax < width - 1:
        parts.append(host[:, 1 + kmax:])
    return ops.cat(parts, 1)


def _upload(ops: Ops, arr: np.ndarray) -> Any:
    """An int64 host array on the device without waiting for the device's queued work.
    NOTE: not ``ops.from_numpy``: a CUDA copy from pageable memory waits for the stream first,
    that is for the propose this verify is to be queued behind."""
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    out = ops.zeros(arr.shape, "int64")
    ops.copy_from_numpy(out, arr)
    return out


def accepted(drafts: np.ndarray, rows: np.ndarray, ks: np.ndarray, best: np.ndarray) -> np.ndarray:
    """Each request's greedy accepted count, from the host copy of the drafts tensor (request i's
    drafts are its row ``rows[i]``, first ``ks[i]`` columns) and the verify's argmax ``best``
    [B, W]: ``acceptance.accepted_greedy_rows`` on those rows. Neither the requests nor a host
    layout are rebuilt with the drafts (per request and round, that was the larger part of a
    chained verify's host work at batch 8)."""
    return acceptance.accepted_greedy_rows(drafts[rows], ks, best)
