"""Config tree: invalid values raise errors naming the field and the allowed range."""

import json

import pytest

from core.config import ConfigError, SecurityConfig
from core.params import SamplingParams
from orchestrator.config import OrchestratorConfig
from runtime.config import CacheConfig, GraphConfig, ModelConfig, RuntimeConfig, SpecConfig

BASE = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("ctor, field, value, words", [
    (lambda v: SamplingParams(max_tokens=v), "max_tokens", 0, ">= 1"),
    (lambda v: SamplingParams(temperature=v), "temperature", -1.0, "[0, 100]"),
    (lambda v: SamplingParams(temperature=v), "temperature", float("nan"), "[0, 100]"),
    (lambda v: SamplingParams(top_p=v), "top_p", 0.0, "(0, 1]"),
    (lambda v: SamplingParams(top_k=v), "top_k", -2, ">= 0"),
    (lambda v: SpecConfig(max_k=v), "spec.max_k", 17, "[0, 16]"),
    (lambda v: SpecConfig(max_k=2, default_k=v), "spec.default_k", 3, "max_k=2"),
    (lambda v: CacheConfig(max_slots=v), "cache.max_slots", 0, "[1, 4096]"),
    (lambda v: CacheConfig(max_len=v), "cache.max_len", 4, "[8,"),
    (lambda v: GraphConfig(batch_buckets=v), "graphs.batch_buckets", (4, 2), "ascending"),
    (lambda v: RuntimeConfig(backend=v), "runtime.backend", "jax", "paddle"),
    (lambda v: RuntimeConfig(device=v), "runtime.device", "gpu0", "cuda:N"),
    (lambda v: ModelConfig(**{**BASE, "num_key_value_heads": v}), "model.num_key_value_heads", 3, "divisor"),
    (lambda v: ModelConfig(**{**BASE, "hidden_size": v}), "model.hidden_size", 66, "divisible"),
    (lambda v: OrchestratorConfig(draft_address=None, default_k=v, max_k=2), "default_k", 5, "max_k=2"),
    (lambda v: SecurityConfig(tls_cert=v), "security.tls_cert/tls_key", "cert.pem", "both set"),
])
def test_invalid_values_name_field_and_range(ctor, field, value, words):
    with pytest.raises(ConfigError) as err:
        ctor(value)
    assert field in str(err.value) and words in str(err.value)


def test_model_config_from_hf_json(tmp_path):
    raw = {**BASE, "model_type": "llama", "rope_theta": 500000.0, "tie_word_embeddings": True,
           "eos_token_id": [7, 8], "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_json_file(tmp_path / "config.json")
    assert cfg.rope_theta == 500000.0 and cfg.tie_word_embeddings and cfg.eos_token_id == 7
    assert cfg.head_dim == 16 and cfg.torch_dtype == "bfloat16"
    again = ModelConfig.from_hf_dict(cfg.to_hf_dict())
    assert again == cfg


def test_model_config_rejects_missing_key_and_other_arch(tmp_path):
    with pytest.raises(ConfigError, match="intermediate_size"):
        ModelConfig.from_hf_dict({k: v for k, v in BASE.items() if k != "intermediate_size"})
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_hf_dict({**BASE, "model_type": "gpt2"})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        ModelConfig.from_json_file(tmp_path / "config.json")


# --- Hugging Face config.json: both generations read, unsupported math refused ----------------
LLAMA3_V5 = {**BASE, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
             "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}}


def test_both_config_generations_read_the_same():
    """Regression (issue 11): rope_parameters was ignored (theta fell back to 10000) and a
    classic rope_scaling llama3 config was refused."""
    old = {**{k: v for k, v in LLAMA3_V5.items() if k != "rope_parameters"}, "rope_theta": 500000.0,
           "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 1024}}
    new, classic = ModelConfig.from_hf_dict(LLAMA3_V5), ModelConfig.from_hf_dict(old)
    assert new == classic
    assert new.rope_theta == 500000.0 and new.rope_scaling.rope_type == "llama3" and new.rope_scaling.factor == 8.0
    assert ModelConfig.from_hf_dict(new.to_hf_dict()) == new


def test_head_dim_biases_eos_list_and_qwen_variants():
    cfg = ModelConfig.from_hf_dict({**BASE, "head_dim": 24, "attention_bias": True, "mlp_bias": True,
                                    "eos_token_id": [5, 6], "bos_token_id": 4})
    assert (cfg.head_dim, cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (24, True, True, True)
    assert cfg.eos_token_id == 5 and cfg.eos_token_ids == (5, 6) and cfg.bos_token_id == 4
    q2 = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False})
    assert q2.qkv_bias and not q2.o_bias and not q2.qk_norm
    q3 = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen3"})
    assert q3.qk_norm and q3.head_dim == 128          # Qwen3Config's default head_dim
    assert ModelConfig.from_hf_dict(q3.to_hf_dict()) == q3


@pytest.mark.parametrize("extra, key", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ({"rope_scaling": {"type": "su", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "linear"}}, "factor"),
    ({"rope_parameters": {"rope_type": "default", "mrope_section": [2, 2]}}, "rope_parameters.mrope_section"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"model_type": "qwen2", "mlp_bias": True}, "mlp_bias"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ({"model_type": "gemma"}, "model_type"),
])
def test_math_changing_keys_are_refused_by_name(extra, key):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_hf_dict({**BASE, **extra})
    assert key in str(err.value) and "\n" not in str(err.value)
