#!/usr/bin/env bash
# Session 22 on one GPU (issue 10): session 21's verify1 step checked on the GPU, and adaptive k's watch
# probes against drafting probes, side by side.
#
#   bash bench/gpu_session22.sh OUT_DIR first    # the graph and decode-ahead GPU tests (verify1 replayed, decode
#                                                # ahead on CUDA), bench adaptive with a column of drafting probes
#                                                # (three stacks on the one GPU), then bench services at batch 8
#   bash bench/gpu_session22.sh OUT_DIR adaptive # bench adaptive --drafting-probes, two repeats (watch probes that
#                                                # measure their own cost), then bench services at batch 1
#   bash bench/gpu_session22.sh OUT_DIR second   # bench services at batch 8 and 1 (target-only on verify1), the
#                                                # batch-8 round probe with a draft service, as time allows
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md); carry [".whl"].
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-first}"
gpu_prologue
if [ "$mode" = first ]; then
  timeout 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_graphs_gpu.py \
    tests/gpu/test_decode_ahead_gpu.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|error|Error|assert" | tail -12
  timeout 330 python3 -m specsplit bench adaptive --backend torch --device cuda:0 --prompts 8 --max-tokens 128 \
    --drafting-probes 2>&1 | quiet | tee "$out/adaptive.txt" | tail -10
  [ "$(left)" -gt 60 ] && svc services_b8 "$(left)" --device cuda:0 --batch 8
elif [ "$mode" = adaptive ]; then
  timeout 330 python3 -m specsplit bench adaptive --backend torch --device cuda:0 --prompts 8 --max-tokens 128 \
    --drafting-probes --repeats 2 2>&1 | quiet | tee "$out/adaptive.txt" | tail -10
  [ "$(left 420)" -gt 60 ] && svc services_b1 "$(left 420)" --device cuda:0 --batch 1
elif [ "$mode" = second ]; then
  svc services_b8 150 --device cuda:0 --batch 8
  svc services_b1 150 --device cuda:0 --batch 1
  [ "$(left)" -gt 60 ] && timeout "$(left)" python3 scripts/round_host_probe.py models/tiny cuda:0 8 128 --outbox \
    --draft cuda:0 --profile 40 2>&1 | quiet | tee "$out/probe_b8.txt" | head -60
else
  echo "unknown mode $mode"; exit 2
fi
