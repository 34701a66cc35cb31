#!/usr/bin/env bash
# Session 31 on one GPU (issue 10; docs/gpu.md § Session 31): session 30's code (chain glue in 19 kernels, the chained
# verify's host cuts) had not run on a GPU. One call (`all`: the two below, cut to fit 585 s) or two:
#
#   bash bench/gpu_session31.sh OUT_DIR all     # the gpu tests, bench services at batch 8 and 1, then the ~1B peer
#                                               # at batch 1 while time is left
#   bash bench/gpu_session31.sh OUT_DIR first   # the gpu tests of rounds queued ahead, decode ahead and the fused
#                                               # propose; the round host at batch 1 and 8 (draft in the process, each
#                                               # phase's CPU by thread); bench services at batch 1 and 8 (target-only,
#                                               # the colocated draft without and with rounds queued ahead)
#   bash bench/gpu_session31.sh OUT_DIR large   # bench peer on the ~1B bf16 config alone at batch 1 (issue 10's
#                                               # 1,000 tok/s target-only through the services; § Session 24 ran it on
#                                               # an H100: 927), then the loop tests with the colocated draft
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md); carry [".whl"].
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-first}"
gpu_prologue
if [ "$mode" = all ]; then
  gpu_tests gpu_tests_first 170 tests/gpu/test_round_ahead_gpu.py tests/gpu/test_decode_ahead_gpu.py \
    tests/gpu/test_propose_gpu.py
  svc services 200 --device cuda:0 --batch 8 1 --variants colocated+no-round-ahead colocated
  [ "$(left)" -gt 150 ] && timeout "$(( $(left) - 5 ))" python3 -m specsplit bench peer --large --device cuda:0 \
    --batch 1 2>&1 | quiet | tee "$out/peer_large.txt" | tail -6
elif [ "$mode" = first ]; then
  gpu_tests gpu_tests_first 200 tests/gpu/test_round_ahead_gpu.py tests/gpu/test_decode_ahead_gpu.py \
    tests/gpu/test_propose_gpu.py
  HEAD=8 probe ahead_b1 45 1 128 --outbox --colocated
  HEAD=8 probe ahead_b8 45 8 128 --outbox --colocated
  [ "$(left)" -gt 120 ] && svc services "$(( $(left) - 10 ))" --device cuda:0 --batch 1 8 \
    --variants colocated+no-round-ahead colocated
elif [ "$mode" = large ]; then
  timeout 420 python3 -m specsplit bench peer --large --device cuda:0 --batch 1 2>&1 | quiet \
    | tee "$out/peer_large.txt" | tail -8
  [ "$(left)" -gt 90 ] && gpu_tests gpu_tests_loop "$(( $(left) - 10 ))" tests/gpu/test_loop_gpu.py -k colocated
else
  echo "unknown mode $mode"; exit 2
fi
