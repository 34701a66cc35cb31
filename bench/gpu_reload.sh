#!/usr/bin/env bash
# Worker-owned weight swaps on one H200 (nvidia-h200), one device call:
#
#   bash bench/gpu_reload.sh OUT_DIR
#
# The reload GPU tests (20 RECAPTURE cycles through the swap RPCs: memory flat,
# teardown order; pinned streaming of checkpoint bytes into tensors) and
# `bench reload` on the ~1B config (RECAPTURE, IN_PLACE, IN_PLACE with preload,
# against reading the files). Set-up: bench/gpu_env.sh.
source "$(dirname "$0")/gpu_env.sh" "$@"
{ date -u; nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader; } | tee "$out/env.txt"
timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_fill_gpu.py tests/gpu/test_reload_gpu.py \
  2>&1 | tee "$out/gpu_tests.log" | grep -E "^reload on|^ *[0-9]+ +[AB] |RECAPTURE median|passed|failed|error|Error|assert" | tail -30
timeout 240 python3 -m specsplit bench reload --device cuda:0 2>&1 | grep -v -E "USDT|Warning|warn" | tee "$out/bench_reload.txt" | tail -14
