"""Tensor-parallel sharding of the Llama target: which slice of every tensor a rank holds.

Owns: the Megatron-style plan for ``tp`` ranks (column splits of q/k/v and gate/up
along their output rows, row splits of o and down along their input columns, KV
heads split across ranks or replicated when there are fewer KV heads than ranks,
a vocabulary-parallel output head, replicated embedding and norms; splits that
``tp`` does not divide are balanced, below), the model
config one rank computes with (``local_cfg``), slicing a full host array to a
rank's shard (``shard``: pushed weights, tests) and reading only a rank's slices
from the safetensors files (``read_sharded``: loading and IN_PLACE reloads).

Must not know: frameworks (arrays here are numpy; collectives belong to
``runtime/backends/torch_dist.py``), processes, gRPC, lifecycle.

Math (x [.., d], rank r of tp):
- column split: W [out, in] -> rows of r; y_r = x W_r^T is rank r's part of y
  (q heads h/tp per rank; its K/V heads; gate/up ffn/tp rows).
- row split: W [d, in] -> columns of r; y = sum_r x_r W_r^T (the all-reduce).
  A bias of a row-split projection lives on rank 0 only (zeros elsewhere), so the
  sum adds it once.
- head: rows [r*V/tp, (r+1)*V/tp) of the head; the ranks' logits are gathered
  along the vocabulary. A vocabulary that ``tp`` does not divide is split into
  balanced shares, each zero-padded to the largest (ceil(V/tp) rows: the gather
  wants equal parts), and the padding's logits are dropped after the gather;
  only a head tied to the embedding then stays whole on every rank (its head is
  a view of the embedding, which a padded copy would not follow in place).

Splits ``tp`` does not divide (e.g. tp = 3 on 16 query / 4 K/V heads, FFN 5632):
the ranks' shares differ by the smallest step the attention allows. A rank's
query heads must use its K/V heads in one fixed ratio (the attention groups a
rank's query heads evenly over its K/V heads), so with tp <= kvh each rank
takes whole K/V groups, balanced (4 groups over 3 ranks: 2, 1, 1, i.e. 8, 4, 4
query heads), and with tp > kvh each K/V head is replicated on a balanced
number of ranks that share its query heads (tp = 3, 2 K/V heads of 2 query
heads each: ranks 0 and 1 hold K/V head 0 with one query head each, rank 2 K/V
head 1 with both of its). FFN rows split into counts that differ by at most
one; the row-split sums do not care. ``tp`` that divides everything gives the
even split of before, exactly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from core.bf16 import bf16_bits_to_float32
from core.config import ConfigError
from runtime.checkpoint import CheckpointError, TensorInfo, read_tensor
from runtime.config import ModelConfig
from runtime.model import head_weight_name

_ST_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
ZEROS_OFF_RANK0 = "zeros-off-rank-0"


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one TP target meet (torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int


@dataclass(frozen=True)
class Slice:
    """Rows or columns [start, stop) of a tensor along ``axis``; ``ZEROS_OFF_RANK0`` in mode:
    the whole tensor on rank 0, zeros of its shape on the others (biases of row splits);
    ``pad_to``: the slice zero-padded to that length along ``axis``."""

    axis: int
    start: int
    stop: int
    mode: str = ""
    pad_to: int = 0              # zero rows appended along ``axis`` up to this many (uneven vocabulary)


@dataclass(frozen=True)
class TPPlan:
    cfg: ModelConfig             # the full model
    tp: int
    rank: int

    def __post_init__(self) -> None:
        cfg, tp = self.cfg, self.tp
        h, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
        if not (isinstance(tp, int) and tp >= 1):
            raise ConfigError(f"tp={tp!r} is invalid: expected an integer >= 1")
        if not 0 <= self.rank < tp:
            raise ConfigError(f"tp rank {self.rank} is out of range [0, {tp})")
        group = h // kvh
        if tp > kvh and -(-tp // kvh) > group:
            raise ConfigError(f"tp={tp} is too large for model.num_attention_heads={h} over "
                              f"num_key_value_heads={kvh}: a K/V head's {group} query heads would be shared by "
                              f"{-(-tp // kvh)} ranks (at most {group})")
        if cfg.intermediate_size < tp:
            raise ConfigError(f"tp={tp} is larger than model.intermediate_size={cfg.intermediate_size}")
        q, kv = _head_ranges(h, kvh, tp)[self.rank]
        object.__setattr__(self, "_q", q)
        object.__setattr__(self, "_kv", kv)
        object.__setattr__(self, "_ffn", _ranges(_balanced(cfg.intermediate_size, tp))[self.rank])

    # --- sizes on this rank -------------------------------------------------------------
    @property
    def q_heads(self) -> tuple[int, int]:
        """Query heads [start, stop) of this rank."""
        return self._q

    @property
    def heads(self) -> int:
        return self._q[1] - self._q[0]

    @property
    def kv_heads(self) -> int:
        """K/V heads this rank holds (one, replicated, when kvh < tp)."""
        return self._kv[1] - self._kv[0]

    @property
    def kv_start(self) -> int:
        """First K/V head of this rank: the one its first query head belongs to."""
        return self._kv[0]

    @property
    def ffn_rows(self) -> tuple[int, int]:
        """FFN rows [start, stop) of this rank (gate/up output rows, down input columns)."""
        return self._ffn

    @property
    def vocab_split(self) -> bool:
        """Is the output head split by vocabulary (module doc: not a tied head that tp does not divide)?"""
        tied = head_weight_name(self.cfg) == "model.embed_tokens.weight"
        return self.tp > 1 and (self.cfg.vocab_size % self.tp == 0 or not tied)

    @property
    def vocab_counts(self) -> list[int]:
        """Every rank's number of vocabulary rows (all of them on each when not split)."""
        v = self.cfg.vocab_size
        return _balanced(v, self.tp) if self.vocab_split else [v] * self.tp

    @property
    def vocab_rows(self) -> tuple[int, int]:
        """Rows of the output head this rank computes: its vocabulary slice, or all of it."""
        if not self.vocab_split:
            return 0, self.cfg.vocab_size
        return _ranges(self.vocab_counts)[self.rank]

    @property
    def vocab_width(self) -> int:
        """Rows of this rank's head tensor: its share, zero-padded to the largest share."""
        return max(self.vocab_counts)

    def local_cfg(self) -> ModelConfig:
        """The config one rank's decoder layers compute with (vocabulary and width stay whole)."""
        a, b = self._ffn
        return dataclasses.replace(self.cfg, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                                   intermediate_size=b - a)

    # --- per tensor ----------------------------------------------------------------------
    def slice_of(self, name: str) -> Slice | None:
        """This rank's part of tensor ``name`` (checkpoint naming); None = the whole tensor."""
        if self.tp == 1:
            return None
        hd = self.cfg.head_dim
        leaf = name.rsplit(".layers.", 1)[-1].split(".", 1)[-1] if ".layers." in name else name
        (q0, q1), (kv0, kv1), (f0, f1) = self._q, self._kv, self._ffn
        if leaf.startswith("self_attn.q_proj."):
            return Slice(0, q0 * hd, q1 * hd)
        if leaf.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
            return Slice(0, kv0 * hd, kv1 * hd)
        if leaf.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
            return Slice(0, f0, f1)
        if leaf == "self_attn.o_proj.weight":
            return Slice(1, q0 * hd, q1 * hd)
        if leaf == "mlp.down_proj.weight":
            return Slice(1, f0, f1)
        if leaf in ("self_attn.o_proj.bias", "mlp.down_proj.bias"):
            return Slice(0, 0, 0, ZEROS_OFF_RANK0)
        if name == "lm_head.weight" and self.vocab_split:
            a, b = self.vocab_rows
            return Slice(0, a, b, pad_to=self.vocab_width if self.vocab_width > b - a else 0)
        return None                     # embedding (the tied head is a view of it), norms, q/k norms

    def shard(self, name: str, full: np.ndarray) -> np.ndarray:
        """A full host array -> this rank's shard (a new contiguous array, or ``full`` itself)."""
        s = self.slice_of(name)
        if s is None:
            return full
        if s.mode == ZEROS_OFF_RANK0:
            return full if self.rank == 0 else np.zeros_like(full)
        index = [slice(None)] * full.ndim
        index[s.axis] = slice(s.start, s.stop)
        return _padded(np.ascontiguousarray(full[tuple(index)]), s)

    def head_is_embedding_view(self) -> bool:
        """Tied embeddings with a split head: the head is rows ``vocab_rows`` of the (replicated)
        embedding, taken as a view on the device (an in-place update of the embedding moves both)."""
        return self.vocab_split and head_weight_name(self.cfg) == "model.embed_tokens.weight"


