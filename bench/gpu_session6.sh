#!/usr/bin/env bash
# Session 6 on the GPU host, one device call per mode:
#
#   bash bench/gpu_session6.sh OUT_DIR profile   # before tuning: bench profile (~1B round, top kernels),
#                                                # bench peer on the bundled model at batch 1, bench adaptive
#   bash bench/gpu_session6.sh OUT_DIR kernels   # fused-kernel GPU tests, bench graphs
#   bash bench/gpu_session6.sh OUT_DIR propose   # one-graph Propose: its GPU tests, bench propose-host, bench profile
#   bash bench/gpu_session6.sh OUT_DIR tests     # every gpu test but reload and stack (two-GPU ones skip on one)
#   bash bench/gpu_session6.sh OUT_DIR bench     # RECAPTURE phases A/B, bench round-parts (data plane vs
#                                                # gRPC stream), bench peer (batch 1; bundled model at 8)
#   bash bench/gpu_session6.sh OUT_DIR gemm      # bench gemm: cuBLAS layouts / libraries for the ~1B projections
#   bash bench/gpu_session6.sh OUT_DIR x2        # two GPUs: bench peer, loop variants, two-GPU tests
#   bash bench/gpu_session6.sh OUT_DIR probe     # test_reload_gpu (20 cycles) with bench.reload_probe; test_stack_gpu
#   bash bench/gpu_session6.sh OUT_DIR adaptive  # (session 7's code) bench peer on the bundled model at batch 1
#                                                # with the share of wall time in rounds; bench adaptive, 3 repeats
#   bash bench/gpu_session6.sh OUT_DIR split     # (session 8's code) the host's exchange floor, one request's
#                                                # time outside compute (scripts/request_timeline.py); bench
#                                                # services with stream_interval 1 and 4 side by side at batch
#                                                # 1 and 8, and with data_plane_poll_us 0 and 2000 at batch 1
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md).
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-profile}"
gpu_prologue
case "$mode" in
profile)
  timeout 150 python3 -m specsplit bench profile --device cuda:0 2>&1 | quiet | tee "$out/bench_profile.txt"
  timeout 150 python3 -m specsplit bench peer --device cuda:0 --small --batch 1 --prompts 8 --max-tokens 128 2>&1 \
    | quiet | tee "$out/bench_peer_tiny.txt" | tail -4
  timeout 150 python3 -m specsplit bench adaptive --backend torch --device cuda:0 --prompts 4 --max-tokens 96 2>&1 \
    | quiet | tee "$out/bench_adaptive.txt" | tail -8
  ;;
adaptive)
  timeout 150 python3 -m specsplit bench peer --device cuda:0 --small --batch 1 --prompts 8 --max-tokens 128 2>&1 \
    | quiet | tee "$out/bench_peer_tiny.txt" | tail -4
  timeout 380 python3 -m specsplit bench adaptive --backend torch --device cuda:0 --prompts 4 --max-tokens 96 \
    --repeats 3 2>&1 | quiet | tee "$out/bench_adaptive.txt" | tail -8
  ;;
split)
  timeout 120 python3 scripts/exchange_floor.py 2>&1 | quiet | tee "$out/exchange_floor.txt"
  timeout 130 python3 scripts/request_timeline.py --device cuda:0 2>&1 | quiet | tee "$out/request_timeline.txt" | head -6
  timeout 190 python3 -m specsplit bench services --backend torch --device cuda:0 --batch 1 8 --prompts 8 \
    --max-tokens 128 --stream-interval 1 4 2>&1 | quiet | tee "$out/stream_interval.txt" | tail -9
  timeout 140 python3 -m specsplit bench services --backend torch --device cuda:0 --batch 1 --prompts 8 \
    --max-tokens 128 --poll-us 0 2000 2>&1 | quiet | tee "$out/poll.txt" | tail -5
  ;;
