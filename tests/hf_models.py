"""Tiny random Hugging Face checkpoints written by transformers itself (test helper).

Every supported architecture and RoPE type, small enough to generate 48+
tokens in well under a second. Weights are drawn with spread-out scales
(embedding and head ~N(0, 1), projections ~N(0, 0.15)) so the greedy argmax
has a clear margin: fp32 comparisons stay exact without near-ties.

transformers is a test dependency only; the code under test never imports it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

from runtime.checkpoint import save_safetensors
from runtime.config import ModelConfig
from runtime.model import init_params, mtp_tensor_shapes

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)

# name -> (config class, extra config kwargs). Scaled RoPE types use a short
# original context (16) so the long-prompt cases run past it cheaply.
VARIANTS = {
    "llama": (transformers.LlamaConfig, {}),
    "llama_bias_headdim": (transformers.LlamaConfig, dict(attention_bias=True, mlp_bias=True, head_dim=24)),
    "llama_tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "llama_linear": (transformers.LlamaConfig, dict(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                     "rope_theta": 10000.0})),
    "llama_dynamic": (transformers.LlamaConfig, dict(max_position_embeddings=16, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})),
    "llama3": (transformers.LlamaConfig, dict(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 500000.0})),
    "llama_yarn": (transformers.LlamaConfig, dict(rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0})),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None, head_dim=8)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen2_yarn": (transformers.Qwen2Config, dict(rope_parameters={
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16, "rope_theta": 1000000.0,
        "beta_fast": 16.0, "beta_slow": 2.0})),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=24)),
}


def prompt_lengths(name: str) -> tuple[int, ...]:
    """Prompt lengths per variant. Scaled RoPE types add one past their original context
    (llama3 / yarn: original_max_position_embeddings=16; linear: 64 of 128). Dynamic NTK
    keeps prompts below max_position_embeddings=16 (longer prompts are refused, see
    runtime/rope.py; at exactly 16 transformers reuses frequencies grown by an earlier
    call) and its 48 new tokens run far past it."""
    if name == "llama_dynamic":
        return (3, 9, 15)
    long = {"llama3": 24, "llama_yarn": 24, "qwen2_yarn": 24, "llama_linear": 72}
    return (3, 9, 17) + ((long[name],) if name in long else ())


def build(name: str, path: Path, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """Random model of variant ``name``, saved with ``save_pretrained`` to ``path``
    (plus a random ``mtp.safetensors`` for speculative runs); returns it in eval mode, fp32."""
    cls, extra = VARIANTS[name]
    hf_cfg = cls(**{**BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "embed_tokens" in pname or "lm_head" in pname:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    model.eval()
    model.save_pretrained(path)
    cfg = ModelConfig.from_json_file(path / "config.json")
    mtp = init_params(cfg, seed + 7, mtp_tensor_shapes(cfg))
    save_safetensors(path / "mtp.safetensors", mtp)
    return model


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1] + rng.integers(3, VOCAB, size=n - 1).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], max_new: int) -> tuple[list[int], float]:
    """transformers' own greedy ``generate`` (EOS disabled) -> (new tokens, smallest top-2 logit gap)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=0,
                         do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=True,
                         return_dict_in_generate=True)
    gaps = [float(torch.topk(s[0], 2).values[0] - torch.topk(s[0], 2).values[1]) for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), min(gaps)


@torch.no_grad()
def hf_last_logits(model: transformers.PreTrainedModel, prompt: list[int]) -> np.ndarray:
    return model(torch.tensor([prompt])).logits[0, -1].float().numpy()
