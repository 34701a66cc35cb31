"""bfloat16 on the host, the one conversion of the codebase.

Owns: float32 -> bf16 bit patterns (uint16), rounding to nearest even, infinities kept, NaN
kept a (quiet) NaN; and bf16 bit patterns -> float32, exact (a bf16 value is the high half
of the float32 with the same value). numpy has no bf16 dtype; ``ml_dtypes`` does the work.

Must not know: where the bits go (the wire, a checkpoint file, a device tensor).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np


def float32_to_bf16_bits(arr: np.ndarray) -> np.ndarray:
    """float32 (or anything numpy casts to it) -> bfloat16 bit patterns (uint16), nearest even."""
    return np.ascontiguousarray(arr, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exact."""
    return np.ascontiguousarray(bits, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
