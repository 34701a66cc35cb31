#!/usr/bin/env bash
# Session 11 on the GPU host (one H200: draft and target share cuda:0), one device call per mode:
#
#   bash bench/gpu_session11.sh OUT_DIR first   # session 10's code after its device time, and what the overlap
#                                               # variants give now: bench services at batch 8 and 1 with the
#                                               # round-loop variants fixed / ahead / micro side by side, the round
#                                               # loop's GPU tests, bench gemm (the ~1B projections' cuBLAS layouts)
#   bash bench/gpu_session11.sh OUT_DIR kernels # the ~1B verify step: the fused attention's split sweep (bench
#                                               # attention), bench graphs plain and with runtime.compile, one
#                                               # profiled round (bench profile), and the bundled model's rounds at
#                                               # batch 1 and 8 profiled in process (bench profile --small)
#   bash bench/gpu_session11.sh OUT_DIR final   # this session's code: the bundled model's float32 projections
#                                               # (bench gemm --small), its rounds in process (bench profile
#                                               # --small; the call ran it with and without an operand swap since
#                                               # dropped), bench services at batch 8
#                                               # and 1, the loop tests, 20 RECAPTURE reloads
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md).
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-first}"
gpu_prologue
case "$mode" in
first)
  timeout 260 python3 -m specsplit bench services --backend torch --device cuda:0 --batch 8 1 --prompts 16 \
    --max-tokens 128 --variants fixed ahead micro 2>&1 | quiet | tee "$out/services_variants.txt" | tail -14
  timeout 140 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_loop_gpu.py 2>&1 \
    | tee "$out/loop_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert" | tail -16
  timeout "$(left)" python3 -m specsplit bench gemm --device cuda:0 2>&1 | quiet | tee "$out/gemm.txt" | tail -30
  ;;
kernels)
  timeout 150 python3 -m specsplit bench attention --device cuda:0 2>&1 | quiet | tee "$out/attention.txt" | tail -40
  timeout 100 python3 -m specsplit bench profile --small --batch 1 8 --device cuda:0 2>&1 | quiet \
    | tee "$out/profile_small.txt" | tail -80
  timeout 120 python3 -m specsplit bench graphs --device cuda:0 2>&1 | quiet | tee "$out/graphs.txt" | tail -16
  timeout 90 python3 -m specsplit bench profile --device cuda:0 2>&1 | quiet | tee "$out/profile.txt" | tail -40
  timeout "$(left)" python3 -m specsplit bench graphs --device cuda:0 --compile 2>&1 | quiet \
    | tee "$out/graphs_compile.txt" | tail -16
  ;;
final)
  timeout 40 python3 -m specsplit bench gemm --small --device cuda:0 2>&1 | quiet | tee "$out/gemm_small.txt" | tail -27
  timeout 150 python3 -m specsplit bench profile --small --batch 1 8 --device cuda:0 2>&1 | quiet \
    | tee "$out/profile_small.txt" | grep -E "^batch"
  timeout 110 python3 -m specsplit bench services --backend torch --device cuda:0 --batch 8 1 --prompts 16 \
    --max-tokens 128 2>&1 | quiet | tee "$out/services.txt" | tail -6
  timeout 130 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_loop_gpu.py 2>&1 \
    | tee "$out/loop_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert" | tail -16
  SPECSPLIT_RELOAD_CYCLES=20 timeout "$(left 540)" python3 -m pytest -q -s -p no:cacheprovider -p bench.reload_probe \
    -m gpu tests/gpu/test_reload_gpu.py 2>&1 | tee "$out/reload_probe.log" | grep -E "RECAPTURE|passed|failed|probe" | tail -8
  ;;
*) echo "unknown mode $mode"; exit 2 ;;
esac