kernels)
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_kernels_gpu.py 2>&1 \
    | tee "$out/kernels_tests.log" | grep -E "^\[gpu|passed|failed|Error|assert" | tail -12
  timeout 200 python3 -m specsplit bench graphs --device cuda:0 2>&1 | quiet | tee "$out/bench_graphs.txt"
  ;;
propose)
  timeout 240 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_propose_gpu.py tests/gpu/test_graphs_gpu.py \
    tests/gpu/test_kernels_gpu.py 2>&1 | tee "$out/propose_tests.log" | grep -E "^\[gpu|passed|failed|Error|assert" | tail -20
  timeout 120 python3 -m specsplit bench propose-host --backend torch --device cuda:0 2>&1 | quiet | tee "$out/propose_host.txt"
  timeout 150 python3 -m specsplit bench profile --device cuda:0 2>&1 | quiet | tee "$out/bench_profile.txt" | head -24
  ;;
tests)
  # test_reload_gpu and test_stack_gpu run in the probe call (together they pushed this one
  # past its 560 s limit, and the reload test reads slower after every other test in one process).
  timeout 560 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu --durations=0 \
    --deselect tests/gpu/test_reload_gpu.py --deselect tests/gpu/test_stack_gpu.py 2>&1 \
    | tee "$out/gpu_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert|^[0-9.]+s call" | tail -60
  ;;
bench)
  timeout 80 python3 scripts/recapture_ab.py --device cuda:0 --cycles 3 2>&1 | quiet | tee "$out/recapture_ab.txt"
  timeout 70 python3 -m specsplit bench round-parts --device cuda:0 2>&1 | quiet | tee "$out/round_parts.txt"
  timeout 220 python3 -m specsplit bench peer --device cuda:0 --batch 1 --prompts 8 --max-tokens 128 2>&1 \
    | quiet | tee "$out/bench_peer.txt" | tail -5
  timeout 100 python3 -m specsplit bench peer --device cuda:0 --small --batch 8 --prompts 8 --max-tokens 128 2>&1 \
    | quiet | tee "$out/bench_peer_b8.txt" | tail -3
;;
x2)
  # The first call on a two-GPU host (nvidia-h200-x2): the issue-10 figures with the draft on
  # cuda:0 and the target on cuda:1 (bench peer puts the draft on cuda:1 by itself when it
  # sees two GPUs; the services bench is told), then the two-GPU tests.
  timeout 220 python3 -m specsplit bench peer --device cuda:0 --batch 1 --prompts 8 --max-tokens 128 2>&1 \
    | quiet | tee "$out/bench_peer_x2.txt" | tail -4
  timeout 130 python3 -m specsplit bench services --backend torch --device cuda:1 --draft-device cuda:0 \
    --variants fixed ahead micro --batch 1 8 --prompts 8 --max-tokens 128 2>&1 | quiet | tee "$out/variants_x2.txt" | tail -8
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_stack_gpu.py tests/gpu/test_tp_gpu.py 2>&1 \
    | tee "$out/x2_tests.log" | grep -E "^\[gpu|passed|failed|Error|assert" | tail -12
  ;;
gemm)
  timeout 80 python3 -m specsplit bench gemm --device cuda:0 2>&1 | quiet | tee "$out/bench_gemm.txt"
  ;;
probe)
  SPECSPLIT_RELOAD_CYCLES=20 timeout 300 python3 -m pytest -q -s -p no:cacheprovider -p bench.reload_probe -m gpu \
    tests/gpu/test_reload_gpu.py 2>&1 | tee "$out/reload_probe.log" | grep -E "RECAPTURE|passed|failed|probe|^  [A-Za-z]" | tail -14
  timeout 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_stack_gpu.py 2>&1 \
    | tee "$out/stack.log" | grep -E "^\[gpu|passed|failed|Error|assert" | tail -8
  ;;
*) echo "unknown mode $mode"; exit 2 ;;
esac
