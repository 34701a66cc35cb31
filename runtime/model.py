"""The model family: a Llama target and a DeepSeek-V3-style MTP draft layer.

Owns: the forward math (RMSNorm, RoPE, grouped-query attention, SwiGLU), the
tensor names of both checkpoints, and the attention metadata that maps a
batch of (slot, position) pairs onto the static KV cache.

Must not know: requests, scheduling, sampling, gRPC or which framework runs
it. Every op goes through ``Ops`` (``runtime/backends``), so Paddle and Torch
execute this one definition. All shapes are static given the input shapes:
the same calls are captured into CUDA graphs by ``runtime/graphs.py``.

Conventions (see DESIGN § The speculative round):
- ``h_i`` (target hidden) = residual stream after the last decoder layer at
  position i, i.e. the input of the shared final norm + output head.
- The MTP pair ``(h_i, t_{i+1})`` sits at draft position i and predicts
  ``t_{i+2}``; its output hidden ``g`` (pre-final-norm) feeds the next substep.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from runtime.backends.base import Ops, Tensor
from runtime.config import ModelConfig
from runtime.rope import cos_sin_tables

Params = dict[str, Tensor]

# ---------------------------------------------------------------------------
# Tensor names
# ---------------------------------------------------------------------------

_LAYER_TENSORS = (
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
MTP_PREFIX = "mtp."
MTP_LAYER_PREFIX = "mtp.layer."
# Tensors the draft copies from the target checkpoint (its own embed/norm/head).
SHARED_FROM_TARGET = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def _layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One decoder layer's tensors for ``cfg.model_type`` (biases / q-k norms where it has them)."""
    d, hd, ffn = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qd, kvd = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out = {
        "input_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (qd, d),
        "self_attn.k_proj.weight": (kvd, d),
        "self_attn.v_proj.weight": (kvd, d),
        "self_attn.o_proj.weight": (d, qd),
        "post_attention_layernorm.weight": (d,),
        "mlp.gate_proj.weight": (ffn, d),
        "mlp.up_proj.weight": (ffn, d),
        "mlp.down_proj.weight": (d, ffn),
    }
    if cfg.qkv_bias:
        out.update({"self_attn.q_proj.bias": (qd,), "self_attn.k_proj.bias": (kvd,), "self_attn.v_proj.bias": (kvd,)})
    if cfg.o_bias:
        out["self_attn.o_proj.bias"] = (d,)
    if cfg.qk_norm:
        out.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    if cfg.mlp_bias:
        out.update({"mlp.gate_proj.bias": (ffn,), "mlp.up_proj.bias": (ffn,), "mlp.down_proj.bias": (d,)})
    return out


def target_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint in Hugging Face naming, with its shape."""
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
                                       "model.norm.weight": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for i in range(cfg.num_hidden_layers):
        for name, shape in _layer_shapes(cfg).items():
            out[f"model.layers.{i}.{name}"] = shape
    return out


def mtp_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensors of the MTP file (``mtp.safetensors``).

    - ``mtp.hnorm.weight`` [d]: RMSNorm of the previous hidden state
    - ``mtp.enorm.weight`` [d]: RMSNorm of the token embedding
    - ``mtp.eh_proj.weight`` [d, 2d]: projection of ``[hnorm(h); enorm(e)]``
    - ``mtp.layer.<llama decoder layer tensor>``: the one decoder block
    """
    d = cfg.hidden_size
    out = {"mtp.hnorm.weight": (d,), "mtp.enorm.weight": (d,), "mtp.eh_proj.weight": (d, 2 * d)}
    for name, shape in _layer_shapes(cfg).items():
        out[MTP_LAYER_PREFIX + name] = shape
    return out


def head_weight_name(cfg: ModelConfig) -> str:
    return "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"


# ---------------------------------------------------------------------------
# RoPE and attention metadata
# ---------------------------------------------------------------------------


