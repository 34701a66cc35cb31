#!/usr/bin/env bash
# Session 24 on one GPU (issue 10): where the host's time goes in a batch-1 round (issue 10's <= 50 us of host work
# per step; ~0.25 ms before the wait on an H100 in session 23), and the fair adaptive-k figure.
#
#   bash bench/gpu_session24.sh OUT_DIR host   # the target's round host at batch 1: target-only with the scheduler
#                                              # thread's cProfile, then a Torch profiler pass (kernels, and the CUDA
#                                              # runtime calls and this thread's ops by own time), then k=3 with a
#                                              # draft service and cProfile; then bench propose-host
#   bash bench/gpu_session24.sh OUT_DIR check  # the gpu tests of the round loop, the stack, decode ahead, reload,
#                                              # propose and the fast path on this code; then bench peer at batch 1
#   bash bench/gpu_session24.sh OUT_DIR fix    # after the strided RoPE rows fix: the propose and kernel gpu tests,
#                                              # then bench services at batch 8 and 1 (acceptance, speed-up)
#   bash bench/gpu_session24.sh OUT_DIR rest   # the one-GPU test files the other modes leave out, then ahead drafting
#                                              # against fixed k at batch 1 (bench services --variants fixed ahead)
#   bash bench/gpu_session24.sh OUT_DIR ring   # bench propose-host: the fused propose and the whole verify with the
#                                              # engines' reused read-back buffers and without ("(no fetch ring)");
#                                              # then the round host at batch 1 target-only (its host-bound round)
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md); carry [".whl"].
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-host}"
gpu_prologue
if [ "$mode" = host ]; then
  probe b1_target_only_cprofile 100 1 128 --outbox --random-prompt --profile 45
  probe b1_target_only_torch 100 1 128 --outbox --random-prompt --torch-profile 30
  probe b1_k3_cprofile 120 1 128 --outbox --draft cuda:0 --k 3 --profile 45
  [ "$(left)" -gt 60 ] && timeout "$(left)" python3 -m specsplit bench propose-host --backend torch --device cuda:0 \
    2>&1 | quiet | tee "$out/propose_host.txt" | tail -40
elif [ "$mode" = check ]; then
  timeout 420 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_loop_gpu.py tests/gpu/test_stack_gpu.py \
    tests/gpu/test_decode_ahead_gpu.py tests/gpu/test_reload_gpu.py tests/gpu/test_propose_gpu.py \
    tests/gpu/test_fastpath_gpu.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|error|Error|assert" | tail -16
  [ "$(left)" -gt 150 ] && timeout "$(left)" python3 -m specsplit bench peer --device cuda:0 --batch 1 --prompts 8 \
    --max-tokens 128 2>&1 | quiet | tee "$out/bench_peer.txt" | tail -14
elif [ "$mode" = fix ]; then
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_propose_gpu.py \
    tests/gpu/test_kernels_gpu.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|error|Error|assert|\[gpu\] fused" \
    | tail -16
  svc services "$(left)" --device cuda:0 --batch 8 1
elif [ "$mode" = rest ]; then
  timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_graphs_gpu.py tests/gpu/test_invariant_gpu.py \
    tests/gpu/test_prefill_gpu.py tests/gpu/test_fill_gpu.py 2>&1 | tee "$out/gpu_tests.log" \
    | grep -E "passed|failed|error|Error|assert" | tail -8
  svc ahead "$(left 330)" --device cuda:0 --batch 1 --prompts 8 --variants fixed ahead
elif [ "$mode" = ring ]; then
  timeout 240 python3 -m specsplit bench propose-host --backend torch --device cuda:0 2>&1 | quiet \
    | tee "$out/propose_host.txt" | grep -E "what|propose k=3 fused|verify k=3"
  probe b1_target_only "$(left 330)" 1 128 --outbox --random-prompt
else
  echo "unknown mode $mode"; exit 2
fi
