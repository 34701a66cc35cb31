#!/usr/bin/env bash
# Session 17 on the GPU host (one H200), one device call per mode:
#
#   bash bench/gpu_session17.sh OUT_DIR kernels  # three launches fewer to measure: the attention's splits combined
#                                                # by the last split (no combine launch), gate/up on the split-K GEMM
#                                                # with SiLU·mul as its epilogue, Triton's RMSNorm for the norms
#                                                # outside the fused layers: the kernel GPU tests, bench graphs (each
#                                                # change off in its own column), bench profile, bench peer at batch 1
#   bash bench/gpu_session17.sh OUT_DIR final    # the final defaults (gate/up + SiLU·mul, Triton RMSNorm; the fold and
#                                                # the norm in the loads removed): the kernel, propose and round-loop GPU tests,
#                                                # bench graphs, bench peer at batch 1
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md).
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-kernels}"
gpu_prologue
case "$mode" in
kernels) tests=(tests/gpu/test_kernels_gpu.py) ;;
final) tests=(tests/gpu/test_kernels_gpu.py tests/gpu/test_propose_gpu.py tests/gpu/test_loop_gpu.py) ;;
*) echo "unknown mode $mode"; exit 2 ;;
esac
timeout 240 python3 -m pytest -q -s -p no:cacheprovider -m gpu "${tests[@]}" 2>&1 | tee "$out/gpu_tests.log" \
  | grep -E "passed|failed|error|Error|assert|\[gpu" | tail -16
timeout 180 python3 -m specsplit bench graphs --device cuda:0 2>&1 | quiet | tee "$out/bench_graphs.txt" | tail -3
if [ "$mode" = kernels ]; then
  timeout 90 python3 -m specsplit bench profile --device cuda:0 2>&1 | quiet | tee "$out/bench_profile.txt" | tail -2
fi
timeout "$(left 540)" python3 -m specsplit bench peer --device cuda:0 --batch 1 --prompts 8 --max-tokens 128 \
  2>&1 | quiet | tee "$out/bench_peer.txt" | tail -3
