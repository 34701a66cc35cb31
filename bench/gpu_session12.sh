#!/usr/bin/env bash
# Session 12 on the GPU host (one H200: draft and target share cuda:0), one device call per mode:
#
#   bash bench/gpu_session12.sh OUT_DIR first   # adaptive k with its rounds broken down (bench adaptive, 3
#                                               # interleaved repeats: the share of rounds at each k and the
#                                               # round split per cell), then bench services at batch 8 and 1
#                                               # with the draft in float32 (as served) and in bfloat16
#   bash bench/gpu_session12.sh OUT_DIR second  # after the wide catch-up's graph passes: bench adaptive (each
#                                               # prompt through every column in turn, 3 repeats), then bench
#                                               # services at batch 8 and 1, the draft in float32 and bfloat16
#                                               # side by side
#   bash bench/gpu_session12.sh OUT_DIR third   # the catchup{4(k+1)} head passes and the kept policy values:
#                                               # bench adaptive with every round recorded (scripts/round_probe,
#                                               # summed by scripts/round_trace.py), bench services at batch 8
#                                               # and 1 with the draft dtypes in the other order (bfloat16 first),
#                                               # the propose and round-loop GPU tests, 20 RECAPTURE reloads
#   bash bench/gpu_session12.sh OUT_DIR final   # round_k_star's kept best k: bench adaptive with every round
#                                               # recorded, then bench peer on the bundled model at batch 1 and 8
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md).
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-first}"
gpu_prologue
services() {   # $1: file name, then extra bench services flags
  local name="$1"; shift
  timeout 150 python3 -m specsplit bench services --backend torch --device cuda:0 --batch 8 1 --prompts 16 \
    --max-tokens 128 "$@" 2>&1 | quiet | tee "$out/$name.txt" | tail -6
}
traced_adaptive() {   # $1: timeout seconds; bench adaptive with every round recorded, then their summary
  mkdir -p "$out/rounds"
  ROUND_PROBE_DIR="$out/rounds" PYTHONPATH="$PYTHONPATH:$PWD/scripts/round_probe" timeout "$1" python3 -m specsplit \
    bench adaptive --backend torch --device cuda:0 --prompts 8 --max-tokens 128 --repeats 3 2>&1 | quiet \
    | tee "$out/adaptive.txt" | tail -12
  python3 scripts/round_trace.py "$out/rounds" | tee "$out/round_trace.txt"
}
case "$mode" in
first)
  timeout 240 python3 -m specsplit bench adaptive --backend torch --device cuda:0 --prompts 8 --max-tokens 128 \
    --repeats 3 2>&1 | quiet | tee "$out/adaptive.txt" | tail -12
  services services_fp32
  services services_draft_bf16 --draft-dtype bfloat16
  ;;
second)
  timeout 300 python3 -m specsplit bench adaptive --backend torch --device cuda:0 --prompts 8 --max-tokens 128 \
    --repeats 3 2>&1 | quiet | tee "$out/adaptive.txt" | tail -12
  timeout "$(left 580)" python3 -m specsplit bench services --backend torch --device cuda:0 --batch 8 1 --prompts 16 \
    --max-tokens 128 --draft-dtype float32 bfloat16 2>&1 | quiet | tee "$out/services_draft_dtype.txt" | tail -10
  ;;
third)
  traced_adaptive 200
  timeout 140 python3 -m specsplit bench services --backend torch --device cuda:0 --batch 8 1 --prompts 16 \
    --max-tokens 128 --draft-dtype bfloat16 float32 2>&1 | quiet | tee "$out/services_draft_dtype.txt" | tail -10
  timeout 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_propose_gpu.py tests/gpu/test_loop_gpu.py \
    2>&1 | tee "$out/gpu_tests.log" | grep -E "^\[gpu|passed|failed|error|Error|assert" | tail -20
  SPECSPLIT_RELOAD_CYCLES=20 timeout "$(left 585)" python3 -m pytest -q -s -p no:cacheprovider -p bench.reload_probe \
    -m gpu tests/gpu/test_reload_gpu.py 2>&1 | tee "$out/reload_probe.log" | grep -E "RECAPTURE|passed|failed|probe" | tail -8
  ;;
final)
  traced_adaptive 220
  timeout "$(left 500)" python3 -m specsplit bench peer --device cuda:0 --small --batch 1 8 --prompts 8 \
    --max-tokens 128 2>&1 | quiet | tee "$out/bench_peer.txt" | tail -8
  ;;
*) echo "unknown mode $mode"; exit 2 ;;
esac
