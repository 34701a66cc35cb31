"""Reading a Hugging Face ``config.json`` completely, or refusing it.

Owns: the mapping from both config generations (transformers < 5: top-level
``rope_theta`` / ``rope_scaling``; transformers >= 5: ``rope_parameters``)
and the four supported architectures (Llama, Mistral, Qwen2, Qwen3) onto a
``ModelConfig``, with transformers' own precedence and defaults; and the
inverse (``to_hf_dict``) for checkpoints specsplit writes. Every key either
changes nothing in the forward pass (listed in ``_INERT``), is read, or is a
``ConfigError`` naming it: a key specsplit does not know is refused, never
silently ignored, because it might change the math.

Must not know: tensors, frameworks, how RoPE frequencies are computed
(``runtime/rope.py``).
"""

from __future__ import annotations

from typing import Any

from core.config import ConfigError
from runtime.config import ModelConfig, RopeScaling

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
DEFAULT_THETA = 10000.0               # transformers' RotaryEmbeddingConfigMixin.default_theta
# transformers' per-architecture defaults for keys a config.json may leave out.
_DEFAULT_EPS = {"llama": 1e-6, "mistral": 1e-6, "qwen2": 1e-6, "qwen3": 1e-6}
_DEFAULT_MAX_POS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768, "qwen3": 32768}
_DEFAULT_HEAD_DIM = {"qwen3": 128}    # Qwen3Config.head_dim defaults to 128, not hidden / heads

# Keys that never change the forward pass of a causal LM at inference: bookkeeping,
# training-only settings, generation defaults (generation_config.json governs those).
_INERT = frozenset("""
    architectures model_type transformers_version torch_dtype dtype use_cache initializer_range
    attention_dropout pad_token_id pretraining_tp output_attentions output_hidden_states return_dict
    is_decoder is_encoder_decoder add_cross_attention tie_encoder_decoder chunk_size_feed_forward
    id2label label2id num_labels problem_type finetuning_task tokenizer_class prefix task_specific_params
    pruned_heads torchscript use_bfloat16 tf_legacy_loss cross_attention_hidden_size
    decoder_start_token_id sep_token_id max_length min_length do_sample early_stopping num_beams
    num_beam_groups diversity_penalty temperature top_k top_p typical_p repetition_penalty
    length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size bad_words_ids num_return_sequences
    output_scores return_dict_in_generate forced_bos_token_id forced_eos_token_id remove_invalid_values
    exponential_decay_length_penalty suppress_tokens begin_suppress_tokens
""".split())
# Read below (or checked to hold a value that is a no-op).
_READ = frozenset("""
    vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads
    rms_norm_eps rope_theta rope_scaling rope_parameters max_position_embeddings tie_word_embeddings
    bos_token_id eos_token_id head_dim attention_bias mlp_bias hidden_act partial_rotary_factor
    sliding_window use_sliding_window max_window_layers layer_types original_max_position_embeddings
""".split())
# Keys of the RoPE dict: which ones each type reads (transformers ignores the others).
_ROPE_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_ROPE_READS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "original_max_position_embeddings", "truncate"},
}
_ROPE_KNOWN = set().union(*_ROPE_READS.values()) | _ROPE_COMMON


