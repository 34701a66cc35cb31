#!/usr/bin/env bash
# Session 25 on one GPU (issue 10): where a batch-8 speculative round's time goes on both sides. On an H200 (session
# 24) a batch-8 k=3 round took 2.81 ms (draft 1.11 / target 1.06 / overhead 0.64) against a 0.90 ms target-only
# round: issue 10's batch-8 x1.8 needs about 1.6 ms. The draft's 1.11 ms was never profiled inside its process.
#
#   bash bench/gpu_session25.sh OUT_DIR b8     # tests/gpu/test_fetch_ring_gpu.py (the read-back ring with copies in
#                                              # flight; an engine with and without its rings), then
#                                              # the round host at batch 8, k=3, a draft service on the same GPU:
#                                              # the target scheduler thread's cProfile and the draft process's
#                                              # cProfile of its round messages (scripts/draft_profile); then the
#                                              # same without profilers, and bench propose-host (the host work of
#                                              # both engines' calls, with and without the reused read-back buffers)
#
# The modes of bench/gpu_session24.sh (ring, check, fix, rest) still hold for this code.
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md); carry [".whl"].
source "$(dirname "$0")/gpu_env.sh" "$@"
HEAD=${HEAD:-90}
mode="${2:-b8}"
gpu_prologue
if [ "$mode" = b8 ]; then
  timeout 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_fetch_ring_gpu.py 2>&1 \
    | tee "$out/gpu_tests.log" | grep -E "passed|failed|error|Error|assert|\[gpu\]" | tail -8
  probe b8_k3_profiles 150 8 128 --outbox --draft cuda:0 --k 3 --profile 35 --draft-profile 35
  probe b8_k3 100 8 128 --outbox --draft cuda:0 --k 3
  probe b8_target_only 80 8 128 --outbox --random-prompt
  [ "$(left)" -gt 60 ] && timeout "$(left)" python3 -m specsplit bench propose-host --backend torch --device cuda:0 \
    2>&1 | quiet | tee "$out/propose_host.txt" | tail -40
else
  echo "unknown mode $mode"; exit 2
fi
