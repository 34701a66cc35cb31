#!/usr/bin/env bash
# Session 21 on one GPU (issue 10): where a batch-8 speculative round's time goes through the
# services' round loop, against the same round in process, then the GPU tests session 20 left.
#
#   bash bench/gpu_session21.sh OUT_DIR main    # the most in one call: the graph and decode-ahead GPU tests (verify1),
#                                               # bench services at batch 8 and 1, the batch-8 probe with a draft
#   bash bench/gpu_session21.sh OUT_DIR probe   # scripts/round_host_probe.py with a draft service (target and
#                                               # draft on cuda:0, batch 8, target-only 8, then 1; the scheduler
#                                               # thread's cProfile),
#                                               # bench profile --small --batch 8 (the same round in process),
#                                               # then bench services at batch 8 as time allows
#   bash bench/gpu_session21.sh OUT_DIR tests   # the graph, decode-ahead, kernel, invariance, propose and round-loop
#                                               # GPU tests, then bench services at batch 8 (float32) and 1
#   bash bench/gpu_session21.sh OUT_DIR peer    # bench peer on the bundled model at batch 1 and 8 (one GPU for
#                                               # both workers), then bench adaptive as time allows
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md); carry [".whl"].
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-main}"
gpu_prologue
probe() {  # $1 the output's name, $2 the seconds it may take, then the probe's batch and flags
  local name="$1" limit="$2"; shift 2
  timeout "$limit" python3 scripts/round_host_probe.py models/tiny cuda:0 "$1" 128 --outbox "${@:2}" --profile 40 \
    2>&1 | quiet | grep -v -E "^\s*$|lifecycle|graph_registry|admin_token" | tee "$out/$name.txt" | head -60
}
if [ "$mode" = main ]; then
  timeout 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_graphs_gpu.py \
    tests/gpu/test_decode_ahead_gpu.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|error|Error|assert" | tail -12
  svc services_b8 150 --device cuda:0 --batch 8
  svc services_b1 150 --device cuda:0 --batch 1
  [ "$(left)" -gt 60 ] && probe probe_b8 "$(left)" 8 --draft cuda:0
elif [ "$mode" = probe ]; then
  probe probe_b8 150 8 --draft cuda:0
  probe probe_b8_target_only 90 8
  probe probe_b1 120 1 --draft cuda:0
  timeout 150 python3 -m specsplit bench profile --small --batch 8 2>&1 | quiet | tee "$out/profile_b8.txt" | tail -50
  [ "$(left)" -gt 90 ] && svc services_b8 "$(left)" --device cuda:0 --batch 8
elif [ "$mode" = tests ]; then
  timeout 330 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_graphs_gpu.py \
    tests/gpu/test_decode_ahead_gpu.py tests/gpu/test_kernels_gpu.py \
    tests/gpu/test_invariant_gpu.py tests/gpu/test_propose_gpu.py tests/gpu/test_loop_gpu.py 2>&1 \
    | tee "$out/gpu_tests.log" | grep -E "passed|failed|error|Error|assert|\[gpu" | tail -24
  svc services_b8 120 --device cuda:0 --batch 8
  [ "$(left)" -gt 60 ] && svc services_b1 "$(left)" --device cuda:0 --batch 1
elif [ "$mode" = peer ]; then
  timeout 330 python3 -m specsplit bench peer --small --device cuda:0 --batch 1 8 --prompts 8 --max-tokens 128 2>&1 \
    | quiet | tee "$out/bench_peer_small.txt" | tail -10
  [ "$(left)" -gt 120 ] && timeout "$(left)" python3 -m specsplit bench adaptive --backend torch --device cuda:0 \
    --prompts 8 --max-tokens 128 --repeats 2 2>&1 | quiet | tee "$out/adaptive.txt" | tail -12
else
  echo "unknown mode $mode"; exit 2
fi
