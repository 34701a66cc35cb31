#!/usr/bin/env bash
# Session 30's changes on one GPU (issue 10; docs/performance.md § Session 30), none of them run on a GPU yet:
# the chain step's glue in 19 kernels instead of 38, the chained verify's host work (no request rebuilt, no host
# layout), the token checks as Python ints; and session 29's open questions.
#
#   bash bench/gpu_session30.sh OUT_DIR first     # the gpu tests of rounds queued ahead, decode ahead and the fused
#                                                 # propose; the round host at batch 1 and 8 with the draft in the
#                                                 # process (each phase's CPU per round by thread: who holds the
#                                                 # interpreter at batch 8?), a profiler pass at batch 1 (kernels a
#                                                 # round: 251 in § Session 28), bench services at batch 1 and 8
#   bash bench/gpu_session30.sh OUT_DIR ab ALT    # the round host at batch 1 and 8 on this tree, on the checkout ALT
#                                                 # (`git worktree add .alt 9a08434`: session 29's code; carry it),
#                                                 # then this tree again: what session 30's changes did on this host
#   bash bench/gpu_session30.sh OUT_DIR peer      # bench peer on the bundled model with the draft in the process
#                                                 # (services against the in-process engine after the mmap threshold
#                                                 # change of § Session 29), then the loop tests with it
#   bash bench/gpu_session29.sh OUT_DIR adaptive ALT   # adaptive k side by side (session 29's script)
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md); carry [".whl"] (and ".alt" for ab).
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-first}"
gpu_prologue
if [ "$mode" = first ]; then
  gpu_tests gpu_tests_first 200 tests/gpu/test_round_ahead_gpu.py tests/gpu/test_decode_ahead_gpu.py \
    tests/gpu/test_propose_gpu.py
  HEAD=6 probe ahead_b1 45 1 128 --outbox --colocated
  HEAD=6 probe ahead_b8 45 8 128 --outbox --colocated
  HEAD=6 probe no_ahead_b8 45 8 128 --outbox --colocated --no-round-ahead
  [ "$(left)" -gt 100 ] && HEAD=40 probe ahead_b1_profile 60 1 128 --outbox --colocated --torch-profile 14
  [ "$(left)" -gt 120 ] && svc services "$(( $(left) - 10 ))" --device cuda:0 --batch 1 8 \
    --variants colocated+no-round-ahead colocated
elif [ "$mode" = ab ]; then
  alt="${3:?ALT: the other checkout (a directory inside the tree, carried)}"
  for tree in . "$alt" .; do
    tag=$([ "$tree" = . ] && echo tree || echo alt)
    (cd "$tree" && HEAD=4 PYTHONPATH="/tmp/site:$PWD" probe "ab_${tag}_b1" 45 1 128 --outbox --colocated)
    (cd "$tree" && HEAD=4 PYTHONPATH="/tmp/site:$PWD" probe "ab_${tag}_b8" 45 8 128 --outbox --colocated)
  done
elif [ "$mode" = peer ]; then
  timeout 330 python3 -m specsplit bench peer --small --device cuda:0 --colocated-draft --batch 1 8 2>&1 | quiet \
    | tee "$out/peer.txt" | tail -24
  [ "$(left)" -gt 90 ] && gpu_tests gpu_tests_loop "$(( $(left) - 10 ))" tests/gpu/test_loop_gpu.py -k colocated
else
  echo "unknown mode $mode"; exit 2
fi
