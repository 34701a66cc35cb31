"""Conversions between the specsplit.v1 protos and the runtime's records.

Owns: tensors (numpy <-> ``Tensor {dtype, shape, data}``, with validation that
names the offending field), sampling parameters (proto <-> ``SamplingParams``),
per-item errors (``ItemError``) and the one mapping from exceptions to gRPC
status codes used by every service (the kinds: ``core.errors``). A worker's
status record -> proto is ``worker.service`` (a layer up: it knows the worker).

Must not know: models, frameworks, servicers or channels. The orchestrator
uses the tensor and params helpers too (hidden states pass through it as
opaque ``Tensor`` messages; it never needs to decode them).

Public API:
    encode_tensor(arr, dtype=None) -> common_pb2.Tensor
    decode_tensor(t, field, allowed=None, bf16_bits=False) -> np.ndarray
    decode_optional_tensor(msg, name, field, ...) -> np.ndarray | None
    params_to_proto(SamplingParams) / params_from_proto(proto, field)
    ItemError, status_code_for(exc), item_error_for(exc), item_error_to_proto(err)

bfloat16: numpy has no bf16, so bf16 tensors travel as raw bf16 bits (``core.bf16``); encode
rounds float arrays to nearest-even (or takes a uint16 array as bit patterns),
decode widens to float32 exactly (or returns the uint16 bits if asked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from core.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
from core.errors import FailedPrecondition, ResourceExhausted, UnknownRequest
from core.params import SamplingParams
from specsplit.v1 import common_pb2 as pb

MAX_TENSOR_DIMS = 8

# dtype name -> (proto enum value, little-endian numpy dtype on the wire)
_DTYPES: dict[str, tuple[int, np.dtype]] = {
    "float32": (pb.DTYPE_FLOAT32, np.dtype("<f4")),
    "float16": (pb.DTYPE_FLOAT16, np.dtype("<f2")),
    "bfloat16": (pb.DTYPE_BFLOAT16, np.dtype("<u2")),
    "int64": (pb.DTYPE_INT64, np.dtype("<i8")),
}
_BY_ENUM_SPEC = {enum: (name, wire, wire.newbyteorder("=")) for name, (enum, wire) in _DTYPES.items()}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


# --- tensors -------------------------------------------------------------------


def encode_tensor(arr: Any, dtype: str | None = None) -> pb.Tensor:
    """numpy array -> Tensor. ``dtype`` None infers it: float32, float16, integers -> int64
    (float64 -> float32). ``dtype="bfloat16"``: a uint16 array is taken as bf16 bit
    patterns, a float array is rounded to bf16."""
    return fill_tensor(pb.Tensor(), arr, dtype)


def fill_tensor(t: pb.Tensor, arr: Any, dtype: str | None = None) -> pb.Tensor:
    """``encode_tensor`` into ``t``, an empty Tensor field of a message being built (no
    separate Tensor to copy in: a round's Propose fills one per item)."""
    a = np.asarray(arr)
    if dtype is None:
        if a.dtype == np.float16:
            dtype = "float16"
        elif a.dtype.kind == "f":
            dtype = "float32"
        elif a.dtype.kind in "iub":
            dtype = "int64"
        else:
            raise ValueError(f"cannot encode a numpy array of dtype {a.dtype}")
    spec = _DTYPES.get(dtype)
    if spec is None:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    enum, wire = spec
    if dtype == "bfloat16":
        data = a.astype("<u2") if a.dtype == np.uint16 else float32_to_bf16_bits(a).astype("<u2")
    else:
        data = a.astype(wire, copy=False)
    t.dtype = enum
    t.shape.extend(a.shape)
    # NOTE: tobytes copies in C order whatever the layout (np.ascontiguousarray first only
    # added a call per tensor, and a round encodes one per request).
    t.data = data.tobytes()
    return t


def int64_array(field: Any) -> np.ndarray:
    """A repeated integer field (token ids) as int64 [n]. NOTE: sliced to a list first (one C
    copy): numpy reading the protobuf container element by element took ~3x as long, on
    every item of every round (``bench propose-host``, docs/performance.md § Session 10)."""
    return np.array(field[:], dtype=np.int64)


def is_empty_tensor(t: pb.Tensor) -> bool:
    """True for the "no tensor" value: empty shape and empty data."""
    return len(t.shape) == 0 and len(t.data) == 0


def decode_tensor(t: pb.Tensor, field: str, allowed: tuple[str, ...] | None = None,
                  bf16_bits: bool = False, max_bytes: int | None = None) -> np.ndarray:
    """Tensor -> numpy (a writable copy). Raises ValueError naming ``field`` when the dtype
    is unknown or not ``allowed``, a dimension is negative, the data is longer than
    ``max_bytes`` (security.max_tensor_bytes), or the byte length is not
    prod(shape) * itemsize. bfloat16 comes back widened to float32 (exact), or as its
    uint16 bit patterns with ``bf16_bits``."""
    # NOTE: ``t.data`` read once: each read of a bytes field builds a new bytes object (a
    # copy of the data), and a round decodes a tensor per request.
    data = t.data
    nbytes = len(data)
    if max_bytes is not None and nbytes > max_bytes:
        raise ValueError(f"{field}: {nbytes} bytes exceed max_tensor_bytes={max_bytes}")
    spec = _BY_ENUM_SPEC.get(t.dtype)
    if spec is None:
        label = "DTYPE_UNSPECIFIED" if t.dtype == pb.DTYPE_UNSPECIFIED else f"unknown dtype {t.dtype}"
        raise ValueError(f"{field}: {label}; expected one of {list(allowed or _DTYPES)}")
    name, wire, native = spec
    if allowed is not None and name not in allowed:
        raise ValueError(f"{field}: dtype {name} is not allowed here; expected one of {list(allowed)}")
    shape = t.shape[:]                          # a list of Python ints (repeated int64)
    if len(shape) > MAX_TENSOR_DIMS:
        raise ValueError(f"{field}: {len(shape)} dimensions, at most {MAX_TENSOR_DIMS} allowed")
    count = 1
    for s in shape:
        if s < 0:
            raise ValueError(f"{field}: shape {shape} has a negative dimension")
        count *= s                              # Python int: no overflow on absurd shapes
    expected = count * wire.itemsize
    if nbytes != expected:
        raise ValueError(f"{field}: {nbytes} bytes, expected {expected} for shape {shape} {name}")
    arr = np.frombuffer(data, dtype=wire).reshape(shape)
    if name == "bfloat16":
        return arr.astype(np.uint16) if bf16_bits else bf16_bits_to_float32(arr)
    return arr.astype(native, copy=True)


def decode_optional_tensor(msg: Any, name: str, field: str, allowed: tuple[str, ...] | None = None,
                           bf16_bits: bool = False, max_bytes: int | None = None) -> np.ndarray | None:
    """``msg.<name>`` decoded, or None when unset or the "no tensor" value."""
    if not msg.HasField(name):
        return None
    t = getattr(msg, name)
    if is_empty_tensor(t):
        return None
    return decode_tensor(t, field, allowed, bf16_bits, max_bytes)


def as_float32(arr: np.ndarray) -> np.ndarray:
    """Float tensors widened to float32 (the runtime's host dtype)."""
    return arr if arr.dtype == np.float32 else arr.astype(np.float32)


# --- sampling parameters ---------------------------------------------------------


def params_to_proto(p: SamplingParams) -> pb.SamplingParams:
    """Only the fields the workers use travel (max_tokens and stop ids stay at the orchestrator)."""
    out = pb.SamplingParams(temperature=p.temperature, top_k=p.top_k,
                            top_p=0.0 if p.top_p >= 1.0 else p.top_p, draft_sampling=p.draft_sampling,
                            sampling_mode=MODE_TO_PROTO[p.sampling_mode])
    if p.seed is not None:
        out.seed = p.seed
    return out


MODE_TO_PROTO = {"rejection": pb.SAMPLING_MODE_REJECTION, "coupled": pb.SAMPLING_MODE_COUPLED}
MODE_FROM_PROTO = {v: k for k, v in MODE_TO_PROTO.items()}


def params_from_proto(p: pb.SamplingParams, field: str = "params", default_mode: str = "rejection") -> SamplingParams:
    """Proto -> SamplingParams; top_p 0 (unset) means 1.0 (off); sampling_mode unset means
    ``default_mode``. Raises ValueError naming the field (an unknown sampling_mode too)."""
    top_p = float(p.top_p)
    mode = int(p.sampling_mode)
    if mode != pb.SAMPLING_MODE_UNSPECIFIED and mode not in MODE_FROM_PROTO:
        raise ValueError(f"{field}.sampling_mode: {mode} is not a known SamplingMode "
                         "(SAMPLING_MODE_REJECTION = 1, SAMPLING_MODE_COUPLED = 2)")
    try:
        return SamplingParams(
            temperature=float(p.temperature), top_k=int(p.top_k), top_p=1.0 if top_p == 0.0 else top_p,
            seed=int(p.seed) if p.HasField("seed") else None, draft_sampling=bool(p.draft_sampling),
            sampling_mode=MODE_FROM_PROTO.get(mode, default_mode))
    except ValueError as exc:  # ConfigError names the sub-field ("temperature=... is invalid")
        raise ValueError(f"{field}.{exc}") from None


# --- errors ----------------------------------------------------------------------


@dataclass(frozen=True)
class ItemError:
    """One item of a batched request failed; the rest of the batch still ran."""

    code: grpc.StatusCode
    message: str


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    """The one exception -> status code mapping of every specsplit service.

    FailedPrecondition (LifecycleError) -> FAILED_PRECONDITION; ResourceExhausted
    (CapacityError) -> RESOURCE_EXHAUSTED; UnknownRequest and ValueError (ConfigError,
    CheckpointError, bad fields) -> INVALID_ARGUMENT; anything else -> INTERNAL.
    The kinds are ``core.errors``; lower layers subclass them.
    """
    if isinstance(exc, FailedPrecondition):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, ResourceExhausted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, (UnknownRequest, ValueError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def error_message(exc: BaseException) -> str:
    code = status_code_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        return f"internal error: {type(exc).__name__}: {exc}"
    return str(exc)


def item_error_for(exc: BaseException) -> ItemError:
    return ItemError(status_code_for(exc), error_message(exc))


def item_error_to_proto(err: ItemError) -> pb.ItemError:
    return pb.ItemError(code=err.code.value[0], message=err.message)
