"""Checkpoint bytes streamed into device tensors through pinned chunks (``Ops.fill_from_files``).

What an IN_PLACE reload on CUDA uses: bf16 tensors of a bf16 worker go from the
file into a pinned chunk and on to the device while the next chunk is read.
Checked: exact bits, addresses kept, tensors larger than one chunk, a fused view
(rows of a bigger buffer), and the items it cannot take left to the caller.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from runtime.backends.torch_host import FILL_CHUNK  # noqa: E402
from runtime.backends.torch_ops import TorchOps  # noqa: E402
from runtime.checkpoint import index_checkpoint, load_tensors, save_safetensors  # noqa: E402
from runtime.config import ModelConfig  # noqa: E402
from runtime.weights import CheckedCheckpoint, CheckpointArrays, copy_in_place  # noqa: E402


def test_fill_from_files_streams_exact_bits_in_place(tmp_path):
    rng = np.random.default_rng(0)
    big = rng.standard_normal((FILL_CHUNK // 2 // 1024 * 3 + 7, 1024), dtype=np.float32)   # ~1.5 chunks of bf16
    small = rng.standard_normal((5, 1024), dtype=np.float32)
    f32 = rng.standard_normal((3, 4), dtype=np.float32)
    save_safetensors(tmp_path / "w.safetensors", {"big": big, "small": small}, "bfloat16")
    save_safetensors(tmp_path / "f.safetensors", {"f32": f32}, "float32")
    infos = {**index_checkpoint(tmp_path / "w.safetensors"), **index_checkpoint(tmp_path / "f.safetensors")}
    ops = TorchOps("cuda:0", "bfloat16")
    fused = torch.zeros((big.shape[0] + small.shape[0], 1024), dtype=torch.bfloat16, device="cuda:0")
    params = {"big": fused[: big.shape[0]], "small": fused[big.shape[0]:],
              "f32": torch.zeros((3, 4), dtype=torch.bfloat16, device="cuda:0")}
    ptrs = {n: t.data_ptr() for n, t in params.items()}
    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1)
    arrays = CheckpointArrays(CheckedCheckpoint(cfg, infos, ("big", "small", "f32")))
    items = [(params[n], str(infos[n].file), infos[n].start, infos[n].end, infos[n].dtype) for n in params]
    assert ops.fill_from_files(items[2:]) == [False]          # F32 file into a bf16 tensor: the caller's
    copy_in_place(ops, params, arrays)
    want = load_tensors(infos, ["big", "small"], bf16_bits=True)
    for name in ("big", "small"):
        got = params[name].cpu().view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(got, want[name]), name
    np.testing.assert_allclose(params["f32"].float().cpu().numpy(), f32, rtol=1e-2)
    assert {n: t.data_ptr() for n, t in params.items()} == ptrs
