"""The bundled model's greedy tokens on the fused decoder-layer kernels, in Triton's interpreter.

With the kernels on, the engine's tokens equal the plain ops' tokens, target-only and
speculative (``kernels_interpret.py engine``; its other half, each kernel against its plain
ops, is ``test_fused_kernels.py``: two files, so two test workers can run the halves side by side).
"""

import pytest

from tests.unit import test_fused_kernels as fused

pytest.importorskip("triton")


def test_kernels_keep_the_greedy_tokens():
    result = fused.interpreted("engine", "2", "6")["engine"]
    assert result["identical"], result
    assert result["target_only_equals_speculative"], result
    assert result["tokens"] == 12
    assert all(result["calls"].get(n, 0) > 0
               for n in ("add_rms_norm", "silu_mul", "rope_write_kv", "cache_attention", "linear", "qkv_rope",
                         "argmax", "swiglu", "rms_norm", "float_argmax")), \
        result      # rope_write_kv: the steps of more than torch_gemm.MAX_ROWS rows
