#!/usr/bin/env bash
# Session 19 on the GPU host (one H200), one device call per mode:
#
#   bash bench/gpu_session19.sh OUT_DIR inv     # batch-invariant steps (runtime.batch_invariant): the GPU tests
#                                               # (tests/gpu/test_invariant_gpu.py, the kernel file with the row
#                                               # blocks' fix), bench graphs (`row-blocks`, `invariant` columns),
#                                               # bench services at batch 8: bfloat16 with and without the switch,
#                                               # float32 with it
#   bash bench/gpu_session19.sh OUT_DIR rows    # the invariant GEMMs in row blocks of 32 (Kernels.invariant_rows),
#                                               # the partials of padded rows no longer written: the same GPU tests
#                                               # and bench graphs; bench services at batch 8: bfloat16 with the
#                                               # switch, float32 with it and without
#   bash bench/gpu_session19.sh OUT_DIR last    # partials masked by row on the 32-row tiles only: the same GPU tests
#                                               # and bench graphs (+ `invariant-16`); bf16 services with the switch
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md).
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-inv}"
gpu_prologue
case "$mode" in
inv|rows|last) ;;
*) echo "unknown mode $mode"; exit 2 ;;
esac
svc() {  # bench services at batch 8 on the bundled model: $1 the output's name, then extra flags
  local name="$1"; shift
  timeout "$(left 575)" python3 -m specsplit bench services --backend torch --device cuda:0 --batch 8 --prompts 16 \
    --max-tokens 128 "$@" 2>&1 | quiet | tee "$out/$name.txt" | tail -3
}
timeout 300 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_invariant_gpu.py \
  tests/gpu/test_kernels_gpu.py 2>&1 | tee "$out/gpu_tests.log" \
  | grep -E "passed|failed|error|Error|assert|\[gpu" | tail -16
timeout 170 python3 -m specsplit bench graphs --device cuda:0 2>&1 | quiet | tee "$out/bench_graphs.txt" | tail -14
svc services_bf16_inv --dtype bfloat16 --batch-invariant
if [ "$mode" = inv ]; then svc services_bf16 --dtype bfloat16; fi
if [ "$mode" != last ]; then svc services_fp32_inv --batch-invariant; fi
if [ "$mode" = rows ]; then svc services_fp32; fi