def _balanced(n: int, parts: int) -> list[int]:
    """``n`` split into ``parts`` counts that differ by at most one (the larger ones first)."""
    q, extra = divmod(n, parts)
    return [q + (i < extra) for i in range(parts)]


def _ranges(counts: list[int]) -> list[tuple[int, int]]:
    """Consecutive [start, stop) ranges of these sizes from 0."""
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def _head_ranges(h: int, kvh: int, tp: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(query heads, K/V heads) [start, stop) of each rank (module doc): whole K/V groups per
    rank when tp <= kvh, else each K/V head on a balanced number of ranks sharing its queries."""
    group = h // kvh
    if tp <= kvh:
        return [((a * group, b * group), (a, b)) for a, b in _ranges(_balanced(kvh, tp))]
    out = []
    for j, ranks in enumerate(_balanced(tp, kvh)):
        for a, b in _ranges(_balanced(group, ranks)):
            out.append(((j * group + a, j * group + b), (j, j + 1)))
    return out


def read_sharded(infos: dict[str, TensorInfo], names: list[str], plan: TPPlan,
                 bf16_bits: bool = False) -> dict[str, np.ndarray]:
    """Read only this rank's slice of each tensor from its safetensors file.

    A row slice is one contiguous byte range (one read); a column slice reads each
    row's span through a memory map, so only the pages holding this rank's columns
    are touched. Dtypes as ``checkpoint.read_tensor``: float32, or bf16 as bit patterns.
    """
    out = {}
    for name in names:
        info = infos[name]
        s = plan.slice_of(name)
        if s is None:
            out[name] = read_tensor(info, bf16_bits)
            continue
        if s.mode == ZEROS_OFF_RANK0:
            full = read_tensor(info, bf16_bits) if plan.rank == 0 else None
            out[name] = full if full is not None else np.zeros(info.shape, dtype=_host_dtype(info, bf16_bits))
            continue
        out[name] = _padded(_convert(_read_slice(info, s), info.dtype, bf16_bits), s)
    return out


def _padded(part: np.ndarray, s: Slice) -> np.ndarray:
    """``part`` with zero rows appended along ``s.axis`` up to ``s.pad_to`` (as it is without)."""
    missing = s.pad_to - part.shape[s.axis]
    if missing <= 0:
        return part
    pad = [(0, 0)] * part.ndim
    pad[s.axis] = (0, missing)
    return np.pad(part, pad)


def _host_dtype(info: TensorInfo, bf16_bits: bool) -> type:
    return np.uint16 if (info.dtype == "BF16" and bf16_bits) else np.float32


def _read_slice(info: TensorInfo, s: Slice) -> np.ndarray:
    dtype = _ST_NP.get(info.dtype)
    if dtype is None:
        raise CheckpointError(f"{info.file}: tensor dtype {info.dtype} cannot be sharded (float tensors only)")
    shape = info.shape
    if not 0 <= s.start < s.stop <= shape[s.axis]:
        raise CheckpointError(f"{info.file}: slice [{s.start}, {s.stop}) of axis {s.axis} is outside shape "
                              f"{list(shape)}")
    item = np.dtype(dtype).itemsize
    if s.axis == 0:
        row = int(np.prod(shape[1:], dtype=np.int64)) * item
        buf = bytearray((s.stop - s.start) * row)
        with open(info.file, "rb") as f:
            f.seek(info.start + s.start * row)
            n = f.readinto(buf)
        if n != len(buf):
            raise CheckpointError(f"{info.file}: tensor data truncated")
        return np.frombuffer(buf, dtype=dtype).reshape((s.stop - s.start, *shape[1:]))
    mm = np.memmap(info.file, dtype=dtype, mode="r", offset=info.start, shape=shape)
    try:
        index = [slice(None)] * len(shape)
        index[s.axis] = slice(s.start, s.stop)
        return np.array(mm[tuple(index)], copy=True, order="C")
    finally:
        del mm


def _convert(arr: np.ndarray, st_dtype: str, bf16_bits: bool) -> np.ndarray:
    if st_dtype == "BF16":
        return arr if bf16_bits else bf16_bits_to_float32(arr)
    return arr.astype(np.float32) if st_dtype == "F16" else arr
