#!/usr/bin/env bash
# Every GPU proof and benchmark in one device call (nvidia-h200-x2: two H200s).
#
#   bash bench/gpu_all.sh OUT_DIR
#
# The GPU host has Torch (CUDA) but no Paddle and no structlog: structlog and
# the pinned grpc/protobuf wheels are installed from .whl/ first (see
# docs/gpu.md). Logs land in OUT_DIR; a short summary is printed last.
source "$(dirname "$0")/gpu_env.sh" "$@"
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv;
  python3 -c "import torch, grpc, google.protobuf as pb; print('torch', torch.__version__, 'grpc', grpc.__version__, 'protobuf', pb.__version__)"; } | tee "$out/env.txt"
timeout 270 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee "$out/gpu_tests.log" | grep -E "^\[gpu|passed|failed|error|Error" 
timeout 150 python3 -m specsplit bench graphs --device cuda:0 2>&1 | tee "$out/bench_graphs.txt"
timeout 100 python3 -m specsplit bench reload --device cuda:0 2>&1 | tee "$out/bench_reload.txt"
timeout 50 python3 -m specsplit bench engine --backend torch --device cuda:0 --prompts 8 --max-tokens 128 2>&1 | tee "$out/bench_engine_cuda.txt"
