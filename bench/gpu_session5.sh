#!/usr/bin/env bash
# Session 5's final code on the GPU host, one device call:
#
#   bash bench/gpu_session5.sh OUT_DIR
#
# Every `gpu` test (the fused kernels and the inline device steps are on by default, so
# every earlier GPU test now runs through them), then `bench adaptive` (adaptive k against
# every fixed k on held-out, random and mixed prompts). Set-up: bench/gpu_env.sh.
source "$(dirname "$0")/gpu_env.sh" "$@"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
{ date -u; nvidia-smi --query-gpu=index,name --format=csv,noheader; } | tee "$out/env.txt"
timeout 400 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu --durations=0 2>&1 \
  | tee "$out/gpu_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert|^[0-9.]+s call" | tail -45
timeout 150 python3 -m specsplit bench adaptive --backend torch --device cuda:0 --prompts 8 --max-tokens 128 2>&1 \
  | grep -v -E "^20|USDT|Warning|warn" | tee "$out/bench_adaptive.txt" | tail -8
