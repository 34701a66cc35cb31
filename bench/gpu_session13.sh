#!/usr/bin/env bash
# Session 13 on the GPU host (one H200), one device call per mode:
#
#   bash bench/gpu_session13.sh OUT_DIR first   # the propose and round-loop GPU tests on session 12's final
#                                               # code, then bench gemm --sweep: the split-K Triton GEMM
#                                               # (runtime/backends/torch_gemm.py) against F.linear for each
#                                               # ~1B projection, and a grid of its launch shapes
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md).
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-first}"
gpu_prologue
left() { echo $(( ${1:-585} - SECONDS )); }
case "$mode" in
first)
  timeout 170 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_propose_gpu.py tests/gpu/test_loop_gpu.py \
    2>&1 | tee "$out/gpu_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert" | tail -20
  timeout "$(left 585)" python3 -m specsplit bench gemm --device cuda:0 --sweep 2>&1 | tee "$out/gemm_sweep.txt"
  ;;
*) echo "unknown mode $mode"; exit 2 ;;
esac
