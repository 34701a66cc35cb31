"""The fused decoder-layer kernels (``runtime/backends/torch_kernels.py``) on CPU.

CI has no GPU, so the same Triton kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``, read when the kernels are defined: hence a subprocess,
``kernels_interpret.py``): each kernel against the plain ops it replaces, and the
bundled model's greedy tokens with the kernels on equal to the plain ops' tokens,
target-only and speculative. ``tests/gpu/test_kernels_gpu.py`` runs them compiled.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.backends.torch_ops import TorchOps
from runtime.config import RuntimeConfig

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_kernels_equal_the_plain_ops_and_keep_greedy_tokens():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "tests.unit.kernels_interpret", "2", "6"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for name, err in result["errors"].items():
        assert err < 1e-5, (name, err)
    assert result["engine"]["identical"], result
    assert result["engine"]["target_only_equals_speculative"], result
    assert result["engine"]["tokens"] == 12


def test_kernels_are_off_on_cpu_and_when_switched_off():
    assert TorchOps("cpu", "float32", fused_kernels=True).kernels is None
    assert RuntimeConfig().fused_kernels is True
    assert RuntimeConfig(fused_kernels=False).fused_kernels is False
