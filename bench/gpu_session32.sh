#!/usr/bin/env bash
# Session 32 on one GPU (issue 10; docs/gpu.md § Session 32): the figures issue 10 asks that session 31's run
# (bench/gpu_session31.sh all) left out, and this session's changes against the code before them.
#
#   bash bench/gpu_session32.sh OUT_DIR measure   # bench graphs on the ~1B config (the verify step against the
#                                                 # weight floor at contexts 256 and 2,048), bench services at
#                                                 # batch 8 twice more (the x1.8 goal), then bench adaptive
#                                                 # (same stack, colocated draft) while time is left
#   bash bench/gpu_session32.sh OUT_DIR trace ALT # bench adaptive (same stack, colocated draft) with its rounds
#                                                 # traced (scripts/round_probe, scripts/round_trace.py --groups),
#                                                 # bench services at batch 8 and 1 (colocated draft) on this tree
#                                                 # and on the checkout ALT (a worktree inside the tree), then while
#                                                 # time is left bench adaptive traced on ALT and every one-GPU
#                                                 # test file but the loop file (LIMIT=S: the call's seconds,
#                                                 # where less device time is left than 585)
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md); carry [".whl"], and ALT for trace
# (a git worktree is a nested repository: the device tool copies its files only when carry names it; leave its
# models/ out, a link to the tree's is made here, to stay under the 64 MiB a call carries).
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-measure}"
ROOT="$PWD"
gpu_prologue
if [ "$mode" = measure ]; then
  timeout 200 python3 -m specsplit bench graphs --device cuda:0 2>&1 | quiet | tee "$out/graphs.txt" | tail -16
  for n in 1 2; do svc "services_b8_$n" 100 --device cuda:0 --batch 8 --variants colocated; done
  [ "$(left)" -gt 120 ] && timeout "$(( $(left) - 5 ))" python3 -m specsplit bench adaptive --backend torch \
    --device cuda:0 --same-stack --repeats 2 --colocated-draft 2>&1 | quiet | tee "$out/adaptive.txt" | tail -20
elif [ "$mode" = trace ]; then
  alt="${3:?ALT: the other checkout (a directory inside the tree)}"
  [ -e "$alt/models" ] || ln -s ../models "$alt/models"
  adaptive_traced() {  # $1 tree or alt: bench adaptive with its rounds traced, then their summary
    local tree=$([ "$1" = tree ] && echo . || echo "$alt")
    rm -rf "/tmp/rt_$1" && mkdir -p "/tmp/rt_$1"
    (cd "$tree" && ROUND_PROBE_DIR="/tmp/rt_$1" PYTHONPATH="$ROOT/scripts/round_probe:/tmp/site:$PWD" \
      timeout 150 python3 -m specsplit bench adaptive --backend torch --device cuda:0 --same-stack --repeats 2 \
      --colocated-draft 2>&1 | quiet | tee "$out/adaptive_$1.txt" | tail -9)
    python3 scripts/round_trace.py "/tmp/rt_$1" --groups warm:2,heldout:8,random:8,mix:8 | tee "$out/trace_$1.txt"
  }
  adaptive_traced tree
  [ "$(left)" -gt 60 ] && svc services_tree 90 --device cuda:0 --batch 8 1 --variants colocated
  [ "$(left)" -gt 60 ] && (cd "$alt" && PYTHONPATH="/tmp/site:$PWD" svc services_alt 90 --device cuda:0 --batch 8 1 \
    --variants colocated)
  [ "$(left)" -gt 160 ] && adaptive_traced alt
  [ "$(left)" -gt 150 ] && timeout "$(( $(left) - 10 ))" python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu \
    --ignore tests/gpu/test_loop_gpu.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|error|Error|assert" | tail -12
else
  echo "unknown mode $mode"; exit 2
fi
