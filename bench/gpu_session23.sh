#!/usr/bin/env bash
# Session 23 on one GPU (issue 10): why adaptive k loses to the best fixed k on the GPU (0.85-0.92 on an H100 in
# session 23's first call, where the trace simulation of the same regime says ~0.98-1.07), and why a target-only round
# through the services at batch 8 takes ~2 ms of target step where the in-process step takes ~0.5.
#
#   bash bench/gpu_session23.sh OUT_DIR trace    # bench adaptive --drafting-probes with every request-round recorded
#                                                # (scripts/round_probe: the cost model's T(0), T(k) and each
#                                                # request's E(k) too), summarized by scripts/round_trace.py; then
#                                                # the target's round host in process at batch 8, target-only
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md); carry [".whl"].
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-trace}"
gpu_prologue
if [ "$mode" = trace ]; then
  mkdir -p "$out/rt"
  ROUND_PROBE_DIR="$out/rt" PYTHONPATH="$PWD/scripts/round_probe:$PYTHONPATH" timeout 300 python3 -m specsplit \
    bench adaptive --backend torch --device cuda:0 --prompts 8 --max-tokens 128 --drafting-probes 2>&1 | quiet \
    | tee "$out/adaptive.txt" | tail -10
  python3 scripts/round_trace.py "$out/rt" 2>&1 | tee "$out/round_trace.txt"
  [ "$(left)" -gt 60 ] && timeout "$(left)" python3 scripts/round_host_probe.py models/tiny cuda:0 8 128 --outbox \
    --profile 25 2>&1 | quiet | tee "$out/probe_b8_target_only.txt" | head -40
else
  echo "unknown mode $mode"; exit 2
fi
