#!/usr/bin/env bash
# Session 16 on the GPU host (one H200), one device call per mode:
#
#   bash bench/gpu_session16.sh OUT_DIR verify   # session 14's final defaults (RoPE in the q/k/v GEMM, the o
#                                                # projection reading ahead) through the kernel, propose and
#                                                # round-loop GPU tests, bench graphs, a profiled ~1B round
#                                                # (top kernels), bench peer at batch 1
#   bash bench/gpu_session16.sh OUT_DIR kernels  # (ran on commit cbc4477, whose q/k/v and down read-ahead were
#                                                # then removed) the q/k/v and down projections reading ahead as
#                                                # dependent launches, the split argmax, the collector paused in
#                                                # captures: the kernel, propose and round-loop GPU tests, bench
#                                                # graphs (each change off in its own column), bench profile, peer
#   bash bench/gpu_session16.sh OUT_DIR final    # the final defaults (split argmax on): the kernel, propose and
#                                                # round-loop GPU tests, bench graphs, bench peer at batch 1
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md).
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-verify}"
gpu_prologue
case "$mode" in
verify|kernels|final) ;;
*) echo "unknown mode $mode"; exit 2 ;;
esac
# Every mode runs the same checks; only 'final' leaves out the profile (its call had less device time left).
timeout 300 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_kernels_gpu.py \
  tests/gpu/test_propose_gpu.py tests/gpu/test_loop_gpu.py 2>&1 | tee "$out/gpu_tests.log" \
  | grep -E "passed|failed|error|Error|assert" | tail -10
timeout 120 python3 -m specsplit bench graphs --device cuda:0 2>&1 | quiet | tee "$out/bench_graphs.txt" | tail -3
if [ "$mode" != final ]; then
  timeout 90 python3 -m specsplit bench profile --device cuda:0 2>&1 | quiet | tee "$out/bench_profile.txt" | tail -2
fi
timeout "$(left 480)" python3 -m specsplit bench peer --device cuda:0 --batch 1 --prompts 8 --max-tokens 128 \
  2>&1 | quiet | tee "$out/bench_peer.txt" | tail -3
