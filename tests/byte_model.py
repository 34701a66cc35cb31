"""The small byte-vocabulary model the service tests share.

A random target whose logits are peaked (no near-ties, so greedy comparisons
are exact) and an MTP head whose projection passes the token embedding
straight through, so it guesses a bigram and gets partially accepted: both
acceptance and rejection paths run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from runtime.checkpoint import save_safetensors, save_target
from runtime.config import ModelConfig
from runtime.model import init_params, mtp_tensor_shapes, target_tensor_shapes


def write_byte_model(path: Path, seed: int = 0, max_len: int = 1024, ffn: int = 64,
                     vary_final_norm: bool = False) -> ModelConfig:
    """Write target (HF layout) + mtp.safetensors to ``path``; vocab 258 (bytes, BOS 256, EOS 257).

    ``vary_final_norm`` also randomises the final norm, so checkpoints of two
    seeds differ in every tensor the draft copies from the target.
    """
    cfg = ModelConfig(vocab_size=258, hidden_size=32, intermediate_size=ffn, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
                      bos_token_id=256, eos_token_id=257)
    rng = np.random.default_rng(seed + 1)
    t = init_params(cfg, seed, target_tensor_shapes(cfg))
    t["model.embed_tokens.weight"] = rng.standard_normal((258, 32)).astype(np.float32)
    t["lm_head.weight"] = rng.standard_normal((258, 32)).astype(np.float32)
    if vary_final_norm:
        t["model.norm.weight"] = (1.0 + 0.3 * rng.standard_normal(32)).astype(np.float32)
    for name in t:
        if name.startswith("model.layers.") and t[name].ndim == 2:
            t[name] = t[name] * 6
    m = init_params(cfg, seed + 2, mtp_tensor_shapes(cfg))
    eh = np.zeros((32, 64), np.float32)
    eh[:, 32:] = np.eye(32)                        # x = enorm(embed(t)): a bigram guess
    m["mtp.eh_proj.weight"] = eh
    path.mkdir(parents=True, exist_ok=True)
    save_target(path, cfg, t)
    save_safetensors(path / "mtp.safetensors", m)
    return cfg
