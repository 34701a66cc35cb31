#!/usr/bin/env bash
# Session 10 on the GPU host (one H200: draft and target share cuda:0), one device call per mode:
#
#   bash bench/gpu_session10.sh OUT_DIR first   # what session 9 left unverified: the round loop's GPU tests
#                                               # (the first token before the draft's prefill), bench graphs
#                                               # (verify against the weight floor), bench peer at batch 8
#                                               # (bundled), then the runtime.compile test with what is left
#   bash bench/gpu_session10.sh OUT_DIR relay   # what relaying each round's chunks costs the round loop: bench
#                                               # services at batch 8 and 1 with stream_interval 1 and 16
#   bash bench/gpu_session10.sh OUT_DIR final   # DecodeStream (one stream for every request): bench services at
#                                               # batch 8 and 1, the round loop's GPU tests, bench peer (~1B and
#                                               # bundled at batch 1, bundled at batch 8), the stack test
#   bash bench/gpu_session10.sh OUT_DIR next    # for the next session, first: what this session built after its
#                                               # device time (the Propose message's host path, the response split):
#                                               # bench propose-host on cuda, bench services at batch 8 and 1, the
#                                               # round loop's GPU tests, 20 RECAPTURE reloads
#   bash bench/gpu_session10.sh OUT_DIR adaptive # bench adaptive (fixed k vs adaptive on the prompt mix), alone
#
# Diagnostic between them (docs/performance.md § Session 10): scripts/round_host_probe.py MODEL cuda:0 B N [--late]
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md).
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-first}"
gpu_prologue
case "$mode" in
first)
  timeout 140 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_loop_gpu.py --durations=0 2>&1 \
    | tee "$out/loop_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert|^[0-9.]+s call" | tail -20
  timeout 110 python3 -m specsplit bench graphs --device cuda:0 2>&1 | quiet | tee "$out/bench_graphs.txt" | tail -20
  timeout 100 python3 -m specsplit bench peer --device cuda:0 --small --batch 8 --prompts 8 --max-tokens 128 2>&1 \
    | quiet | tee "$out/bench_peer_b8.txt" | tail -3
  timeout "$(left)" python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_fastpath_gpu.py -k compiled \
    --durations=0 2>&1 | tee "$out/compile_test.log" | grep -E "^\[gpu|passed|failed|error|Error|^[0-9.]+s call" | tail -6
  ;;
relay)
  timeout 200 python3 -m specsplit bench services --backend torch --device cuda:0 --batch 8 --prompts 16 \
    --max-tokens 128 --stream-interval 1 16 1 16 2>&1 | quiet | tee "$out/relay_b8.txt" | tail -9
  timeout 150 python3 -m specsplit bench services --backend torch --device cuda:0 --batch 1 --prompts 8 \
    --max-tokens 128 --stream-interval 1 16 2>&1 | quiet | tee "$out/relay_b1.txt" | tail -5
  ;;
final)
  timeout 100 python3 -m specsplit bench services --backend torch --device cuda:0 --batch 8 1 --prompts 16 \
    --max-tokens 128 2>&1 | quiet | tee "$out/services.txt" | tail -6
  timeout 130 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_loop_gpu.py 2>&1 \
    | tee "$out/loop_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert" | tail -16
  timeout 190 python3 -m specsplit bench peer --device cuda:0 --batch 1 --prompts 8 --max-tokens 128 2>&1 \
    | quiet | tee "$out/bench_peer.txt" | tail -4
  timeout 80 python3 -m specsplit bench peer --device cuda:0 --small --batch 8 --prompts 8 --max-tokens 128 2>&1 \
    | quiet | tee "$out/bench_peer_b8.txt" | tail -2
  timeout "$(left 575)" python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_stack_gpu.py 2>&1 \
    | tee "$out/stack.log" | grep -E "^\[gpu|passed|failed|Error|assert" | tail -6
  ;;
next)
  timeout 90 python3 -m specsplit bench propose-host --backend torch --device cuda:0 2>&1 | quiet \
    | tee "$out/propose_host.txt" | tail -18
  timeout 100 python3 -m specsplit bench services --backend torch --device cuda:0 --batch 8 1 --prompts 16 \
    --max-tokens 128 2>&1 | quiet | tee "$out/services.txt" | tail -6
  timeout 130 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_loop_gpu.py 2>&1 \
    | tee "$out/loop_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert" | tail -16
  SPECSPLIT_RELOAD_CYCLES=20 timeout 130 python3 -m pytest -q -s -p no:cacheprovider -p bench.reload_probe -m gpu \
    tests/gpu/test_reload_gpu.py 2>&1 | tee "$out/reload_probe.log" | grep -E "RECAPTURE|passed|failed|probe" | tail -8
  ;;
adaptive)
  timeout 580 python3 -m specsplit bench adaptive --backend torch --device cuda:0 --prompts 8 \
    --max-tokens 128 2>&1 | quiet | tee "$out/adaptive.txt" | tail -12
  ;;
*) echo "unknown mode $mode"; exit 2 ;;
esac
