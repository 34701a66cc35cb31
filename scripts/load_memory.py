"""Peak host RAM while loading a bf16 checkpoint into a bf16 worker (CPU), per backend.

Writes a random bf16 target of about ``--size-mb`` MB, then, in a fresh
process per backend, loads it the way a worker does (``check_target`` ->
``read_arrays(bf16_bits=True)`` -> ``to_device``) and reports the growth of
the peak resident set (VmHWM, reset just before the load via
/proc/self/clear_refs) against the checkpoint's file size. On a CPU device the
loaded tensors themselves live in host RAM, so 1.0x is the floor.

    PYTHONPATH=. .venv/bin/python scripts/load_memory.py --size-mb 256
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys
from pathlib import Path
from runtime.backends import make_ops
from runtime.config import RuntimeConfig
from runtime.weights import check_target, read_arrays, to_device

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

ops = make_ops(RuntimeConfig(backend=sys.argv[2], dtype="bfloat16"))
Path("/proc/self/clear_refs").write_text("5")          # reset VmHWM to the current RSS
before = status("VmRSS")
params = to_device(ops, read_arrays(check_target(sys.argv[1]), bf16_bits=True))
print(json.dumps({"peak_growth": status("VmHWM") - before, "rss_growth": status("VmRSS") - before,
                  "tensors": len(params)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--backends", nargs="*", default=["torch", "paddle"])
    args = ap.parse_args()
    import numpy as np

    from runtime.checkpoint import save_target
    from runtime.config import ModelConfig
    from runtime.model import target_tensor_shapes

    d_model = 1024
    per_layer = 2 * (4 * d_model * d_model + 3 * d_model * 2816)           # bf16 bytes of one layer
    layers = max(1, args.size_mb * 2**20 // per_layer)
    cfg = ModelConfig(vocab_size=8192, hidden_size=d_model, intermediate_size=2816, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=16, torch_dtype="bfloat16")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        save_target(tmp, cfg, {n: rng.standard_normal(s, dtype=np.float32) * 0.02
                               for n, s in target_tensor_shapes(cfg).items()}, dtype="bfloat16")
        size = (Path(tmp) / "model.safetensors").stat().st_size
        out = {"file_bytes": size}
        for backend in args.backends:
            res = subprocess.run([sys.executable, "-c", CHILD, tmp, backend], capture_output=True, text=True,
                                 check=True)
            m = json.loads(res.stdout.strip().splitlines()[-1])
            out[backend] = {"peak_growth_bytes": m["peak_growth"], "peak_over_file": round(m["peak_growth"] / size, 3)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
