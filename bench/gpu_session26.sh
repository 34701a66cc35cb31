#!/usr/bin/env bash
# Session 26 on one GPU (issue 10): the draft in the target's process (colocated_draft). On one GPU the two worker
# processes take turns on the device (their contexts time-slice: the batch-8 target step took 1.47 ms beside a draft
# process against 0.48 ms alone, § Session 22) and every round pays the exchange between them. Built and measured on
# the 2-core CPU only (docs/performance.md § Session 26); nothing of it has run on a GPU yet.
#
#   bash bench/gpu_session26.sh OUT_DIR colo   # tests/gpu/test_loop_gpu.py -k colocated (graphs of both workers in
#                                              # one process; fixed, ahead, micro-batches identical to target-only),
#                                              # then bench services: fixed against colocated (and colocated+ahead),
#                                              # batch 1 and 8, both workers on cuda:0
#   bash bench/gpu_session26.sh OUT_DIR peer   # bench peer --small --colocated-draft --batch 1 8: the peer, the engine,
#                                              # the services and the services with the draft in the target's process
#   bash bench/gpu_session26.sh OUT_DIR reload # tests/gpu/test_reload_gpu.py, both parametrizations, 6 cycles each:
#                                              # memory back to the empty baseline with a colocated draft too
#   bash bench/gpu_session26.sh OUT_DIR adaptive  # bench adaptive --same-stack --repeats 2 --colocated-draft: adaptive k
#                                              # against fixed k with the draft in the target's process (issue 10's
#                                              # adaptive goal was 0.87-0.96 with a draft process, session 24)
#   bash bench/gpu_session26.sh OUT_DIR host   # the round host with the draft in this process (round_host_probe
#                                              # --colocated), batch 1 and 8, k=3: round split, then a Torch
#                                              # profiler pass (GPU busy and host gap a round, both workers' kernels);
#                                              # then batch 1 against a draft process (--draft cuda:0)
#
# Then the modes of bench/gpu_session25.sh (b8) and bench/gpu_session24.sh (ring, check, fix, rest), which still
# hold for this code. Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md); carry [".whl"].
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-colo}"
gpu_prologue
if [ "$mode" = colo ]; then
  timeout 240 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_loop_gpu.py -k colocated 2>&1 \
    | tee "$out/gpu_tests.log" | grep -E "passed|failed|error|Error|assert|\[gpu loop" | tail -12
  [ "$(left)" -gt 120 ] && svc services_colocated "$(left)" --device cuda:0 --batch 1 8 \
    --variants fixed colocated colocated+ahead
elif [ "$mode" = peer ]; then
  timeout "$(left)" python3 -m specsplit bench peer --small --device cuda:0 --colocated-draft --batch 1 8 2>&1 \
    | quiet | tee "$out/peer.txt" | tail -12
elif [ "$mode" = reload ]; then
  SPECSPLIT_RELOAD_CYCLES=6 timeout "$(left)" python3 -m pytest -q -s -p no:cacheprovider -m gpu \
    tests/gpu/test_reload_gpu.py 2>&1 | tee "$out/reload.log" | grep -v -E "^20[0-9][0-9]-" | tail -40
elif [ "$mode" = adaptive ]; then
  timeout "$(left)" python3 -m specsplit bench adaptive --backend torch --device cuda:0 --prompts 8 --max-tokens 128 \
    --same-stack --repeats 2 --colocated-draft 2>&1 | quiet | tee "$out/adaptive.txt" | tail -14
elif [ "$mode" = host ]; then
  probe colocated_b1 120 1 128 --outbox --colocated --torch-profile 15
  probe colocated_b8 120 8 128 --outbox --colocated --torch-profile 15
  probe draft_process_b1 100 1 128 --outbox --draft cuda:0
else
  echo "unknown mode $mode"; exit 2
fi
