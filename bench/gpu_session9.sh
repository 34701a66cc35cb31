#!/usr/bin/env bash
# Session 9 on the GPU host (one H200: draft and target share cuda:0), one device call per mode:
#
#   bash bench/gpu_session9.sh OUT_DIR first   # session 8's per-request path: the round loop's GPU tests,
#                                              # one request's time outside compute, bench services with
#                                              # data_plane_poll_us 0 and 2000 side by side at batch 1
#   bash bench/gpu_session9.sh OUT_DIR prefill # prefill graphs: their GPU tests, bench prefill (eager vs graph),
#                                              # the request timeline again, bench peer (tiny, batch 1)
#   bash bench/gpu_session9.sh OUT_DIR final   # every GPU test but reload and stack (the loop tests again)
#   bash bench/gpu_session9.sh OUT_DIR fix     # after final: the prefill tests alone, 20 RECAPTURE reloads,
#                                              # bench prefill, bench peer (~1B and bundled, batch 1), the
#                                              # runtime.compile test last
#   bash bench/gpu_session9.sh OUT_DIR last    # bench prefill with a profile of two prefills, 20 RECAPTURE
#                                              # reloads (bench.reload_probe), the stack test, bench peer
#                                              # (~1B and bundled at batch 1, bundled at batch 8)
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md).
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-first}"
gpu_prologue
case "$mode" in
first)
  timeout 150 python3 -m specsplit bench services --backend torch --device cuda:0 --batch 1 --prompts 8 \
    --max-tokens 128 --poll-us 0 2000 2>&1 | quiet | tee "$out/poll.txt" | tail -6
  timeout 120 python3 scripts/request_timeline.py --device cuda:0 2>&1 | quiet | tee "$out/request_timeline.txt" | head -8
  timeout 260 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_loop_gpu.py --durations=0 2>&1 \
    | tee "$out/loop_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert|^[0-9.]+s call" | tail -30
  ;;
prefill)
  timeout 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_prefill_gpu.py 2>&1 \
    | tee "$out/prefill_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert" | tail -12
  timeout 150 python3 -m specsplit bench prefill --backend torch --device cuda:0 2>&1 | quiet | tee "$out/bench_prefill.txt"
  timeout 120 python3 scripts/request_timeline.py --device cuda:0 2>&1 | quiet | tee "$out/request_timeline.txt" | head -6
  timeout 150 python3 -m specsplit bench peer --device cuda:0 --small --batch 1 --prompts 8 --max-tokens 128 2>&1 \
    | quiet | tee "$out/bench_peer_tiny.txt" | tail -3
  ;;
final)
  timeout 560 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu --durations=0 \
    --deselect tests/gpu/test_reload_gpu.py --deselect tests/gpu/test_stack_gpu.py 2>&1 \
    | tee "$out/gpu_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert|^[0-9.]+s call" | tail -60
  ;;
last)
  timeout 120 python3 -m specsplit bench prefill --backend torch --device cuda:0 2>&1 | quiet | tee "$out/bench_prefill.txt"
  SPECSPLIT_RELOAD_CYCLES=20 timeout 150 python3 -m pytest -q -s -p no:cacheprovider -p bench.reload_probe -m gpu \
    tests/gpu/test_reload_gpu.py 2>&1 | tee "$out/reload_probe.log" | grep -E "RECAPTURE|passed|failed|probe" | tail -8
  timeout 100 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_stack_gpu.py 2>&1 \
    | tee "$out/stack.log" | grep -E "^\[gpu|passed|failed|Error|assert" | tail -6
  timeout 200 python3 -m specsplit bench peer --device cuda:0 --batch 1 --prompts 8 --max-tokens 128 2>&1 \
    | quiet | tee "$out/bench_peer.txt" | tail -4
  timeout 100 python3 -m specsplit bench peer --device cuda:0 --small --batch 8 --prompts 8 --max-tokens 128 2>&1 \
    | quiet | tee "$out/bench_peer_b8.txt" | tail -2
  ;;
fix)
  # After the compile test's timeout in 'final' (prefill kinds were torch.compiled: now never).
  timeout 70 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_prefill_gpu.py 2>&1 \
    | tee "$out/prefill_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert" | tail -6
  SPECSPLIT_RELOAD_CYCLES=20 timeout 130 python3 -m pytest -q -s -p no:cacheprovider -p bench.reload_probe -m gpu \
    tests/gpu/test_reload_gpu.py 2>&1 | tee "$out/reload_probe.log" | grep -E "RECAPTURE|passed|failed|probe" | tail -8
  timeout 90 python3 -m specsplit bench prefill --backend torch --device cuda:0 2>&1 | quiet | tee "$out/bench_prefill.txt"
  timeout 205 python3 -m specsplit bench peer --device cuda:0 --batch 1 --prompts 8 --max-tokens 128 2>&1 \
    | quiet | tee "$out/bench_peer.txt" | tail -4
  timeout 175 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_fastpath_gpu.py -k compiled \
    --durations=0 2>&1 | tee "$out/compile_test.log" | grep -E "passed|failed|error|Error|^[0-9.]+s call" | tail -6
  ;;
*) echo "unknown mode $mode"; exit 2 ;;
esac
