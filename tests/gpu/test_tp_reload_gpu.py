"""Twenty reloads under traffic with a tensor-parallel target on GPUs: tokens exact, memory flat per GPU.

Run on an ``nvidia-h200-x4`` host: ``python3 -m pytest -m gpu tests/gpu/test_tp_reload_gpu.py -s``
(``bench/gpu_tp4.sh OUT tests``). The run of ``tests/integration/test_tp_reload.py`` (CPU-tested there
at TP=2 and 3) on CUDA: the target's ranks on cuda:0..tp-1, the draft alone on cuda:tp, 20
RECAPTURE / IN_PLACE reloads under every in-flight policy while two clients generate; every
streamed token equal to its version's single-GPU target-only output.

Memory: after each reload, the memory in use on every GPU (``torch.cuda.mem_get_info``: every
process on it, the caching allocators' reserve included). From the third reload on (caches warm)
each GPU's figure must stay within ``SLACK`` of its range: a leaked graph pool, KV cache or cuBLAS
workspace (32 MiB per thread) would grow it cycle after cycle. The byte model's weights are too
small to show there; ``test_reload_gpu.py`` checks weights on one GPU to the MiB.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 3,
                                 reason="needs three CUDA GPUs or more (TP=2 and the draft on its own)")]

from tests.integration.reload_harness import models  # noqa: E402,F401 (fixture)
from tests.integration.test_tp_reload import TorchReference, check_tp_reloads, run_tp_reloads  # noqa: E402

CYCLES = 20
WARM = 2                     # reloads before the caches are warm
SLACK = 64 << 20
MIB = 1 << 20


@pytest.mark.parametrize("tp", [2, 3])
def test_20_reloads_under_traffic_on_gpus_tokens_exact_memory_flat(models, tp):
    if torch.cuda.device_count() < tp + 1:
        pytest.skip(f"TP={tp} with the draft on its own GPU needs {tp + 1} CUDA GPUs")
    gpus = list(range(tp + 1))
    used: dict[int, list[int]] = {g: [] for g in gpus}

    def after_reload(i: int) -> None:
        for g in gpus:
            free, total = torch.cuda.mem_get_info(g)
            used[g].append(total - free)

    run = run_tp_reloads(models, tp, CYCLES, device="cuda:0", draft_device=f"cuda:{tp}", after_reload=after_reload)
    check_tp_reloads(run, models, TorchReference("cuda:0"), CYCLES)
    print(f"\n[gpu] TP={tp}, {CYCLES} reloads under traffic, {len(run['results'])} requests; MiB in use after "
          f"each reload (GPU {tp} = the draft):")
    for g in gpus:
        print(f"[gpu]   GPU {g}: " + " ".join(f"{u / MIB:.0f}" for u in used[g]))
    for g in gpus:
        steady = used[g][WARM:]
        assert max(steady) - min(steady) <= SLACK, (g, [round(u / MIB) for u in used[g]])
