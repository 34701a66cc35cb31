"""convert-mtp: a DeepSeek-V3-layout MTP layer becomes specsplit's mtp.safetensors."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.checkpoint import CheckpointError, index_checkpoint, load_tensors, save_safetensors, save_target
from runtime.config import ModelConfig
from runtime.convert_mtp import convert
from runtime.model import MTP_LAYER_PREFIX, init_params, mtp_tensor_shapes, target_tensor_shapes
from specsplit import cli

CFG = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, model_type="qwen2")


def _deepseek_layout(target, mtp, n=2):
    """Our MTP tensors written as DeepSeek-V3 does: layer N after the target's layers, eh_proj
    fed [enorm(e); hnorm(h)], plus its copies of the shared embedding / norm / head."""
    d = CFG.hidden_size
    p = f"model.layers.{n}."
    out = {p + "enorm.weight": mtp["mtp.enorm.weight"], p + "hnorm.weight": mtp["mtp.hnorm.weight"],
           p + "eh_proj.weight": np.concatenate([mtp["mtp.eh_proj.weight"][:, d:], mtp["mtp.eh_proj.weight"][:, :d]], 1),
           p + "shared_head.norm.weight": target["model.norm.weight"], p + "shared_head.head.weight":
           target["lm_head.weight"], p + "embed_tokens.weight": target["model.embed_tokens.weight"]}
    out.update({p + k[len(MTP_LAYER_PREFIX):]: v for k, v in mtp.items() if k.startswith(MTP_LAYER_PREFIX)})
    return out


@pytest.fixture
def setup(tmp_path):
    target = init_params(CFG, 0, target_tensor_shapes(CFG))
    target["model.norm.weight"] = np.linspace(0.5, 1.5, CFG.hidden_size, dtype=np.float32)
    mtp = init_params(CFG, 1, mtp_tensor_shapes(CFG))
    save_target(tmp_path / "target", CFG, target)
    return tmp_path, target, mtp


def test_converted_head_equals_the_original(setup):
    tmp, target, mtp = setup
    save_safetensors(tmp / "ds.safetensors", _deepseek_layout(target, mtp))
    assert cli.main(["convert-mtp", str(tmp / "ds.safetensors"), "--target", str(tmp / "target")]) == 0
    got = load_tensors(index_checkpoint(tmp / "target" / "mtp.safetensors"))
    assert set(got) == set(mtp)
    for name in mtp:
        np.testing.assert_array_equal(got[name], mtp[name], err_msg=name)


def test_a_differing_shared_head_norm_is_refused(setup):
    tmp, target, mtp = setup
    ds = _deepseek_layout(target, mtp)
    ds["model.layers.2.shared_head.norm.weight"] = ds["model.layers.2.shared_head.norm.weight"] * 2
    save_safetensors(tmp / "ds.safetensors", ds)
    with pytest.raises(CheckpointError, match="shared_head.norm.weight differs"):
        convert(tmp / "ds.safetensors", tmp / "target", tmp / "out.safetensors")


def test_an_unknown_block_tensor_or_missing_layer_is_refused(setup, capsys):
    tmp, target, mtp = setup
    ds = _deepseek_layout(target, mtp)
    ds["model.layers.2.mlp.gate.weight"] = np.zeros((4, CFG.hidden_size), np.float32)        # an MoE router
    save_safetensors(tmp / "ds.safetensors", ds)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'mtp.layer.mlp.gate.weight'"):
        convert(tmp / "ds.safetensors", tmp / "target", tmp / "out.safetensors")
    save_safetensors(tmp / "none.safetensors", {"x": np.zeros(2, np.float32)})
    assert cli.main(["convert-mtp", str(tmp / "none.safetensors"), "--target", str(tmp / "target")]) == 1
    assert "eh_proj" in capsys.readouterr().err
