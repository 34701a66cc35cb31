"""Checkpoint I/O: exact round trips, HF layouts, and errors that name the problem."""

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from runtime.checkpoint import (CheckpointError, index_checkpoint, load_tensors, save_safetensors, save_target,
                                validate)
from runtime.config import ModelConfig
from runtime.model import init_params, mtp_tensor_shapes, target_tensor_shapes
from runtime.weights import check_draft, check_target, read_arrays

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)


def _model(tmp_path, shard_bytes=None, dtype="float32"):
    tensors = init_params(CFG, 0, target_tensor_shapes(CFG))
    save_target(tmp_path, CFG, tensors, dtype=dtype, shard_bytes=shard_bytes)
    save_safetensors(tmp_path / "mtp.safetensors", init_params(CFG, 1, mtp_tensor_shapes(CFG)))
    return tensors


@pytest.mark.parametrize("shard_bytes", [None, 20_000])
def test_save_load_round_trip_is_exact(tmp_path, shard_bytes):
    tensors = _model(tmp_path, shard_bytes)
    if shard_bytes:
        assert (tmp_path / "model.safetensors.index.json").exists()
    checked = check_target(tmp_path)
    loaded = read_arrays(checked)
    assert set(loaded) == set(tensors)
    for name in tensors:
        assert np.array_equal(loaded[name], tensors[name]), name
    draft = read_arrays(check_draft(checked, tmp_path / "mtp.safetensors"))
    assert np.array_equal(draft["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert np.array_equal(draft["lm_head.weight"], tensors["lm_head.weight"])


def test_half_precision_files(tmp_path):
    x = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    save_safetensors(tmp_path / "h.safetensors", {"x": x}, "float16")
    save_safetensors(tmp_path / "b.safetensors", {"x": x}, "bfloat16")
    h = load_tensors(index_checkpoint(tmp_path / "h.safetensors"))["x"]
    b = load_tensors(index_checkpoint(tmp_path / "b.safetensors"))["x"]
    assert np.array_equal(h, x.astype(np.float16).astype(np.float32))
    assert np.abs(b - x).max() <= np.abs(x).max() * 2 ** -8
    # bf16 values re-saved are exact (already representable)
    save_safetensors(tmp_path / "b2.safetensors", {"x": b}, "bfloat16")
    assert np.array_equal(load_tensors(index_checkpoint(tmp_path / "b2.safetensors"))["x"], b)


def test_interoperates_with_the_safetensors_library(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    save_file({"a": x}, str(tmp_path / "lib.safetensors"))
    assert np.array_equal(load_tensors(index_checkpoint(tmp_path / "lib.safetensors"))["a"], x)
    save_safetensors(tmp_path / "ours.safetensors", {"a": x})
    assert np.array_equal(load_file(str(tmp_path / "ours.safetensors"))["a"], x)


def test_missing_tensor_is_named(tmp_path):
    tensors = _model(tmp_path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_target(tmp_path, CFG, tensors)
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        check_target(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    tensors = _model(tmp_path)
    tensors["model.norm.weight"] = np.ones(31, dtype=np.float32)
    save_target(tmp_path, CFG, tensors)
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \[31\], expected \[32\]"):
        check_target(tmp_path)


def test_wrong_dtype_is_named(tmp_path):
    tensors = _model(tmp_path)
    tensors["model.norm.weight"] = np.ones(32, dtype=np.int64)
    save_file({k: v for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'model.norm.weight' has dtype I64"):
        check_target(tmp_path)


def test_mtp_file_checked_against_target_sizes(tmp_path):
    _model(tmp_path)
    bad = init_params(CFG, 1, mtp_tensor_shapes(CFG))
    bad["mtp.eh_proj.weight"] = np.zeros((32, 32), dtype=np.float32)
    save_safetensors(tmp_path / "bad_mtp.safetensors", bad)
    with pytest.raises(CheckpointError, match="mtp.eh_proj.weight"):
        check_draft(check_target(tmp_path), tmp_path / "bad_mtp.safetensors")


def test_truncated_and_corrupt_files(tmp_path):
    _model(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        check_target(tmp_path)
    path.write_bytes(struct.pack("<Q", 10) + b"{garbage!!")
    with pytest.raises(CheckpointError, match="corrupt"):
        check_target(tmp_path)
    path.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="not a safetensors"):
        check_target(tmp_path)
    path.unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        check_target(tmp_path)


def test_sharded_index_pointing_at_missing_tensor(tmp_path):
    _model(tmp_path, shard_bytes=20_000)
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.extra.weight"] = next(iter(idx["weight_map"].values()))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="absent from their shard"):
        check_target(tmp_path)


def test_validate_reports_unexpected_tensor_when_strict(tmp_path):
    save_safetensors(tmp_path / "x.safetensors", {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointError, match="unexpected tensor 'b'"):
        validate(index_checkpoint(tmp_path / "x.safetensors"), {"a": (2,)}, "x", allow_extra=False)


def test_bf16_bits_reach_a_torch_cpu_worker_exactly(tmp_path):
    """bf16 checkpoints load as raw bits into a bf16 Torch worker (no float32 detour), same values."""
    from runtime.backends.torch_ops import TorchOps
    from runtime.weights import copy_in_place

    x = np.random.default_rng(1).standard_normal((6, 3)).astype(np.float32)
    save_safetensors(tmp_path / "b.safetensors", {"x": x}, "bfloat16")
    infos = index_checkpoint(tmp_path / "b.safetensors")
    bits = load_tensors(infos, bf16_bits=True)["x"]
    widened = load_tensors(infos)["x"]
    assert bits.dtype == np.uint16
    ops = TorchOps("cpu", "bfloat16")
    on_device = ops.from_numpy(bits)
    assert ops.dtype_name(on_device) == "bfloat16" and np.array_equal(ops.to_numpy(on_device), widened)
    params = {"x": ops.zeros((6, 3))}
    ptr = ops.data_ptr(params["x"])
    copy_in_place(ops, params, {"x": bits})
    assert ops.data_ptr(params["x"]) == ptr and np.array_equal(ops.to_numpy(params["x"]), widened)


def test_extra_tensor_is_refused_by_name(tmp_path):
    """Regression (issue 11): a bias the config does not announce was dropped silently."""
    from runtime.weights import check_target
    tensors = init_params(CFG, 0, target_tensor_shapes(CFG))
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(CFG.hidden_size, np.float32)
    save_target(tmp_path, CFG, tensors)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        check_target(tmp_path)
    del tensors["model.layers.0.self_attn.q_proj.bias"]
    tensors["model.layers.1.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)   # derived: skipped
    save_target(tmp_path, CFG, tensors)
    assert "model.layers.1.self_attn.rotary_emb.inv_freq" not in check_target(tmp_path).infos


@pytest.mark.parametrize("backend, dtype", [("paddle", "bfloat16"), ("paddle", "float32"), ("torch", "bfloat16"),
                                            ("torch", "float32")])
def test_bf16_bits_reach_the_device_exactly(tmp_path, backend, dtype):
    """bf16 checkpoints travel as uint16 bits (no float32 host copy) on both backends; values exact,
    and an in-place copy of new bits lands exactly too."""
    from runtime.backends import make_ops
    from runtime.checkpoint import bf16_bits_to_float32
    from runtime.config import RuntimeConfig
    from runtime.weights import copy_in_place, to_device
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    save_safetensors(tmp_path / "w.safetensors", {"w": x, "v": -x}, "bfloat16")
    infos = index_checkpoint(tmp_path / "w.safetensors")
    bits = load_tensors(infos, bf16_bits=True)
    assert bits["w"].dtype == np.uint16 and bits["w"].flags.writeable
    want = bf16_bits_to_float32(bits["w"])
    assert np.max(np.abs(want - x)) < 1e-2
    ops = make_ops(RuntimeConfig(backend=backend, dtype=dtype))
    params = to_device(ops, {"w": bits["w"]})
    np.testing.assert_array_equal(ops.to_numpy(params["w"]), want)
    copy_in_place(ops, params, {"w": bits["v"]})
    np.testing.assert_array_equal(ops.to_numpy(params["w"]), -want)


@pytest.mark.parametrize("backend, dtype", [("paddle", "float32"), ("torch", "bfloat16"), ("torch", "float32")])
def test_in_place_from_checkpoint_arrays_reads_as_it_goes_and_refuses_before_touching(tmp_path, backend, dtype):
    """``CheckpointArrays``: an in-place copy read tensor by tensor (mixed file dtypes), exact, addresses
    kept; a shape that differs is refused before any tensor changes."""
    from runtime.backends import make_ops
    from runtime.checkpoint import bf16_bits_to_float32
    from runtime.config import RuntimeConfig
    from runtime.weights import CheckedCheckpoint, CheckpointArrays, copy_in_place, to_device
    rng = np.random.default_rng(3)
    new = {"a": rng.standard_normal((4, 6)).astype(np.float32), "b": rng.standard_normal(6).astype(np.float32)}
    save_safetensors(tmp_path / "a.safetensors", {"a": new["a"]}, "bfloat16")
    save_safetensors(tmp_path / "b.safetensors", {"b": new["b"]}, "float32")
    infos = {**index_checkpoint(tmp_path / "a.safetensors"), **index_checkpoint(tmp_path / "b.safetensors")}
    arrays = CheckpointArrays(CheckedCheckpoint(CFG, infos, ("a", "b")))
    assert set(arrays) == {"a", "b"} and arrays.shape_of("a") == (4, 6)
    ops = make_ops(RuntimeConfig(backend=backend, dtype=dtype))
    params = to_device(ops, {"a": np.zeros((4, 6), np.float32), "b": np.zeros(6, np.float32)})
    ptrs = {n: ops.data_ptr(t) for n, t in params.items()}
    copy_in_place(ops, params, arrays)
    want_a = bf16_bits_to_float32(load_tensors(infos, ["a"], bf16_bits=True)["a"])
    np.testing.assert_array_equal(ops.to_numpy(params["a"]), want_a)
    np.testing.assert_allclose(ops.to_numpy(params["b"]), new["b"], rtol=1e-2 if dtype == "bfloat16" else 0)
    assert {n: ops.data_ptr(t) for n, t in params.items()} == ptrs
    wide = to_device(ops, {"a": np.ones((4, 6), np.float32), "b": np.ones(7, np.float32)})
    with pytest.raises(CheckpointError, match="'b' has shape"):
        copy_in_place(ops, wide, arrays)
    np.testing.assert_array_equal(ops.to_numpy(wide["a"]), np.ones((4, 6), np.float32))   # untouched
