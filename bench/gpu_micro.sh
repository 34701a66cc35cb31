#!/usr/bin/env bash
# Two micro-batches overlapped (spec.micro_batches) on the GPU host, one device call:
#
#   bash bench/gpu_micro.sh OUT_DIR
#
# The micro-batch GPU tests (identical to target-only through the public client) and
# `bench services` with the fixed and micro variants side by side. Draft on cuda:0 and
# target on cuda:1 on a two-GPU host, both on cuda:0 on a one-GPU host. Set-up: bench/gpu_env.sh.
source "$(dirname "$0")/gpu_env.sh" "$@"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
{ date -u; nvidia-smi --query-gpu=index,name --format=csv,noheader; } | tee "$out/env.txt"
target=cuda:0
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && target=cuda:1
timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_loop_gpu.py -k micro 2>&1 \
  | tee "$out/gpu_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert"
timeout 300 python3 -m specsplit bench services --backend torch --device "$target" --draft-device cuda:0 \
  --variants fixed micro --batch 1 4 8 --prompts 8 --max-tokens 128 2>&1 | grep -v -E "^20|USDT|Warning|warn" \
  | tee "$out/bench_services.txt" | tail -10
