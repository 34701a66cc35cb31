"""The fused decoder-layer kernels (``runtime/backends/torch_kernels.py``) on CPU.

CI has no GPU, so the same Triton kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``, read when the kernels are defined: hence a subprocess,
``kernels_interpret.py``): each kernel against the plain ops it replaces, and a fused
propose's drafts equal to the per-substep path's at batch 3 (strided substep inputs); the
bundled model's greedy tokens on the kernels: ``test_fused_kernels_engine.py``.
``tests/gpu/test_kernels_gpu.py`` runs them compiled.
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


def interpreted(*args: str) -> dict:
    """``kernels_interpret.py`` with these arguments in Triton's interpreter: its JSON object."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "tests.unit.kernels_interpret", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kernels_equal_the_plain_ops():
    result = interpreted("kernels")
    for name, err in result["errors"].items():
        assert err < 1e-5, (name, err)
    assert result["fused_propose"] == {"identical": True, "fused_proposes": 2}, result["fused_propose"]


def test_kernels_are_off_on_cpu_and_when_switched_off():
    assert TorchOps("cpu", "float32", fused_kernels=True).kernels is None
    assert RuntimeConfig().fused_kernels is True
    assert RuntimeConfig(fused_kernels=False).fused_kernels is False


def test_batch_invariance_is_refused_where_its_kernels_are_not():
    from core.config import ConfigError

    assert RuntimeConfig().batch_invariant is False
    RuntimeConfig(backend="torch", device="cuda:0", batch_invariant=True)
    for bad in ({"backend": "paddle", "device": "cuda:0"}, {"backend": "torch", "device": "cpu"},
                {"backend": "torch", "device": "cuda:0", "fused_kernels": False},
                {"backend": "torch", "device": "cuda:0", "compile": True}):
        with pytest.raises(ConfigError, match="runtime.batch_invariant"):
            RuntimeConfig(batch_invariant=True, **bad)
    with pytest.raises(ConfigError, match="runtime.batch_invariant"):
        TorchOps("cpu", "float32", fused_kernels=True, batch_invariant=True)
    ops = TorchOps("cpu", "float32")
    assert ops.batch_invariant is False
    with ops.invariant_steps():                     # off: nothing changes
        assert ops.kernels is None


def test_attention_compiles_few_variants_for_every_eager_span_and_width():
    """Eager steps see a new span (64-row aligned) and width almost every time; the
    kernel's compile-time values must stay few, or each step would wait on Triton's compiler
    (seen on the GPU: adaptive k's eager catch-ups at 50 tok/s instead of ~1,500)."""
    from runtime.backends.torch_attention import MAX_QUERY_ROWS, attention_plan

    variants = set()
    for batch in (1, 2, 4, 8, 16, 32):
        for span in range(64, 4096 + 1, 64):
            for tokens in range(1, MAX_QUERY_ROWS // 4 + 1):
                m, per_split, nsplit = attention_plan(batch, 4, 4, tokens, span)
                assert nsplit * per_split >= span and (nsplit - 1) * per_split < span
                variants.add((m, per_split, nsplit == 1, 1 << max(0, (nsplit - 1).bit_length())))
    assert len(variants) <= 80, len(variants)     # (one per span and width would be ~25,000)


def test_attention_splits_hold_at_least_the_minimum_keys():
    from runtime.backends.torch_attention import attention_plan

    for least in (64, 128, 256, 512, 1024):
        for span in range(64, 4096 + 1, 64):
            _, per_split, nsplit = attention_plan(1, 4, 4, 4, span, least)
            assert per_split >= least and nsplit * per_split >= span and (nsplit - 1) * per_split < span
            assert (nsplit == 1) == (span <= per_split)
            if span <= least:
                assert nsplit == 1
    assert attention_plan(1, 4, 4, 4, 384) == attention_plan(1, 4, 4, 4, 384, 64)


def test_plain_ops_switch_is_per_thread_and_restored():
    import threading

    from runtime.backends.torch_kernels import Kernels

    ops = TorchOps("cpu", "float32")
    ops.kernels = marker = Kernels()
    seen = []
    with ops.plain_ops():
        assert ops.kernels is None
        t = threading.Thread(target=lambda: seen.append(ops.kernels))
        t.start()
        t.join(timeout=10)
        with marker.invariant_steps():              # a batch-invariant step keeps its kernels
            assert ops.kernels is marker
            t = threading.Thread(target=lambda: seen.append(ops.kernels))
            t.start()
            t.join(timeout=10)
        assert ops.kernels is None
    assert seen == [marker, marker] and ops.kernels is marker and not marker.invariant


def test_steps_outside_graphs_run_the_plain_ops():
    """Eager registry steps, the draft's wide catch-ups and prefills never reach the fused
    kernels (each new shape there would wait on Triton's compiler on a GPU)."""
    from tests.unit.test_engine_bundled import _engine, _prompts, _run

    engine = _engine("torch")
    used = []

    class Spy:
        invariant = False                     # runtime.batch_invariant off

        def fits_argmax(self, x, axis):
            # the greedy argmax between replays may take the kernel (its compile-time values
            # depend on the vocabulary only); here torch's answers instead
            return False

        def __getattr__(self, name):
            used.append(name)
            raise AssertionError(f"fused kernel {name} used outside a captured graph")

    engine.ops.kernels = Spy()
    out, _ = _run(engine, [p[:40] for p in _prompts(2)], 3, 2, 8)
    assert used == [] and all(len(x) == 8 for x in out)

