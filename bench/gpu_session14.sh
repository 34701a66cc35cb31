#!/usr/bin/env bash
# Session 14 on the GPU host (one H200), one device call per mode:
#
#   bash bench/gpu_session14.sh OUT_DIR first   # the split-K GEMM taking SwiGLU (down) and RoPE + the KV
#                                               # write (q/k/v) from the kernels around it: the kernel GPU
#                                               # tests, bench graphs with the fusions on and off, bench gemm-pdl
#                                               # (do dependent launches let a GEMM read its weight early?), the
#                                               # propose and round-loop GPU tests, bench peer with what is left
#   bash bench/gpu_session14.sh OUT_DIR final   # the fusions and the o projection's preload off by default:
#                                               # the kernel GPU tests, bench graphs with each of them side
#                                               # by side, bench peer (bundled and ~1B, batch 1)
#   bash bench/gpu_session14.sh OUT_DIR verify  # not run yet: the final commit's defaults (RoPE in the q/k/v
#                                               # GEMM, the o projection reading ahead) through the kernel,
#                                               # propose and round-loop GPU tests, bench graphs, bench peer
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md).
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-first}"
gpu_prologue
case "$mode" in
first)
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_kernels_gpu.py \
    2>&1 | tee "$out/kernel_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert" | tail -20
  timeout 150 python3 -m specsplit bench graphs --device cuda:0 2>&1 | quiet | tee "$out/bench_graphs.txt" | tail -16
  timeout 60 python3 -m specsplit bench gemm-pdl --device cuda:0 2>&1 | tee "$out/gemm_pdl.txt" | tail -6
  timeout 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_propose_gpu.py tests/gpu/test_loop_gpu.py \
    2>&1 | tee "$out/gpu_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert" | tail -20
  timeout "$(left 590)" python3 -m specsplit bench peer --device cuda:0 --batch 1 --prompts 8 --max-tokens 128 \
    2>&1 | quiet | tee "$out/bench_peer.txt" | tail -8
  ;;
final)
  timeout 120 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_kernels_gpu.py \
    2>&1 | tee "$out/kernel_tests.log" | grep -E "passed|failed|error|Error|assert" | tail -8
  timeout 150 python3 -m specsplit bench graphs --device cuda:0 2>&1 | quiet | tee "$out/bench_graphs.txt" | tail -15
  timeout "$(left 400)" python3 -m specsplit bench peer --device cuda:0 --batch 1 --prompts 8 --max-tokens 128 \
    2>&1 | quiet | tee "$out/bench_peer.txt" | tail -3
  ;;
verify)
  timeout 240 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_kernels_gpu.py \
    tests/gpu/test_propose_gpu.py tests/gpu/test_loop_gpu.py 2>&1 | tee "$out/gpu_tests.log" \
    | grep -E "passed|failed|error|Error|assert" | tail -10
  timeout 120 python3 -m specsplit bench graphs --device cuda:0 2>&1 | quiet | tee "$out/bench_graphs.txt" | tail -3
  timeout "$(left 590)" python3 -m specsplit bench peer --device cuda:0 --batch 1 --prompts 8 --max-tokens 128 \
    2>&1 | quiet | tee "$out/bench_peer.txt" | tail -3
  ;;
*) echo "unknown mode $mode"; exit 2 ;;
esac
