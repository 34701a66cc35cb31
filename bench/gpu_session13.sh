#!/usr/bin/env bash
# Session 13 on the GPU host (one H200), one device call per mode:
#
#   bash bench/gpu_session13.sh OUT_DIR first   # the split-K Triton GEMM (runtime/backends/torch_gemm.py):
#                                               # its kernel GPU tests, bench graphs (the ~1B steps with it and
#                                               # with cuBLAS side by side), then bench gemm --sweep (each ~1B
#                                               # projection against F.linear, and a grid of launch shapes)
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md).
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-first}"
gpu_prologue
case "$mode" in
first)
  timeout 120 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_kernels_gpu.py \
    2>&1 | tee "$out/kernel_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert" | tail -20
  timeout 200 python3 -m specsplit bench graphs --device cuda:0 2>&1 | quiet | tee "$out/bench_graphs.txt" | tail -16
  timeout "$(left 585)" python3 -m specsplit bench gemm --device cuda:0 --sweep --seconds 45 2>&1 | tee "$out/gemm_sweep.txt"
  ;;
*) echo "unknown mode $mode"; exit 2 ;;
esac
