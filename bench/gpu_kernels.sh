#!/usr/bin/env bash
# The fused decoder-layer kernels on the GPU host, one device call:
#
#   bash bench/gpu_kernels.sh OUT_DIR
#
# The kernels' GPU tests (each kernel vs the plain ops, fp32 and bf16; the bundled
# model's greedy tokens with the kernels under graphs equal the plain ops'), `bench
# graphs` (each step fused vs the same bare step on the plain ops, side by side) and
# `bench peer` (transformers static cache vs the engine and the services; draft on
# cuda:1 when there are two GPUs). Set-up: bench/gpu_env.sh.
source "$(dirname "$0")/gpu_env.sh" "$@"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
{ date -u; nvidia-smi --query-gpu=index,name --format=csv,noheader; } | tee "$out/env.txt"
timeout 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_kernels_gpu.py 2>&1 \
  | tee "$out/gpu_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert"
timeout 150 python3 -m specsplit bench graphs --device cuda:0 2>&1 | grep -v USDT | tee "$out/bench_graphs.txt" | tail -16
timeout 280 python3 -m specsplit bench peer --device cuda:0 --prompts 8 --max-tokens 128 2>&1 \
  | grep -v -E "USDT|Warning|warn" | tee "$out/bench_peer.txt" | tail -8
