"""Checkpoint I/O: Hugging Face safetensors layout for the target, one file for the MTP.

Owns: reading and writing safetensors files (single file or sharded with
``model.safetensors.index.json``), bf16 <-> float32 conversion on the host,
and validation of names, shapes and dtypes against what the model expects,
done from the file headers *before* any tensor data is read or any live
weight changes.

Must not know: frameworks (arrays here are numpy), requests, gRPC.

The safetensors format is an 8-byte little-endian header length, a JSON
header ``{name: {dtype, shape, data_offsets}}`` and the raw bytes; it is read
directly here so bf16 works without a framework. bf16 travels to the device
as raw uint16 bit patterns (the backends reinterpret them); where numpy must
hold bf16 values, ``core.bf16`` converts (``float32_to_bf16_bits`` /
``bf16_bits_to_float32``, the codebase's one bf16 conversion).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
from runtime.config import ModelConfig

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64, "I32": np.int32}
_ST_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_FLOAT_ST = ("F32", "F16", "BF16")
MAX_HEADER_BYTES = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint is unreadable or does not match the model; the message names the problem."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str          # safetensors dtype code: F32, F16, BF16, ...
    shape: tuple[int, ...]
    start: int          # absolute byte offset in file
    end: int


def _read_header(path: Path) -> dict[str, TensorInfo]:
    try:
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw_len)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: safetensors header of {n} bytes is implausible")
            header = json.loads(f.read(n))
        size = path.stat().st_size
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header: {exc}") from exc
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = meta["dtype"], tuple(int(s) for s in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: corrupt entry for tensor {name!r}") from exc
        if dtype not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        want = int(np.prod(shape, dtype=np.int64)) * np.dtype(_ST_DTYPES[dtype]).itemsize
        if b - a != want or 8 + n + b > size:
            raise CheckpointError(f"{path}: tensor {name!r} data is truncated or its offsets are wrong")
        out[name] = TensorInfo(path, dtype, shape, 8 + n + a, 8 + n + b)
    return out


def index_checkpoint(path: str | Path) -> dict[str, TensorInfo]:
    """Map tensor name -> location for a file, or a directory holding
    ``model.safetensors`` or ``model.safetensors.index.json`` (sharded)."""
    p = Path(path)
    if p.is_file():
        return _read_header(p)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path {p} does not exist")
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: unreadable shard index: {exc}") from exc
        out: dict[str, TensorInfo] = {}
        for shard in sorted(set(weight_map.values())):
            infos = _read_header(p / shard)
            out.update({k: v for k, v in infos.items() if weight_map.get(k) == shard})
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise CheckpointError(f"{index}: tensors listed but absent from their shard: {missing[:5]}")
        return out
    single = p / "model.safetensors"
    if single.is_file():
        return _read_header(single)
    raise CheckpointError(f"{p}: no model.safetensors or model.safetensors.index.json")


def validate(infos: dict[str, TensorInfo], expected: dict[str, tuple[int, ...]], what: str,
             allow_extra: bool = True) -> None:
    """Every expected tensor present with the right shape and a float dtype."""
    missing = sorted(set(expected) - set(infos))
    if missing:
        raise CheckpointError(f"{what}: missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, shape in expected.items():
        info = infos[name]
        if info.shape != tuple(shape):
            raise CheckpointError(f"{what}: tensor {name!r} has shape {list(info.shape)}, expected {list(shape)}")
        if info.dtype not in _FLOAT_ST:
            raise CheckpointError(f"{what}: tensor {name!r} has dtype {info.dtype}, expected one of F32/F16/BF16")
    if not allow_extra:
        extra = sorted(set(infos) - set(expected))
        if extra:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise CheckpointError(f"{what}: unexpected tensor {extra[0]!r}{more}: the model's config does not "
                                  "describe it (check attention_bias / mlp_bias / model_type)")


def read_tensor(info: TensorInfo, bf16_bits: bool = False) -> np.ndarray:
    """Read one tensor as float32 (bf16/f16 widened on the host), or, with
    ``bf16_bits``, a bf16 tensor as its raw uint16 bit patterns (no decode:
    the device reinterprets them, which halves host work for bf16 models).

    The bytes land once, in a writable buffer the returned array owns (no
    second host copy; a CPU tensor may share it and be updated in place)."""
    buf = bytearray(info.end - info.start)
    with open(info.file, "rb") as f:
        f.seek(info.start)
        n = f.readinto(buf)
    if n != len(buf):
        raise CheckpointError(f"{info.file}: tensor data truncated")
    arr = np.frombuffer(buf, dtype=_ST_DTYPES[info.dtype]).reshape(info.shape)
    if info.dtype == "BF16" and bf16_bits:
        return arr
    if info.dtype == "BF16":
        return bf16_bits_to_float32(arr)
    return arr.astype(np.float32) if info.dtype == "F16" else arr


def load_tensors(infos: dict[str, TensorInfo], names: list[str] | None = None,
                 bf16_bits: bool = False) -> dict[str, np.ndarray]:
    return {n: read_tensor(infos[n], bf16_bits) for n in (names if names is not None else list(infos))}


def save_safetensors(path: str | Path, tensors: dict[str, np.ndarray], dtype: str = "float32") -> None:
    """Write float tensors to one safetensors file in ``dtype`` (float32/float16/bfloat16)."""
    code = _ST_NAMES[dtype]
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name], dtype=np.float32)
        data = (float32_to_bf16_bits(arr) if dtype == "bfloat16" else arr.astype(np.float16 if dtype == "float16" else np.float32)).tobytes()
        header[name] = {"dtype": code, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)
    tmp.replace(path)


def save_target(dir_path: str | Path, cfg: ModelConfig, tensors: dict[str, np.ndarray],
                dtype: str = "float32", shard_bytes: int | None = None) -> None:
    """Write a target in Hugging Face layout: config.json + model.safetensors (or shards + index)."""
    d = Path(dir_path)
    d.mkdir(parents=True, exist_ok=True)
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = dtype
    (d / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if shard_bytes is None:
        save_safetensors(d / "model.safetensors", tensors, dtype)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].size * (4 if dtype == "float32" else 2)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(d / fname, shard, dtype)
        weight_map.update({n: fname for n in shard})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
