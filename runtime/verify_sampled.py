"""The sampled and coupled rows of a verify, decided on the device.

Owns: the inputs the device sampler (``Ops.sampler``, runtime/backends/torch_sampling.py) takes
for a verify's rows that do not decode greedily: for a sampled row, Leviathan acceptance of its
drafts and the token after them (``rejection_on_device``: the drafts, their q rows, each
position's counter-based uniforms); for a coupled row, the Gumbel-max choice at every verified
position (``coupled_on_device``). Row j of request i decides position ``starts[i] + j``; the
numbers are runtime/random_stream.py's, the same the numpy path (runtime/acceptance.py) draws.
``states[i]`` is request i's target state (its ``params`` and ``seed``).

Must not know: graphs, caches, rounds, which framework (everything goes through ``Ops``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from runtime import random_stream
from runtime.backends.base import Ops
from runtime.types import VerifyRequest


def rejection_on_device(ops: Ops, reqs: list[VerifyRequest], states: list, starts: list[int], sampled: list[int],
                        logits: Any) -> Any:
    """Leviathan acceptance of the sampled rows on the device -> (a [S], token [S]) tensors.
    Row j of a request decides position starts[i] + j: its counter-based uniforms come along
    (u_acc [S, kmax] and u_tok [S, kmax+1]; padding past a row's k is never read)."""
    width = ops.shape(logits)[1]
    kmax = max(len(reqs[i].drafts) for i in sampled)
    drafts = np.zeros((len(sampled), kmax), dtype=np.int64)
    for row, i in enumerate(sampled):
        drafts[row, : len(reqs[i].drafts)] = reqs[i].drafts
    ps = [states[i].params for i in sampled]
    pos = np.asarray([starts[i] for i in sampled], dtype=np.int64)[:, None] + np.arange(kmax + 1)  # [S, kmax+1]
    u_acc = np.stack([random_stream.uniforms(states[i].seed, pos[row, :kmax], random_stream.PURPOSE_ACCEPT)
                      for row, i in enumerate(sampled)])                                      # [S, kmax]
    u_tok = np.stack([random_stream.uniforms(states[i].seed, pos[row], random_stream.PURPOSE_SAMPLE)
                      for row, i in enumerate(sampled)])                                      # [S, kmax+1]
    rows = ops.from_numpy(np.asarray(sampled, dtype=np.int64), "int64")
    sel = ops.index_select(logits, rows, 0)                                              # [S, k+1, V]
    if kmax + 1 < width:
        sel = sel[:, : kmax + 1]
    return ops.sampler.verify(sel, drafts, np.asarray([len(reqs[i].drafts) for i in sampled]),
                              [reqs[i].draft_probs for i in sampled], [p.temperature for p in ps],
                              [p.top_k for p in ps], [p.top_p for p in ps], u_acc, u_tok)


def coupled_on_device(ops: Ops, reqs: list[VerifyRequest], states: list, starts: list[int], coupled: list[int],
                      logits: Any) -> Any:
    """The coupled rows' Gumbel-max choices at every verified position -> int64 [C, width]
    (row j of request i decides position starts[i] + j; columns past its k are unused)."""
    width = ops.shape(logits)[1]
    ps = [states[i].params for i in coupled]
    rows = ops.from_numpy(np.asarray(coupled, dtype=np.int64), "int64")
    sel = ops.index_select(logits, rows, 0)                                              # [C, width, V]
    c, v = len(coupled), ops.shape(sel)[-1]
    rep = lambda xs: np.repeat(np.asarray(xs), width)  # noqa: E731  per request -> per row
    choices = ops.sampler.coupled(
        ops.reshape(sel, (c * width, v)), rep([p.temperature for p in ps]), rep([p.top_k for p in ps]),
        rep([p.top_p for p in ps]), rep([states[i].seed for i in coupled]),
        (np.asarray([starts[i] for i in coupled], dtype=np.int64)[:, None] + np.arange(width)).reshape(-1))
    return ops.reshape(choices, (c, width))
