"""Putting checkpoints on the device: validate, load, update in place.

Owns: turning a target directory / MTP file into device ``Params`` for the
target and for the draft (MTP tensors + the draft's own copy of the target's
embedding, final norm and head), full validation before anything is read,
and in-place updates that keep every tensor's address (graphs stay valid).

Must not know: gRPC, lifecycle, requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np

from runtime import checkpoint
from runtime.backends.base import Ops
from runtime.checkpoint import CheckpointError, TensorInfo
from runtime.config import ModelConfig
from runtime.model import Params, head_weight_name, mtp_tensor_shapes, target_tensor_shapes

MTP_FILE = "mtp.safetensors"
# Buffers some checkpoints carry that are recomputed from the config, never read.
_DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class CheckedCheckpoint:
    """A checkpoint whose headers were fully validated; data not read yet."""

    cfg: ModelConfig
    infos: dict[str, TensorInfo]
    names: tuple[str, ...]


def resolve_draft_path(target_path: str | Path, draft_path: str | Path | None) -> Path:
    """The MTP file: given explicitly, or ``mtp.safetensors`` next to the target."""
    return Path(draft_path) if draft_path else Path(target_path) / MTP_FILE


def check_target(path: str | Path, running: ModelConfig | None = None) -> CheckedCheckpoint:
    """Validate a target directory (config + every tensor's name/shape/dtype)."""
    cfg = ModelConfig.from_json_file(Path(path) / "config.json")
    if running is not None:
        diff = running.compatible_with(cfg)
        diff = [d for d in diff if d not in ("torch_dtype",)]
        if diff:
            raise CheckpointError(f"{path}: config differs from the running model in {diff}")
    infos = checkpoint.index_checkpoint(path)
    shapes = target_tensor_shapes(cfg)
    # NOTE: extra tensors are refused (a bias or norm the config does not announce would
    # otherwise be dropped silently); only derived RoPE buffers of old checkpoints are skipped.
    infos = {n: i for n, i in infos.items() if not n.endswith(_DERIVED_SUFFIXES)}
    checkpoint.validate(infos, shapes, f"target {path}", allow_extra=False)
    return CheckedCheckpoint(cfg, infos, tuple(shapes))


def check_draft(target: CheckedCheckpoint, draft_path: str | Path) -> CheckedCheckpoint:
    """Validate the MTP file against the target's sizes; the draft also takes the
    target's embedding, final norm and head (from ``target.infos``)."""
    infos = checkpoint.index_checkpoint(draft_path)
    shapes = mtp_tensor_shapes(target.cfg)
    checkpoint.validate(infos, shapes, f"draft {draft_path}", allow_extra=False)
    shared = {n: target.infos[n] for n in _shared_names(target.cfg)}
    return CheckedCheckpoint(target.cfg, {**infos, **shared}, tuple(shapes) + tuple(shared))


def _shared_names(cfg: ModelConfig) -> tuple[str, ...]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if head_weight_name(cfg) not in names:
        names.append(head_weight_name(cfg))
    return tuple(names)


def read_arrays(checked: CheckedCheckpoint, bf16_bits: bool = False) -> dict[str, np.ndarray]:
    """Host arrays: float32, or (``bf16_bits``) bf16 tensors kept as uint16 bit
    patterns for ``Ops.from_numpy`` to reinterpret on the device."""
    return checkpoint.load_tensors(checked.infos, list(checked.names), bf16_bits)


def to_device(ops: Ops, arrays: dict[str, np.ndarray]) -> Params:
    """Host arrays -> device tensors, emptying ``arrays`` as it goes.

    NOTE: each host array is dropped as soon as its device copy exists, so host
    RAM never holds the checkpoint twice (on a CPU device the tensors *are* host
    memory: keeping the arrays until the end would double the peak).
    """
    out: Params = {}
    for name in list(arrays):
        out[name] = ops.from_numpy(arrays.pop(name))
    return out


class CheckpointArrays(Mapping[str, np.ndarray]):
    """A validated checkpoint's tensors, read on access (bf16 as raw bits): what an in-place
    update copies from without holding the whole checkpoint in host memory, and lets the
    backend stream straight from the files (``Ops.fill_from_files``)."""

    def __init__(self, checked: CheckedCheckpoint) -> None:
        self.checked = checked

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.checked.names:
            raise KeyError(name)
        return checkpoint.read_tensor(self.checked.infos[name], bf16_bits=True)

    def __iter__(self) -> Iterator[str]:
        return iter(self.checked.names)

    def __len__(self) -> int:
        return len(self.checked.names)

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self.checked.infos[name].shape)


def copy_in_place(ops: Ops, params: Params, arrays: Mapping[str, np.ndarray]) -> None:
    """Overwrite existing parameter tensors (addresses unchanged, graphs stay valid).

    Refuses before touching anything if a name is missing or a shape differs. From
    ``CheckpointArrays`` the backend streams what it can straight from the files
    (through pinned buffers on CUDA); the rest is read and copied one tensor at a time.
    """
    shape_of = arrays.shape_of if isinstance(arrays, CheckpointArrays) else (lambda n: tuple(arrays[n].shape))
    for name, tensor in params.items():
        if name not in arrays:
            raise CheckpointError(f"in-place update: tensor {name!r} missing from the new weights")
        if shape_of(name) != ops.shape(tensor):
            raise CheckpointError(f"in-place update: tensor {name!r} has shape {list(shape_of(name))}, "
                                  f"running shape is {list(ops.shape(tensor))}")
    done: set[str] = set()
    if isinstance(arrays, CheckpointArrays):
        infos = arrays.checked.infos
        names = list(params)
        filled = ops.fill_from_files([(params[n], str(infos[n].file), infos[n].start, infos[n].end, infos[n].dtype)
                                      for n in names])
        done = {n for n, ok in zip(names, filled) if ok}
    for name, tensor in params.items():
        if name not in done:
            ops.copy_from_numpy(tensor, arrays[name])
