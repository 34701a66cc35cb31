#!/usr/bin/env bash
# Fast-path proofs and measurements in one device call (nvidia-h200: one H200).
#
#   bash bench/gpu_fastpath.sh OUT_DIR [attention|peer]
#
# GPU tests of the fast path and the graph registry, `bench graphs` (context
# buckets, host time, weight floor), `bench profile` (one round at batch 1);
# with "attention": the fast-path GPU tests and `bench attention --compile`;
# with "peer": `bench peer` instead; with "fused": the fast-path GPU tests,
# `bench graphs`, `bench profile` and `bench peer --batch 1`; with "compile":
# `bench graphs --compile` and `bench peer --batch 1 --compile`; with "final":
# every one-GPU `gpu` test, `bench graphs` and `bench services --variants fixed adaptive`.
# Set-up (wheels from .whl/): bench/gpu_env.sh.
source "$(dirname "$0")/gpu_env.sh" "$@"
date -u | tee "$out/env.txt"
if [ "${2:-}" = "attention" ]; then
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_fastpath_gpu.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert"
  timeout 300 python3 -m specsplit bench attention --device cuda:0 --compile 2>&1 | grep -v -E "USDT|Warning|_warn_once" | tee "$out/bench_attention.txt"
  exit 0
fi
if [ "${2:-}" = "fused" ]; then
  timeout 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_fastpath_gpu.py tests/gpu/test_graphs_gpu.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert"
  timeout 120 python3 -m specsplit bench graphs --device cuda:0 2>&1 | grep -v USDT | tee "$out/bench_graphs.txt" | tail -16
  timeout 90 python3 -m specsplit bench profile --device cuda:0 2>&1 | grep -v -E "USDT|Warning|_warn_once" | tee "$out/profile.txt"
  timeout 200 python3 -m specsplit bench peer --device cuda:0 --batch 1 --prompts 8 --max-tokens 128 2>&1 | grep -v -E "USDT|Warning|warn" | tee "$out/bench_peer.txt" | tail -5
  exit 0
fi
if [ "${2:-}" = "final" ]; then
  timeout 250 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|error|Error|assert" | tail -15
  timeout 110 python3 -m specsplit bench graphs --device cuda:0 2>&1 | grep -v USDT | tee "$out/bench_graphs.txt" | tail -16
  timeout 200 python3 -m specsplit bench services --backend torch --device cuda:0 --variants fixed adaptive --batch 1 8 --prompts 8 --max-tokens 128 2>&1 | grep -v -E "^20|USDT|Warning|warn" | tee "$out/bench_services.txt" | tail -8
  exit 0
fi
if [ "${2:-}" = "compile" ]; then
  timeout 200 python3 -m specsplit bench graphs --device cuda:0 --compile 2>&1 | grep -v USDT | tee "$out/bench_graphs_compile.txt" | tail -16
  timeout 380 python3 -m specsplit bench peer --device cuda:0 --batch 1 --prompts 8 --max-tokens 128 --compile 2>&1 | grep -v -E "USDT|Warning|warn" | tee "$out/bench_peer_compile.txt" | tail -5
  exit 0
fi
if [ "${2:-}" = "peer" ]; then
  timeout 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_fastpath_gpu.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert"
  timeout 330 python3 -m specsplit bench peer --device cuda:0 --prompts 8 --max-tokens 128 2>&1 | grep -v -E "USDT|Warning|warn" | tee "$out/bench_peer.txt"
  timeout 100 python3 -m specsplit bench graphs --device cuda:0 2>&1 | grep -v USDT | tee "$out/bench_graphs.txt"
  exit 0
fi
timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_fastpath_gpu.py tests/gpu/test_graphs_gpu.py 2>&1 | tee "$out/gpu_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert"
timeout 200 python3 -m specsplit bench graphs --device cuda:0 2>&1 | grep -v USDT | tee "$out/bench_graphs.txt"
timeout 120 python3 -m specsplit bench profile --device cuda:0 2>&1 | grep -v -E "USDT|Warning|_warn_once" | tee "$out/profile_after.txt"
