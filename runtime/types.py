"""Plain request/response records exchanged between the round driver and the workers.

Owns: the framework-free data shapes of prefill, propose and verify (numpy
arrays for tokens, hidden states and draft distributions). The gRPC layer
converts these to and from protobuf; the in-process engine passes them as is.

Must not know: frameworks, gRPC, models.

Hidden rows (``PrefillResult.hidden``, ``VerifyResult.hidden``, and what the
draft is fed in ``DraftPrefillRequest.hidden`` / ``ProposeRequest.hidden``)
are float32, or — when the target computes in bf16 — uint16 arrays holding
the bf16 bit patterns (exact, half the bytes; the wire layer sends a uint16
array as ``bfloat16``). ``DraftEngine`` accepts both; ``hidden_float32``
widens bits on the host where a float array is needed.

NOTE: the records a round builds for every request (``VerifyRequest``, ``VerifyResult``,
``ProposeRequest``, ``Proposal``; likewise ``batch_layout.Row``, ``acceptance.Acceptance`` and
the scheduler's ``TokensEvent``) are slotted dataclasses, not frozen ones: a frozen dataclass's
``__init__`` sets each field through ``object.__setattr__``, ~0.6 µs more per record on the
2-core CPU (7 fields: 0.84 against 0.25 µs), and a round builds about ten per request. They are
still never changed once built: a changed one is a new record (``dataclasses.replace``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from core.bf16 import bf16_bits_to_float32
from core.params import SamplingParams


def hidden_float32(arr: np.ndarray) -> np.ndarray:
    """Hidden rows as float32: uint16 bf16 bit patterns are widened exactly."""
    arr = np.asarray(arr)
    if arr.dtype == np.uint16:
        return bf16_bits_to_float32(arr)
    return arr.astype(np.float32, copy=False)


@dataclass(frozen=True)
class DeviceDrafts:
    """Greedy drafts a draft left on its device for a verify in the same process, on that device
    (``ProposeRequest.on_device``): row ``row`` of ``tokens``, an int64 framework tensor
    [B, kmax] of the draft's propose that nothing else writes; its first k are the drafts. The
    verify reads it in stream order and brings it to the host with its own outputs: one host
    synchronisation a round instead of one after the propose and one after the verify.
    ``source``: the draft engine that made them, which may queue the next round's propose on the
    device (``queue_next``, runtime/round_ahead.py); None: it cannot."""
    tokens: Any
    row: int
    source: Any = None


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt: np.ndarray                 # int64 [n]: t_0..t_{n-1}
    params: SamplingParams
    resume_token: int | None = None    # known t_n (re-prefill after reload/recovery): not sampled


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token: int                   # t_n
    hidden: np.ndarray                 # float32 (or uint16 bf16 bits) [n, d]: h_0..h_{n-1}


@dataclass(slots=True)                 # built per request per round: see the module doc
class VerifyRequest:
    request_id: str
    drafts: np.ndarray                 # int64 [k] (k may be 0: target-only step)
    draft_probs: np.ndarray | None     # float [k, V] for a probabilistic draft, None for greedy (q one-hot)
    hidden: bool = True                # the result carries the hidden rows (the draft's next catch-up);
                                       # False where the draft holds nothing of the request
    device: DeviceDrafts | None = None  # the drafts are there (``drafts``: k zeros, their count only)
    chain: bool = True                 # the next round may be queued ahead from this one (runtime/round_ahead.py,
                                       # runtime/decode_ahead.py); False where it most likely differs (round_driver)


@dataclass(slots=True)                 # built per request per round: see the module doc
class VerifyResult:
    request_id: str
    num_accepted: int                  # a
    tokens: tuple[int, ...]            # a accepted drafts + 1 bonus: t_{n+1}..t_{n+a+1}
    hidden: np.ndarray | None          # float32 (or uint16 bf16 bits) [a+1, d]: h_n..h_{n+a}; None when
                                       # the request did not ask for them (VerifyRequest.hidden)


@dataclass(frozen=True)
class DraftPrefillRequest:
    request_id: str
    tokens: np.ndarray                 # int64 [m]: t_1..t_m  (pairs (h_{i-1}, t_i))
    hidden: np.ndarray                 # float32 or uint16 bf16 bits [m, d]: h_0..h_{m-1}
    params: SamplingParams


@dataclass(slots=True)                 # built per request per round: see the module doc
class ProposeRequest:
    request_id: str
    start_position: int                # draft position of the first new pair (must equal the draft's count)
    tokens: np.ndarray                 # int64 [m], m >= 1: tokens of the new pairs
    hidden: np.ndarray                 # float32 or uint16 bf16 bits [m, d]: target hidden states of the new pairs
    k: int                             # drafts wanted (>= 1)
    ahead: bool = False                # continue from the end of the last proposal (tokens/hidden unused)
    keep_tail: bool = False            # keep this proposal's end so that an ahead request can continue it
    on_device: bool = False            # greedy drafts may stay on the device (``Proposal.device``): the
                                       # verify runs in this process on the draft's device


@dataclass(slots=True)                 # built per request per round: see the module doc
class Proposal:
    request_id: str
    drafts: np.ndarray                 # int64 [k] (k zeros, their count only, when ``device`` holds them)
    draft_probs: np.ndarray | None     # float32 [k, V] when the request samples its draft
    device: DeviceDrafts | None = None  # the drafts, still on the draft's device (``ProposeRequest.on_device``)