class Rope:
    """Precomputed cos/sin tables ([max_pos, head_dim], HF rotate-half layout;
    every RoPE type computed as transformers does, see ``runtime/rope.py``).

    The sin table is stored sign-folded, ``[-sin[:D/2], sin[D/2:]]``, so that
    ``apply_rope`` swaps the halves without negating one (one kernel fewer).
    """

    def __init__(self, ops: Ops, cfg: ModelConfig, max_pos: int) -> None:
        cos, sin = cos_sin_tables(cfg, max_pos)                                # [P, D] float32
        half = sin.shape[1] // 2
        self.cos = ops.from_numpy(cos, "float32")
        self.sin = ops.from_numpy(np.concatenate([-sin[:, :half], sin[:, half:]], axis=1), "float32")
        # The same tables in the compute dtype (``build_attn_meta``): cast once here, not in
        # every step (each element rounds the same either way).
        self.cos_c, self.sin_c = ops.cast(self.cos, ops.dtype), ops.cast(self.sin, ops.dtype)
        self.max_pos = max_pos

    def tables(self, ops: Ops, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions int64 [B, T] -> cos, signed sin [B, T, 1, D] (float32), for ``apply_rope``."""
        return table_rows(ops, self.cos, self.sin, positions)


def table_rows(ops: Ops, cos: Tensor, sin: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """RoPE tables cos/sin [P, D] at positions int64 [B, T] -> [B, T, 1, D] each."""
    b, t = ops.shape(positions)
    flat, d = ops.reshape(positions, (b * t,)), ops.shape(cos)[1]
    return (ops.reshape(ops.index_select(cos, flat, 0), (b, t, 1, d)),
            ops.reshape(ops.index_select(sin, flat, 0), (b, t, 1, d)))


def apply_rope(ops: Ops, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, H, D] rotated by position: x*cos + rotate_half(x)*sin, with
    rotate_half(x) = [-x2, x1]; ``sin`` is sign-folded (``Rope``), so this is
    x*cos + [x2, x1]*sin (x1, x2 = the two halves of the head dim).

    Computed in the dtype of ``cos``/``sin`` (``AttnMeta``: the compute dtype),
    the result in x's dtype.
    """
    half = ops.shape(x)[-1] // 2
    swapped = ops.cat([x[..., half:], x[..., :half]], axis=-1)
    return ops.cast(x * cos + swapped * sin, ops.dtype_name(x))


@dataclass
class AttnMeta:
    """Where a forward's tokens live in the KV cache and what they may attend to,
    made once per forward and shared by its layers.

    write_index int64 [B*T]   flat cache row each new token's K/V is written to
    read_slots  int64 [B]     cache slot each batch row reads; it reads that slot's
                              first La rows only (La = attend length: the context
                              bucket, not max_len)
    mask        key position j visible to query at position p iff j <= p: bool
                [B, T, La] in the form the backend's attention takes
                (``Ops.attention_mask``, queries grouped per K/V head); made on first
                use (the fused attention never asks: its causal bound is ``positions``)
    cos, sin    [B, T, 1, D] in the compute dtype (sin sign-folded, see ``Rope``),
                gathered on first use (the fused kernels read ``cos_table``/``sin_table``
                [P, D] at ``positions`` themselves)
    positions   int64 [B, T]  each token's position (the fused attention's causal bound)
    """

    ops: Ops
    write_index: Tensor
    read_slots: Tensor
    cos_table: Tensor
    sin_table: Tensor
    attend_len: int
    max_len: int
    positions: Tensor
    groups: int

    @functools.cached_property
    def _cos_sin(self) -> tuple[Tensor, Tensor]:
        return table_rows(self.ops, self.cos_table, self.sin_table, self.positions)

    @property
    def cos(self) -> Tensor:
        return self._cos_sin[0]

    @property
    def sin(self) -> Tensor:
        return self._cos_sin[1]

    @functools.cached_property
    def mask(self) -> Tensor:
        ops, (b, t) = self.ops, self.ops.shape(self.positions)
        key_pos = ops.arange(self.attend_len)                                  # [La]
        visible = ops.less_equal(ops.reshape(key_pos, (1, 1, self.attend_len)), ops.reshape(self.positions, (b, t, 1)))
        return ops.attention_mask(visible, self.groups)


def build_attn_meta(ops: Ops, rope: Rope, write_slots: Tensor, positions: Tensor,
                    read_slots: Tensor, max_len: int, attend_len: int, groups: int) -> AttnMeta:
    """write_slots/positions int64 [B, T], read_slots int64 [B] -> AttnMeta, for a model
    with ``groups`` query heads per K/V head.

    Padding tokens carry the scratch slot in ``write_slots`` so their writes
    never touch a live request's cache rows. Cache rows are flat:
    row = slot * max_len + position, so a slot's prefix is contiguous.
    """
    b, t = ops.shape(positions)
    write_index = ops.reshape(write_slots * max_len + positions, (b * t,))
    # RoPE in the compute dtype (as transformers' Llama computes it): for a bf16 model the
    # tables were cast once (``Rope``), not in every layer; float32 models keep float32 tables.
    return AttnMeta(ops, write_index, read_slots, rope.cos_c, rope.sin_c, attend_len, max_len, positions, groups)


# ---------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------


# Fused projections (derived at load, never in a checkpoint): q/k/v as one
# matrix and gate/up as one, so a layer runs two GEMMs where it ran five.
_FUSED = (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
          ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")))


def fuse_projections(ops: Ops, params: Params, prefixes: list[str]) -> Params:
    """For each decoder layer ``prefix``: one buffer per fused group, returned by its
    derived name; ``params`` keeps every checkpoint name, now as a view into that
    buffer, so an in-place weight update by name writes the fused buffer too.

    Returns {} when the backend cannot make views (``Ops.fuse_rows`` is None).
    """
    fused: Params = {}
    for prefix in prefixes:
        for name, parts in _FUSED:
            for suffix in (".weight", ".bias"):
                keys = [prefix + part + suffix for part in parts]
                if not all(k in params for k in keys):
                    continue
                made = ops.fuse_rows([params[k] for k in keys])
                if made is None:
                    return {}
                fused[prefix + name + suffix], views = made
                params.update(zip(keys, views))
    return fused


def decoder_layer(ops: Ops, p: Params, prefix: str, cfg: ModelConfig, x: Tensor,
                  meta: AttnMeta | None, cache: tuple[Tensor, Tensor] | None,
                  train_mask: Tensor | None = None, cos_sin: tuple[Tensor, Tensor] | None = None,
                  reduce: Callable[[Tensor], Tensor] | None = None, delta: Tensor | None = None,
                  defer: bool = False) -> Any:
    """One Llama decoder block. x [B, T, d] -> [B, T, d].

    With ``meta``/``cache``: K/V are written into the cache rows then read back
    for attention (decode/verify/prefill). Without (training): causal attention
    over the chunk itself using ``train_mask`` [B, T, T] and ``cos_sin``.
    Uses the fused projections of ``fuse_projections`` when ``p`` has them.
    Tensor parallel (``runtime/tp_plan.py``): ``p`` holds one rank's shards, ``cfg`` its
    local head and ffn counts, and ``reduce`` sums the row-split o and down outputs
    over the ranks (None: one device, nothing to sum).
    Residual deferred across layers (``target_forward``): ``delta`` is the previous layer's
    last residual term, added here with the input RMSNorm (one fused kernel where the
    kernels apply); ``defer`` returns ``(x, last residual term)`` instead of their sum.
    """
    b, t, d = ops.shape(x)
    h, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    kern = ops.kernels
    if delta is None:
        hn = ops.rms_norm(x, p[prefix + "input_layernorm.weight"], eps)
    elif kern is not None:
        x, hn = kern.add_rms_norm(x, delta, p[prefix + "input_layernorm.weight"], eps)
    else:
        x = x + delta
        hn = ops.rms_norm(x, p[prefix + "input_layernorm.weight"], eps)
    if (kern is not None and meta is not None and not cfg.qk_norm and kern.fits(hd)
            and prefix + "self_attn.qkv_proj.weight" in p and prefix + "mlp.gate_up_proj.weight" in p):
        return _fused_layer(ops, kern, p, prefix, cfg, x, hn, meta, cache, reduce, defer)
    _not_invariant(kern, "per-head q/k norms (qk_norm)" if cfg.qk_norm
                   else f"head_dim {hd}, or q/k/v and gate/up unfused")
    dt = ops.dtype_name(x)
    cos, sin = (meta.cos, meta.sin) if meta is not None else (ops.cast(cos_sin[0], dt), ops.cast(cos_sin[1], dt))
    if prefix + "self_attn.qkv_proj.weight" in p:
        qkv = ops.reshape(_proj(ops, p, prefix + "self_attn.qkv_proj", hn), (b, t, h + 2 * kvh, hd))
        v = qkv[:, :, h + kvh:]
        if cfg.qk_norm:
            q, k = _qk_norm(ops, p, prefix, eps, qkv[:, :, :h], qkv[:, :, h:h + kvh])
            q, k = apply_rope(ops, q, cos, sin), apply_rope(ops, k, cos, sin)
        else:                                                                  # one RoPE pass over q and k heads
            qk = apply_rope(ops, qkv[:, :, :h + kvh], cos, sin)
            q, k = qk[:, :, :h], qk[:, :, h:]
    else:
        q = ops.reshape(_proj(ops, p, prefix + "self_attn.q_proj", hn), (b, t, h, hd))
        k = ops.reshape(_proj(ops, p, prefix + "self_attn.k_proj", hn), (b, t, kvh, hd))
        v = ops.reshape(_proj(ops, p, prefix + "self_attn.v_proj", hn), (b, t, kvh, hd))
        if cfg.qk_norm:
            q, k = _qk_norm(ops, p, prefix, eps, q, k)
        q, k = apply_rope(ops, q, cos, sin), apply_rope(ops, k, cos, sin)
    if meta is not None:
        k_cache, v_cache = cache                                               # [(S+1)*L, KVH, D]
        # NOTE: write before read, so tokens of this forward see each other.
        ops.scatter_rows_(k_cache, meta.write_index, ops.reshape(k, (b * t, kvh, hd)))
        ops.scatter_rows_(v_cache, meta.write_index, ops.reshape(v, (b * t, kvh, hd)))
        attn = _context_attention(ops, q, cache, meta)
    else:
        attn = ops.attention(q, k, v, ops.attention_mask(train_mask, h // kvh))
    o = _proj(ops, p, prefix + "self_attn.o_proj", ops.reshape(attn, (b, t, h * hd)))
    x = x + (o if reduce is None else reduce(o))
    hn = ops.rms_norm(x, p[prefix + "post_attention_layernorm.weight"], eps)
    if prefix + "mlp.gate_up_proj.weight" in p:
        gate_up = _proj(ops, p, prefix + "mlp.gate_up_proj", hn)
        ffn = cfg.intermediate_size
        mlp = ops.silu(gate_up[..., :ffn]) * gate_up[..., ffn:]
    else:
        mlp = ops.silu(_proj(ops, p, prefix + "mlp.gate_proj", hn)) * _proj(ops, p, prefix + "mlp.up_proj", hn)
    down = _proj(ops, p, prefix + "mlp.down_proj", mlp)
    down = down if reduce is None else reduce(down)
    return (x, down) if defer else x + down


def _fused_layer(ops: Ops, kern: Any, p: Params, prefix: str, cfg: ModelConfig, x: Tensor, hn: Tensor,
                 meta: AttnMeta, cache: tuple[Tensor, Tensor], reduce: Callable[[Tensor], Tensor] | None,
                 defer: bool) -> Any:
    """``decoder_layer``'s cached path on the fused kernels (``Ops.kernels``): the same math
    as the plain ops below it, up to rounding; 11 kernels at decode shapes instead of ~33, the
    projections on the split-K GEMM where it fits (``Kernels.fits_linear``), and there RoPE
    with the KV-cache write as the q/k/v projection's epilogue and SiLU·mul as the gate/up's
    (8 kernels, the attention's combine counted).
    x [B, T, d], hn = its input RMSNorm -> [B, T, d]."""
    b, t, d = ops.shape(x)
    h, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    k_cache, v_cache = cache
    # NOTE: k/v are written to the cache before attention reads it (the kernels run in
    # stream order), so tokens of this forward see each other.
    w_qkv = p[prefix + "self_attn.qkv_proj.weight"]
    # RoPE's tables read at each token's position inside the kernels (no gather launch).
    tables = (meta.cos_table, meta.sin_table)
    rows = ops.reshape(meta.positions, (b * t,))
    if prefix + "self_attn.qkv_proj.bias" not in p and kern.fits_qkv_rope(hn, w_qkv, hd):
        q = kern.qkv_rope(hn, w_qkv, *tables, h, kvh, k_cache, v_cache, meta.write_index, table_rows=rows)
    else:
        qkv = ops.reshape(_proj(ops, p, prefix + "self_attn.qkv_proj", hn, kern), (b, t, h + 2 * kvh, hd))
        q = kern.rope_write_kv(qkv, *tables, h, kvh, k_cache, v_cache, meta.write_index, table_rows=rows)
    w_o = p[prefix + "self_attn.o_proj.weight"]
    if kern.fits_attention(h // kvh, t):
        attn = kern.attention(q, k_cache, v_cache, meta.read_slots, meta.positions, meta.attend_len, meta.max_len,
                              w_o)
    else:                                                                      # many query rows: plain attention
        _not_invariant(kern, f"{h // kvh} query heads a K/V head, more than one attention program holds")
        attn = _context_attention(ops, q, cache, meta)
    o = _proj(ops, p, prefix + "self_attn.o_proj", ops.reshape(attn, (b, t, h * hd)), kern)
    x, hn = kern.add_rms_norm(x, o if reduce is None else reduce(o), p[prefix + "post_attention_layernorm.weight"],
                              cfg.rms_norm_eps)
    w_gu = p[prefix + "mlp.gate_up_proj.weight"]
    if prefix + "mlp.gate_up_proj.bias" not in p and kern.fits_swiglu(hn, w_gu, cfg.intermediate_size):
        mlp = kern.swiglu(hn, w_gu)
    else:
        mlp = kern.silu_mul(_proj(ops, p, prefix + "mlp.gate_up_proj", hn, kern), cfg.intermediate_size)
    down = _proj(ops, p, prefix + "mlp.down_proj", mlp, kern)
    down = down if reduce is None else reduce(down)
    return (x, down) if defer else x + down


def _not_invariant(kern: Any, what: str) -> None:
    """A batch-invariant step (``Kernels.invariant``) that would leave the fused kernels for
    the plain ops, whose bits follow the batch: an error naming why, never a silent change."""
    if kern is not None and kern.invariant:
        raise ValueError(f"runtime.batch_invariant: this model's decoder layer cannot run on the batch-invariant "
                         f"kernels ({what}); turn runtime.batch_invariant off")


def _context_attention(ops: Ops, q: Tensor, cache: tuple[Tensor, Tensor], meta: AttnMeta) -> Tensor:
    """q [B, T, H, D] over the cache: only the first attend_len rows of each row's slot are
    read, so attention cost follows the context bucket, not the cache length."""
    k_all = ops.gather_context(cache[0], meta.read_slots, meta.attend_len, meta.max_len)  # [B, La, KVH, D]
    v_all = ops.gather_context(cache[1], meta.read_slots, meta.attend_len, meta.max_len)
    return ops.attention(q, k_all, v_all, meta.mask)


def _qk_norm(ops: Ops, p: Params, prefix: str, eps: float, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """Qwen3: RMSNorm per head over head_dim, before RoPE."""
    return (ops.rms_norm(q, p[prefix + "self_attn.q_norm.weight"], eps),
            ops.rms_norm(k, p[prefix + "self_attn.k_norm.weight"], eps))


def _proj(ops: Ops, p: Params, name: str, x: Tensor, kern: Any = None) -> Tensor:
    """x @ W^T (+ bias when the checkpoint has ``<name>.bias``: Qwen2 q/k/v, attention_bias, mlp_bias);
    on the fused kernels' GEMM when ``kern`` is given and takes the shapes."""
    y = _linear(ops, x, p[name + ".weight"], kern)
    bias = p.get(name + ".bias")
    return y if bias is None else y + bias


def _linear(ops: Ops, x: Tensor, w: Tensor, kern: Any) -> Tensor:
    """x @ w^T, on the fused kernels' GEMM when ``kern`` is given and takes the shapes."""
    return kern.linear(x, w) if kern is not None and kern.fits_linear(x, w) else ops.linear(x, w)


def lm_head(ops: Ops, p: Params, cfg: ModelConfig, hidden: Tensor) -> Tensor:
    """hidden [..., d] (pre-norm) -> logits [..., V] in float32."""
    normed = ops.rms_norm(hidden, p["model.norm.weight"], cfg.rms_norm_eps)
    return ops.cast(ops.linear(normed, p[head_weight_name(cfg)]), "float32")


def head_argmax(ops: Ops, p: Params, cfg: ModelConfig, normed: Tensor) -> tuple[Tensor, Tensor]:
    """normed [..., d] (after the final RMSNorm) -> (logits float32 [..., V], their argmax
    int64 [...]): ``lm_head``'s values, the cast and the argmax one launch where the backend can."""
    return ops.float_argmax(_linear(ops, normed, p[head_weight_name(cfg)], ops.kernels))


def target_forward(ops: Ops, p: Params, cfg: ModelConfig, tokens: Tensor, meta: AttnMeta | None,
                   caches: list[tuple[Tensor, Tensor]] | None, reduce: Callable[[Tensor], Tensor] | None = None,
                   final_norm: bool = False, **train: Any) -> Any:
    """tokens int64 [B, T] -> hidden [B, T, d] (residual stream after the last layer), or
    with ``final_norm`` (hidden, its final RMSNorm) for ``head_argmax``.
    ``reduce``: the tensor-parallel sum of ``decoder_layer`` (the embedding is replicated)."""
    x = ops.embedding(p["model.embed_tokens.weight"], tokens)
    # With the fused kernels, each layer's last residual add rides on the next layer's
    # input RMSNorm (one add_rms_norm kernel instead of an add and a norm), the last layer's
    # on the final norm when the caller wants it (``Kernels.fuse_head``).
    kern = ops.kernels
    defer = kern is not None and meta is not None
    last_too = defer and final_norm and kern.fuse_head
    delta = None
    n = cfg.num_hidden_layers
    for i in range(n):
        keep = defer and (i < n - 1 or last_too)
        out = decoder_layer(ops, p, f"model.layers.{i}.", cfg, x, meta, caches[i] if caches is not None else None,
                            reduce=reduce, delta=delta, defer=keep, **train)
        x, delta = out if keep else (out, None)
    if not final_norm:
        return x
    w = p["model.norm.weight"]
    if delta is not None:
        return kern.add_rms_norm(x, delta, ops.cast(w, ops.dtype_name(x)), cfg.rms_norm_eps)
    return x, ops.rms_norm(x, w, cfg.rms_norm_eps)


def mtp_forward(ops: Ops, p: Params, cfg: ModelConfig, prev_hidden: Tensor, tokens: Tensor,
                meta: AttnMeta | None, cache: tuple[Tensor, Tensor] | None, **train: Any) -> Tensor:
    """The MTP layer: x = W_proj [hnorm(prev_hidden); enorm(embed(tokens))], one block.

    prev_hidden [B, T, d], tokens int64 [B, T] -> g [B, T, d] (pre-final-norm).
    """
    eps = cfg.rms_norm_eps
    e = ops.embedding(p["model.embed_tokens.weight"], tokens)
    h = ops.cast(prev_hidden, ops.dtype_name(e))
    x = ops.cat([ops.rms_norm(h, p["mtp.hnorm.weight"], eps), ops.rms_norm(e, p["mtp.enorm.weight"], eps)], axis=-1)
    x = ops.linear(x, p["mtp.eh_proj.weight"])                                 # [B, T, d]
    return decoder_layer(ops, p, MTP_LAYER_PREFIX, cfg, x, meta, cache, **train)


def init_params(cfg: ModelConfig, seed: int, names: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Random float32 weights (norms = 1, projections ~ N(0, 0.02)) for tests and timing."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in names.items():
        if name.endswith(".bias"):
            out[name] = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        elif len(shape) == 1:
            out[name] = np.ones(shape, dtype=np.float32)
        else:
            out[name] = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    return out