def _refuse(key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json: {key}={value!r} is not supported: {why}")


def _int_or_none(key: str, v: Any) -> int | None:
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise ConfigError(f"config.json: {key}={v!r} is invalid: must be an integer or null")


def _eos_ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    vals = v if isinstance(v, list) else [v]
    return tuple(_int_or_none("eos_token_id", x) for x in vals)


def _check_keys(raw: dict[str, Any]) -> None:
    for key in raw:
        if key.startswith("_") or key in _INERT or key in _READ:
            continue
        raise _refuse(key, raw[key], "specsplit does not know this key, so it cannot tell whether it "
                      "changes the model's math")


def _check_attention_kind(mt: str, raw: dict[str, Any]) -> None:
    """Full causal attention in every layer, or refuse (no sliding window)."""
    window = raw.get("sliding_window")
    if mt == "mistral":
        if window is not None:
            raise _refuse("sliding_window", window, "sliding-window attention is not implemented; "
                          "only sliding_window null (full attention) is served")
    elif mt in ("qwen2", "qwen3"):
        if raw.get("use_sliding_window", False):
            raise _refuse("use_sliding_window", raw["use_sliding_window"],
                          "sliding-window attention is not implemented")
    elif window is not None:
        raise _refuse("sliding_window", window, f"{ARCHITECTURES[mt]} has no sliding window")
    layer_types = raw.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        bad = sorted({t for t in layer_types if t != "full_attention"})
        raise _refuse("layer_types", bad, "only full_attention layers are implemented")


def _rope(raw: dict[str, Any], max_pos: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) with transformers' precedence (``convert_rope_params_to_dict``):
    a non-empty ``rope_scaling`` wins over ``rope_parameters``; theta from the dict,
    else top-level ``rope_theta``, else the default."""
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = raw.get(key) or {}
    if not isinstance(params, dict):
        raise _refuse(key, params, "must be a JSON object")
    nested = [k for k, v in params.items() if isinstance(v, dict)]
    if nested:
        raise _refuse(f"{key}.{nested[0]}", params[nested[0]], "per-layer-type RoPE parameters are not implemented")
    unknown = sorted(set(params) - _ROPE_KNOWN)
    if unknown:
        raise _refuse(f"{key}.{unknown[0]}", params[unknown[0]], "unknown RoPE parameter")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in _ROPE_READS:
        raise _refuse(f"{key}.rope_type", rope_type, f"supported RoPE types are {sorted(_ROPE_READS)}")
    theta = params.get("rope_theta", raw.get("rope_theta", DEFAULT_THETA))
    if theta is None:
        theta = raw.get("rope_theta", DEFAULT_THETA)
    prf = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if prf is not None and float(prf) != 1.0:
        raise _refuse("partial_rotary_factor", prf, "partial rotary embeddings are not implemented")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise ConfigError(f"config.json: rope_theta={theta!r} is invalid: must be a number")
    if rope_type == "default":
        return float(theta), None
    kw: dict[str, Any] = {name: params.get(name) for name in _ROPE_READS[rope_type]}
    if rope_type in ("llama3", "yarn"):
        # NOTE: transformers gives a top-level original_max_position_embeddings priority
        # (Phi-3 style), else the dict's, else max_position_embeddings.
        orig = raw.get("original_max_position_embeddings", kw.get("original_max_position_embeddings"))
        kw["original_max_position_embeddings"] = max_pos if orig is None else orig
    if rope_type == "yarn":
        kw["truncate"] = True if kw.get("truncate") is None else bool(kw["truncate"])
    for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale",
                 "mscale_all_dim", "attention_factor"):
        if kw.get(name) is not None:
            kw[name] = float(kw[name])
    try:
        return float(theta), RopeScaling(rope_type=rope_type, **kw)
    except ConfigError as exc:
        raise ConfigError(f"config.json {key}: {exc}") from None


def parse_hf_config(cls: type[ModelConfig], raw: dict[str, Any]) -> ModelConfig:
    """config.json dict -> ModelConfig, or ConfigError naming the key."""
    mt = raw.get("model_type", "llama")
    if mt not in ARCHITECTURES:
        raise ConfigError(f"config.json: model.model_type={mt!r} is invalid: must be one of {sorted(ARCHITECTURES)}")
    archs = raw.get("architectures")
    if archs is not None and list(archs) != [ARCHITECTURES[mt]]:
        raise _refuse("architectures", archs, f"model_type {mt!r} is served as [{ARCHITECTURES[mt]!r}]")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if name not in raw:
            raise ConfigError(f"config.json is missing required key {name!r}")
    _check_keys(raw)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", act, "only silu (SwiGLU) is implemented")
    _check_attention_kind(mt, raw)
    max_pos = raw.get("max_position_embeddings", _DEFAULT_MAX_POS[mt])
    theta, scaling = _rope(raw, max_pos)
    attention_bias = bool(raw.get("attention_bias", False)) if mt in ("llama", "qwen3") else False
    if mt in ("mistral", "qwen2") and raw.get("attention_bias"):
        raise _refuse("attention_bias", raw["attention_bias"], f"{ARCHITECTURES[mt]} has no attention_bias option")
    mlp_bias = bool(raw.get("mlp_bias", False))
    if mlp_bias and mt != "llama":
        raise _refuse("mlp_bias", mlp_bias, f"{ARCHITECTURES[mt]} has no mlp_bias option")
    head_dim = raw.get("head_dim", _DEFAULT_HEAD_DIM.get(mt))
    eos = _eos_ids(raw.get("eos_token_id"))
    dtype = raw.get("torch_dtype", raw.get("dtype")) or "float32"
    return cls(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        rms_norm_eps=float(raw.get("rms_norm_eps", _DEFAULT_EPS[mt])),
        rope_theta=theta,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        torch_dtype=dtype,
        bos_token_id=_int_or_none("bos_token_id", raw.get("bos_token_id")),
        eos_token_id=eos[0] if eos else None,
        model_type=mt,
        head_dim=0 if head_dim is None else head_dim,
        attention_bias=attention_bias,
        mlp_bias=mlp_bias,
        rope_scaling=scaling,
        eos_token_ids=eos,
    )


def to_hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    """ModelConfig -> a transformers >= 5 style config.json dict (read back by ``parse_hf_config``)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope["rope_type"] = s.rope_type
        for name in _ROPE_READS[s.rope_type]:
            v = getattr(s, name)
            if v is not None:
                rope[name] = v
    eos: Any = list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_id
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.model_type]], "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": cfg.torch_dtype,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": eos,
    }
    if cfg.model_type in ("llama", "qwen3"):
        out["attention_bias"] = cfg.attention_bias
    if cfg.model_type == "llama":
        out["mlp_bias"] = cfg.mlp_bias
    if cfg.model_type == "mistral":
        out["sliding_window"] = None
    return out
