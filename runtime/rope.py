"""RoPE frequencies and cos/sin tables, exactly as transformers computes them.

Owns: the inverse frequencies of every supported RoPE type (default, linear,
dynamic NTK, llama3, yarn) and the per-position cos/sin tables
([max_pos, head_dim], rotate-half layout) that ``model.Rope`` puts on the
device. The arithmetic follows ``transformers.modeling_rope_utils`` step by
step in float32 (numpy 2 keeps Python scalars "weak", as torch does), so the
tables agree with transformers' to rounding.

Dynamic NTK: transformers recomputes the frequencies whenever a forward's
largest position grows past ``max_position_embeddings``, using
``seq_len = max(position) + 1``. Decoding one token at a time (its ``generate``),
the token at position p is therefore rotated with the frequencies of
``seq_len = max(p + 1, max_position_embeddings)``, and so are the keys it
cached. The table here holds exactly that per position, which makes a k+1
token verify pass rotate every position as token-by-token decoding does
(speculation stays lossless). Prompts longer than max_position_embeddings
(where transformers would rotate the whole prompt with one longer seq_len)
are refused before they reach the model.

Must not know: frameworks, requests.
"""

from __future__ import annotations

import math

import numpy as np

from runtime.config import ModelConfig, RopeScaling

F32 = np.float32


def _exponents(dim: int) -> np.ndarray:
    """torch.arange(0, dim, 2, dtype=int64).float() / dim, in float32."""
    return np.arange(0, dim, 2, dtype=np.int64).astype(F32) / F32(dim)


def _default_inv_freq(base: float, dim: int) -> np.ndarray:
    return F32(1.0) / (F32(base) ** _exponents(dim))


def _llama3(base: float, dim: int, s: RopeScaling) -> np.ndarray:
    inv_freq = _default_inv_freq(base, dim)
    factor, low, high = s.factor, s.low_freq_factor, s.high_freq_factor
    old_context_len = s.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(F32)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama).astype(F32)


def _yarn(base: float, dim: int, max_pos: int, s: RopeScaling) -> tuple[np.ndarray, float]:
    orig = s.original_max_position_embeddings
    factor = s.factor if s.factor is not None else max_pos / orig

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = float(get_mscale(factor, s.mscale) / get_mscale(factor, s.mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = s.beta_fast or 32
    beta_slow = s.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                                                   # transformers: prevent singularity
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - low) / (high - low), 0, 1).astype(F32)
    pos_freqs = F32(base) ** _exponents(dim)
    inv_extrapolation = F32(1.0) / pos_freqs
    inv_interpolation = F32(1.0) / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = inv_interpolation * (1 - extrapolation_factor) + inv_extrapolation * extrapolation_factor
    return inv_freq.astype(F32), attention_factor


def _dynamic_rows(base: float, dim: int, max_pos_emb: int, factor: float, positions: np.ndarray) -> np.ndarray:
    """inv_freq [P, D/2] for each position p: seq_len = max(p + 1, max_position_embeddings)."""
    seq_len = np.maximum(positions + 1, max_pos_emb).astype(F32)[:, None]       # [P, 1]
    scaled = ((factor * seq_len / max_pos_emb) - (factor - 1)) ** F32(dim / (dim - 2))
    row_base = F32(base) * scaled.astype(F32)                                    # [P, 1]
    return (F32(1.0) / (row_base ** _exponents(dim)[None, :])).astype(F32)


def inv_freq_table(cfg: ModelConfig, max_pos: int) -> tuple[np.ndarray, float]:
    """(inv_freq [max_pos, head_dim/2] float32, attention scaling of cos/sin)."""
    dim, base, s = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
    positions = np.arange(max_pos, dtype=np.int64)
    scaling = 1.0
    if s is None:
        inv = _default_inv_freq(base, dim)
    elif s.rope_type == "linear":
        inv = (_default_inv_freq(base, dim) / F32(s.factor)).astype(F32)
    elif s.rope_type == "llama3":
        inv = _llama3(base, dim, s)
    elif s.rope_type == "yarn":
        inv, scaling = _yarn(base, dim, cfg.max_position_embeddings, s)
    elif s.rope_type == "dynamic":
        return _dynamic_rows(base, dim, cfg.max_position_embeddings, s.factor, positions), scaling
    else:  # RopeScaling refuses other types at construction
        raise ValueError(f"unknown rope_type {s.rope_type!r}")
    return np.broadcast_to(inv, (max_pos, dim // 2)), scaling


def cos_sin_tables(cfg: ModelConfig, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [max_pos, head_dim] (``cat([freqs, freqs])``, times the attention scaling)."""
    inv, scaling = inv_freq_table(cfg, max_pos)
    freqs = np.arange(max_pos, dtype=np.int64).astype(F32)[:, None] * inv       # [P, D/2] float32
    emb = np.concatenate([freqs, freqs], axis=-1).astype(F32)                  # [P, D]
    cos, sin = np.cos(emb), np.sin(emb)
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos.astype(F32), sin.astype(F32)
