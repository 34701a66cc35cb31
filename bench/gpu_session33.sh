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
#   bash bench/gpu_session33.sh OUT_DIR ab ALT    # the same round host without the profiler, this tree against the
#                                                 # checkout ALT (a worktree inside the tree): adaptive k on that
#                                                 # prompt (target-only rounds, the draft holding the request) and
#                                                 # on the default one (drafting rounds), with k = 0 and k = 3 on
#                                                 # this tree between them, while time is left (LIMIT=S)
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md); carry [".whl"], and ALT for ab (see
# bench/gpu_session32.sh: a worktree is carried only when named, its models/ left out).
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-held}"
gpu_prologue
if [ "$mode" = held ]; then
  for i in 1 2; do
    [ "$(left)" -gt 130 ] || break
    HEAD=60 probe "held_adaptive_$i" 60 1 128 --outbox --colocated --adaptive --random-prompt 1:200 --torch-profile 14
    HEAD=60 probe "k0_$i" 60 1 128 --outbox --colocated --k 0 --random-prompt 1:200 --torch-profile 14
  done
elif [ "$mode" = ab ]; then
  alt="${3:?ALT: the other checkout (a directory inside the tree)}"
  [ -e "$alt/models" ] || ln -s ../models "$alt/models"
  ab_probe() {  # $1 tree or alt, $2 the output's name, then the probe's flags
    local tree=$([ "$1" = tree ] && echo . || echo "$alt") name="$2"; shift 2
    [ "$(left)" -gt 50 ] || return 0
    (cd "$tree" && timeout 45 python3 scripts/round_host_probe.py models/tiny cuda:0 1 128 --outbox --colocated "$@" \
      2>&1 | quiet | tee "$out/$name.txt" | grep -E "^run:" | cut -c1-200)
  }
  ab_probe tree held_tree --adaptive --random-prompt 1:200
  ab_probe alt held_alt --adaptive --random-prompt 1:200
  ab_probe tree k0 --k 0 --random-prompt 1:200
  ab_probe tree drafting_tree --adaptive
  ab_probe alt drafting_alt --adaptive
  ab_probe tree k3 --k 3
  ab_probe tree held_tree_2 --adaptive --random-prompt 1:200
  ab_probe alt held_alt_2 --adaptive --random-prompt 1:200
else
  echo "unknown mode $mode"; exit 2
fi
