#!/usr/bin/env bash
# Session 28 on one GPU (issue 10): greedy rounds queued ahead (runtime/round_ahead.py, graphs.round_ahead): with
# the draft in the target's process, a round's propose and verify are queued before the host reads the round before.
# Session 27 (H100, docs/gpu.md § Session 27) measured the colocated round at 0.87 ms with 0.47 ms of kernels (b1).
#
#   bash bench/gpu_session28.sh OUT_DIR ahead   # the new gpu test (in-process engine, batch 1 and 4, exact and taken);
#                                               # the round host at batch 1 and 8 with and without rounds queued
#                                               # ahead; bench services colocated+no-round-ahead / colocated at batch
#                                               # 1 and 8; the loop tests with the draft in the process; a profiler
#                                               # pass at batch 1 (as time allows)
#   bash bench/gpu_session28.sh OUT_DIR b8      # the round host at batch 8 ± round ahead, twice, then with a 0.5 ms
#                                               # interpreter switch interval (the batch-8 anomaly of § Session 28)
#   bash bench/gpu_session28.sh OUT_DIR tests   # every one-GPU test file (-m gpu) but the loop file (run by ahead),
#                                               # the reload file's RECAPTURE times with the chain kinds included
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md); carry [".whl"].
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-ahead}"
gpu_prologue
if [ "$mode" = ahead ]; then
  timeout 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_round_ahead_gpu.py 2>&1 \
    | tee "$out/gpu_tests_ahead.log" | grep -E "passed|failed|error|Error|assert|\[gpu round" | tail -12
  HEAD=3 probe no_ahead_b1 45 1 128 --outbox --colocated --no-round-ahead
  HEAD=3 probe ahead_b1 45 1 128 --outbox --colocated
  HEAD=3 probe no_ahead_b8 45 8 128 --outbox --colocated --no-round-ahead
  HEAD=3 probe ahead_b8 45 8 128 --outbox --colocated
  [ "$(left)" -gt 150 ] && svc services_ahead "$(( $(left) - 110 ))" --device cuda:0 --batch 1 8 \
    --variants colocated+no-round-ahead colocated
  [ "$(left)" -gt 60 ] && timeout "$(( $(left) - 40 ))" python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/gpu/test_loop_gpu.py -k colocated 2>&1 | tee "$out/gpu_tests_loop.log" \
    | grep -E "passed|failed|error|Error|assert" | tail -8
  [ "$(left)" -gt 35 ] && HEAD=40 probe ahead_b1_profile "$(left)" 1 128 --outbox --colocated --torch-profile 12
elif [ "$mode" = b8 ]; then
  # Batch 8 in the round host: queued ahead it was slower in the probe's second phase only (§ Session 28). Each way
  # twice, then with a 0.5 ms interpreter switch interval (does a round loop that rarely blocks starve the clients?).
  for i in 1 2; do
    HEAD=3 probe b8_no_ahead_$i 40 8 128 --outbox --colocated --no-round-ahead
    HEAD=3 probe b8_ahead_$i 40 8 128 --outbox --colocated
  done
  HEAD=3 probe b8_no_ahead_si 40 8 128 --outbox --colocated --no-round-ahead --switch-interval 0.0005
  HEAD=3 probe b8_ahead_si 40 8 128 --outbox --colocated --switch-interval 0.0005
elif [ "$mode" = tests ]; then
  # The reload file too: the colocated draft captures its chain{k} kinds now, and a RECAPTURE recaptures them.
  timeout "$(left 560)" python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu \
    --ignore tests/gpu/test_loop_gpu.py 2>&1 | tee "$out/gpu_tests.log" \
    | grep -E "passed|failed|error|Error|assert|RECAPTURE|recapture" | tail -24
else
  echo "unknown mode $mode"; exit 2
fi
