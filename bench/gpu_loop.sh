#!/usr/bin/env bash
# The round loop in the target service on two GPUs (nvidia-h200-x2): GPU tests of the loop
# variants, then `bench services` with every variant side by side. Run from the repository
# root (set-up: bench/gpu_env.sh). Usage: bash bench/gpu_loop.sh [OUT_DIR]
source "$(dirname "$0")/gpu_env.sh" "$@"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi -L
timeout 330 python3 -m pytest -m gpu tests/gpu/test_loop_gpu.py -s -q -p no:cacheprovider 2>&1 | tee "$out/loop_gpu_tests.txt" | grep -E "gpu x2 loop|passed|failed|Error|assert" | head -40
timeout 240 python3 -m specsplit bench services --backend torch --device cuda:1 --draft-device cuda:0 \
  --variants fixed ahead adaptive ahead+adaptive --batch 1 8 --prompts 8 --max-tokens 128 2>&1 | tee "$out/bench_services.txt" | tail -20
