#!/usr/bin/env bash
# Session 29's open questions on one GPU (issue 10; docs/performance.md § Session 29).
#
#   bash bench/gpu_session29.sh OUT_DIR threads  # the round host at batch 8 with the draft in the process, ± rounds
#                                                # queued ahead, then queued ahead with --late (nobody woken before a
#                                                # request ends): each phase prints the CPU time per round by thread.
#                                                # Which thread holds the interpreter while the round loop waits in
#                                                # Tensor.copy_ (112 us a call at batch 8, § Session 29)?
#   bash bench/gpu_session29.sh OUT_DIR services # bench services colocated+no-round-ahead / colocated at batch 1 and 8
#                                                # (the chain's counts now read back through a reused fetch ring)
#   bash bench/gpu_session29.sh OUT_DIR adaptive ALT  # bench adaptive --same-stack --repeats 2 --colocated-draft on
#                                                # this tree, then on the checkout ALT (a directory inside the tree, so
#                                                # it is carried: e.g. `git worktree add .alt c3dd2af`, the probe
#                                                # pricing reverted in session 29), then this tree again
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md); carry [".whl"] (and ALT's directory
# when it is ignored by git).
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-threads}"
gpu_prologue
ad() {  # bench adaptive from the current directory: $1 the output's name
  timeout 170 python3 -m specsplit bench adaptive --backend torch --device cuda:0 --same-stack --repeats 2 \
    --colocated-draft 2>&1 | quiet | tee "$out/adaptive_$1.txt" | tail -9
}
if [ "$mode" = threads ]; then
  HEAD=8 probe b8_no_ahead 45 8 128 --outbox --colocated --no-round-ahead
  HEAD=8 probe b8_ahead 45 8 128 --outbox --colocated
  HEAD=8 probe b8_ahead_late 45 8 128 --late --colocated
elif [ "$mode" = services ]; then
  svc services "$(left 300)" --device cuda:0 --batch 1 8 --variants colocated+no-round-ahead colocated
elif [ "$mode" = adaptive ]; then
  alt="${3:?ALT: the other checkout (a directory)}"
  ad tree
  (cd "$alt" && PYTHONPATH="/tmp/site:$PWD" ad alt)
  ad tree2
else
  echo "unknown mode $mode"; exit 2
fi
