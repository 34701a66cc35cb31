"""Config tree: invalid values raise errors naming the field and the allowed range."""

import json

import pytest

from runtime.config import (CacheConfig, ConfigError, GraphConfig, ModelConfig, OrchestratorConfig, RuntimeConfig,
                            SamplingParams, SecurityConfig, SpecConfig)

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
