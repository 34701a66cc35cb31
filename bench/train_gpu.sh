#!/usr/bin/env bash
# Trains the bundled tiny model (models/tiny) on one GPU: the exact command that
# produced the shipped weights (see models/tiny/README.md for its results).
#
#   bench/train_gpu.sh [OUT_DIR]        # default: $OUT, else .out/tiny
#
# Needs only python3 with torch (CUDA) and numpy: no paddle, structlog or tqdm.
# Corpus: the .py sources of that python3's own standard library. The time
# budgets cut the step counts if the GPU is slower than an H200 (the cut is
# printed and recorded in train_log.json). Writes at most 8 files: config.json,
# two fp32 shards + index, mtp.safetensors (unroll 3), mtp_naive.safetensors
# (unroll 1), heldout_prompts.json, train_log.json.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-.out/tiny}}"
mkdir -p "$out"
PYTHONUNBUFFERED=1 exec python3 -m training.torch_train \
  --out "$out" --device cuda --seed 0 \
  --steps 3000 --batch 64 --seq-len 512 --lr 3e-3 --warmup 150 \
  --mtp-steps 2000 --mtp-unroll 3 --naive-head --mtp-lr 2e-3 --mtp-distill 1.0 \
  --target-budget-s 220 --mtp-budget-s 100 \
  --shard-bytes 13000000 --prompts 64 --eval-acceptance --no-progress
