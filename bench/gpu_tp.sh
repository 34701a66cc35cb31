#!/usr/bin/env bash
# The tensor-parallel target on two GPUs (nvidia-h200-x2), one device call:
#
#   bash bench/gpu_tp.sh OUT_DIR
#
# The TP GPU test (TP=2 tokens identical to TP=1, graphs captured with the collectives
# inside, again after a RECAPTURE) and `bench tp` (verify step TP=1 vs TP=2 at batch 1
# and 32 on the ~1B config, and the control plane's cost per step). NCCL with NVLink
# multicast off. Set-up: bench/gpu_env.sh.
source "$(dirname "$0")/gpu_env.sh" "$@"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
{ date -u; nvidia-smi --query-gpu=index,name --format=csv,noheader; } | tee "$out/env.txt"
timeout 250 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_tp_gpu.py 2>&1 \
  | tee "$out/gpu_tests.log" | grep -E "^\[gpu|passed|failed|skipped|error|Error|assert"
timeout 300 python3 -m specsplit bench tp --backend torch --device cuda:0 --tp 2 2>&1 \
  | grep -v -E "^20|USDT|Warning|warn" | tee "$out/bench_tp.txt" | tail -8
