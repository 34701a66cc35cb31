"""Static KV cache: preallocated request slots x max length, one per model.

Owns: the cache tensors (per layer, K and V as flat rows
``[(max_slots + 1) * max_len, KVH, D]``; the extra slot is a scratch slot
that padding tokens write to), the slot allocator, and each request's valid
length. Rollback after a rejected draft is a length update: rows past the
valid length are stale and are overwritten before they are ever read
(every forward writes its rows before it attends).

Must not know: models' math, sampling, gRPC. The tensors keep their
addresses for the cache's whole life (CUDA graphs read them).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import ResourceExhausted, UnknownRequest
from runtime.backends.base import Ops, Tensor


class CapacityError(ResourceExhausted):
    """The cache cannot hold a request (no free slot, or a sequence too long)."""


class UnknownRequestError(UnknownRequest):
    """A request id that holds no slot here."""


@dataclass
class SlotState:
    slot: int
    length: int = 0  # number of positions whose K/V rows are valid


class KVCache:
    def __init__(self, ops: Ops, num_layers: int, kv_heads: int, head_dim: int,
                 max_slots: int, max_len: int) -> None:
        self.ops = ops
        self.max_slots = max_slots
        self.max_len = max_len
        self.scratch_slot = max_slots
        rows = (max_slots + 1) * max_len
        # [(S+1)*L, KVH, D] per layer, K and V
        self.layers: list[tuple[Tensor, Tensor]] = [
            (ops.zeros((rows, kv_heads, head_dim)), ops.zeros((rows, kv_heads, head_dim)))
            for _ in range(num_layers)
        ]
        self._free = list(range(max_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._requests: dict[str, SlotState] = {}

    # --- slots ---------------------------------------------------------------
    def allocate(self, request_id: str) -> SlotState:
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} already holds a cache slot")
        if not self._free:
            raise CapacityError(f"KV cache full: all {self.max_slots} request slots are in use")
        state = SlotState(self._free.pop())
        self._requests[request_id] = state
        return state

    def free(self, request_id: str) -> bool:
        """Free a request's slot; returns False if it held none (idempotent)."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        self._free.append(state.slot)
        return True

    def get(self, request_id: str) -> SlotState:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequestError(f"request_id {request_id!r} is unknown here (never prefilled or already released)") from None

    def has(self, request_id: str) -> bool:
        return request_id in self._requests

    def check_fits(self, request_id: str, end_position: int) -> None:
        """Raise CapacityError if writing positions up to ``end_position`` (exclusive) overflows."""
        if end_position > self.max_len:
            raise CapacityError(f"request {request_id!r} needs {end_position} cache positions; "
                                f"cache.max_len is {self.max_len}")

    @property
    def used_slots(self) -> int:
        return len(self._requests)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def request_ids(self) -> list[str]:
        return list(self._requests)

