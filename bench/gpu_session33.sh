#!/usr/bin/env bash
# Session 33 on one GPU (issue 10; docs/gpu.md § Session 33): why adaptive k's target-only rounds of a request the
# draft holds cost more than a k = 0 request's (§ Session 32's trace: 0.445 against 0.357 ms a round, the target
# part +0.06 ms, the rest +0.03), in the round host with the draft in the process.
#
#   bash bench/gpu_session33.sh OUT_DIR held      # scripts/round_host_probe.py, batch 1, a prompt the bundled
#                                                 # model's draft rarely matches (--random-prompt 1:200): adaptive
#                                                 # k (target-only rounds, the draft holding the request) and k = 0,
#                                                 # each with a Torch profiler pass (GPU busy, host gap, kernels and
#                                                 # host calls a round); a second pair while time is left (LIMIT=S)
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md); carry [".whl"].
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-held}"
gpu_prologue
if [ "$mode" = held ]; then
  for i in 1 2; do
    [ "$(left)" -gt 130 ] || break
    HEAD=60 probe "held_adaptive_$i" 60 1 128 --outbox --colocated --adaptive --random-prompt 1:200 --torch-profile 14
    HEAD=60 probe "k0_$i" 60 1 128 --outbox --colocated --k 0 --random-prompt 1:200 --torch-profile 14
  done
else
  echo "unknown mode $mode"; exit 2
fi
