#!/usr/bin/env bash
# Session 27 on one GPU (issue 10): greedy drafts from the colocated draft to the verify on the device
# (runtime/device_drafts.py, colocated_device_drafts): one host synchronisation a round. Session 27's first calls
# (H100, docs/gpu.md § Session 27) measured the colocated round at 0.78 ms with 0.46 ms of kernels at batch 1.
#
#   bash bench/gpu_session27.sh OUT_DIR chain  # the loop tests with the draft in the process (graphs of both; greedy
#                                              # drafts on the device), then the round host at batch 1 and 8: drafts
#                                              # through the host against on the device, then a Torch profiler pass
#                                              # of each at batch 1; then bench services fixed / colocated+host-drafts
#                                              # / colocated at batch 1 and 8; then the propose and fast-path
#                                              # gpu tests (the in-process engine's drafts on the device too)
#   bash bench/gpu_session27.sh OUT_DIR peer   # bench peer --small --colocated-draft --batch 1 8 (the engine's and the
#                                              # colocated services' drafts on the device now)
#   bash bench/gpu_session27.sh OUT_DIR tests  # every one-GPU test file (-m gpu) but the loop and reload files
#                                              # (session 27 ran those on this code), within 470 s
#   bash bench/gpu_session27.sh OUT_DIR interval  # bench services --variants colocated --stream-interval 1 4: does the
#                                              # target's Decode handler, sending a message a round, slow the round?
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md); carry [".whl"].
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-chain}"
gpu_prologue
if [ "$mode" = chain ]; then
  timeout 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_loop_gpu.py -k colocated 2>&1 \
    | tee "$out/gpu_tests.log" | grep -E "passed|failed|error|Error|assert|\[gpu loop" | tail -12
  HEAD=3 probe host_drafts_b1 60 1 128 --outbox --colocated --host-drafts
  HEAD=3 probe device_drafts_b1 60 1 128 --outbox --colocated
  HEAD=3 probe host_drafts_b8 60 8 128 --outbox --colocated --host-drafts
  HEAD=3 probe device_drafts_b8 60 8 128 --outbox --colocated
  HEAD=40 probe device_drafts_b1_profile 90 1 128 --outbox --colocated --torch-profile 12
  [ "$(left)" -gt 100 ] && svc services_chain "$(( $(left) - 60 ))" --device cuda:0 --batch 1 8 \
    --variants fixed colocated+host-drafts colocated
  [ "$(left)" -gt 30 ] && timeout "$(left)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_propose_gpu.py \
    tests/gpu/test_fastpath_gpu.py 2>&1 | tee "$out/gpu_tests_engine.log" | grep -E "passed|failed|error|Error|assert" \
    | tail -8
elif [ "$mode" = peer ]; then
  timeout "$(left)" python3 -m specsplit bench peer --small --device cuda:0 --colocated-draft --batch 1 8 2>&1 \
    | quiet | tee "$out/peer.txt" | tail -12
elif [ "$mode" = tests ]; then
  timeout "$(left 470)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu --ignore tests/gpu/test_loop_gpu.py \
    --ignore tests/gpu/test_reload_gpu.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|error|Error|assert" \
    | tail -20
elif [ "$mode" = interval ]; then
  svc services_interval "$(left)" --device cuda:0 --batch 1 8 --variants colocated --stream-interval 1 4
else
  echo "unknown mode $mode"; exit 2
fi
