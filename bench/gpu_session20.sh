#!/usr/bin/env bash
# Session 20's work on the GPU host, and issue 10's two-GPU list, one device call per mode
# (session 20 ran only `b8`, on an H100, cut at 157 s: docs/gpu.md):
#
#   bash bench/gpu_session20.sh OUT_DIR one        # nvidia-h200: the kernel and invariance GPU tests (the attention
#                                                  # kernels now in torch_attention.py, compiled), the propose and
#                                                  # round-loop GPU tests (a round's hidden rows in one tensor), bench
#                                                  # services at batch 8 (float32; bfloat16 batch-invariant) and 1
#   bash bench/gpu_session20.sh OUT_DIR short      # what ~6 minutes allow of `one`: the kernel and invariance GPU
#                                                  # tests, bench services at batch 8 in float32 (identity included)
#                                                  # and, if time is left, bfloat16 batch-invariant
#   bash bench/gpu_session20.sh OUT_DIR b8         # bench services at batch 8 in float32, then the kernel GPU tests as time allows
#   bash bench/gpu_session20.sh OUT_DIR x2-tests   # nvidia-h200-x2: every `-m gpu` test (the two-GPU ones: the loop
#                                                  # variants, micro-batches, ahead drafting, the stack and TP=2)
#   bash bench/gpu_session20.sh OUT_DIR x2-peer    # nvidia-h200-x2: bench peer at batch 1 and 8, draft cuda:1,
#                                                  # target cuda:0 (both models: issue 10's first two goals)
#   bash bench/gpu_session20.sh OUT_DIR x2-loop    # nvidia-h200-x2: bench services, every round-loop variant at
#                                                  # batch 1 and 8 (draft cuda:0, target cuda:1), bench adaptive
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md); carry [".whl"].
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-one}"
gpu_prologue
gpus=$(nvidia-smi -L | wc -l)
case "$mode" in
one|short|b8) ;;
x2-tests|x2-peer|x2-loop) [ "$gpus" -ge 2 ] || { echo "mode $mode needs two GPUs, this host has $gpus"; exit 2; } ;;
*) echo "unknown mode $mode"; exit 2 ;;
esac
tests() {  # the GPU tests given, a short summary
  timeout "$1" python3 -m pytest -q -s -p no:cacheprovider -m gpu "${@:2}" 2>&1 | tee "$out/gpu_tests.log" \
    | grep -E "passed|failed|error|Error|assert|\[gpu" | tail -24
}
if [ "$mode" = one ]; then
  tests 300 tests/gpu/test_kernels_gpu.py tests/gpu/test_invariant_gpu.py tests/gpu/test_propose_gpu.py \
    tests/gpu/test_loop_gpu.py
  svc services_b8 120 --device cuda:0 --batch 8
  svc services_b8_bf16_inv 120 --device cuda:0 --batch 8 --dtype bfloat16 --batch-invariant
  svc services_b1 "$(left 575)" --device cuda:0 --batch 1
elif [ "$mode" = short ]; then
  tests 170 tests/gpu/test_kernels_gpu.py tests/gpu/test_invariant_gpu.py
  svc services_b8 "$(left 300)" --device cuda:0 --batch 8
  [ "$(left 370)" -gt 60 ] && svc services_b8_bf16_inv "$(left 370)" --device cuda:0 --batch 8 --dtype bfloat16 \
    --batch-invariant
elif [ "$mode" = b8 ]; then
  svc services_b8 "$(left 200)" --device cuda:0 --batch 8
  [ "$(left 290)" -gt 60 ] && tests "$(left 290)" tests/gpu/test_invariant_gpu.py tests/gpu/test_kernels_gpu.py
elif [ "$mode" = x2-tests ]; then
  tests 560 tests/gpu
elif [ "$mode" = x2-peer ]; then
  timeout 300 python3 -m specsplit bench peer --device cuda:0 --batch 1 --prompts 8 --max-tokens 128 2>&1 | quiet \
    | tee "$out/bench_peer_b1.txt" | tail -8
  timeout "$(left 575)" python3 -m specsplit bench peer --device cuda:0 --batch 8 --prompts 8 --max-tokens 128 2>&1 \
    | quiet | tee "$out/bench_peer_b8.txt" | tail -8
else
  svc services_loop 300 --device cuda:1 --draft-device cuda:0 --batch 1 8 \
    --variants fixed ahead adaptive micro micro+adaptive
  timeout "$(left 575)" python3 -m specsplit bench adaptive --backend torch --device cuda:1 --draft-device cuda:0 \
    --prompts 8 --max-tokens 128 --repeats 3 2>&1 | quiet | tee "$out/adaptive.txt" | tail -12
fi
