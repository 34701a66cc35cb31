#!/usr/bin/env bash
# Issue 15 on a four-GPU host (nvidia-h200-x4), one device call per mode:
#
#   bash bench/gpu_tp4.sh OUT_DIR tests    # test_tp_gpu: TP=2 and TP=3 (uneven shares) == TP=1, graphs,
#                                          # RECAPTURE; the draft alone on cuda:TP; test_tp_reload_gpu:
#                                          # 20 reloads under traffic, tokens exact, memory per GPU
#   bash bench/gpu_tp4.sh OUT_DIR bench    # bench tp --tp 2 3 (~1B verify step, TP=1/2/3 side by side);
#                                          # bench services --tp 1 2 3 on the ~1B config, target-only and
#                                          # k=3, batch 1 and 8, target on cuda:0.., the draft alone on cuda:3
#
# NCCL with NVLink multicast off. Set-up: bench/gpu_env.sh (the pinned wheels in .whl/).
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-tests}"
gpu_prologue
case "$mode" in
tests)
  timeout 540 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_tp_gpu.py \
    tests/gpu/test_tp_reload_gpu.py 2>&1 | tee "$out/tp_tests.log" | grep -E "^\[gpu|passed|failed|skipped|error|Error|assert"
  ;;
bench)
  timeout 240 python3 -m specsplit bench tp --backend torch --device cuda:0 --tp 2 3 2>&1 | quiet \
    | tee "$out/bench_tp.txt" | tail -8
  python3 -c "from pathlib import Path; from bench.peer import write_random_1b; write_random_1b(Path('/tmp/1b'))"
  cp models/tiny/heldout_prompts.json /tmp/1b/          # the prompts bench services decodes
  timeout 300 python3 -m specsplit bench services --backend torch --model /tmp/1b --dtype bfloat16 \
    --device cuda:0 --draft-device cuda:3 --tp 1 2 3 --batch 1 8 --prompts 8 --max-tokens 64 --k 3 2>&1 \
    | quiet | tee "$out/bench_services_tp.txt" | tail -14
  ;;
*)
  echo "unknown mode $mode" >&2; exit 2
  ;;
esac
