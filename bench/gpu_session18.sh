#!/usr/bin/env bash
# Session 18 on the GPU host (one H200), one device call per mode:
#
#   bash bench/gpu_session18.sh OUT_DIR first   # session 17's last code on the GPU: the kernel GPU tests (the review mend,
#                                               # RoPE's swapped halves in registers), bench graphs (its `rope-swap`
#                                               # column), bench adaptive on the current kernels, bench services at batch 8
#   bash bench/gpu_session18.sh OUT_DIR head    # the output head's two launches fewer (Kernels.fuse_head) and the
#                                               # RoPE swap on: the kernel GPU tests, bench graphs (`no-head`,
#                                               # `no-rope-swap` columns); batch 8 on the bundled model: bench
#                                               # services in float32 and in bfloat16, bench profile --small
#   bash bench/gpu_session18.sh OUT_DIR final   # the final defaults: kernel, propose and round-loop GPU tests, bench
#                                               # graphs, bench services at batch 8 and 1, bench peer at batch 1
#
#   bash bench/gpu_session18.sh OUT_DIR short   # RoPE's tables read at each position inside the kernels (no gathers):
#                                               # the kernel GPU tests and bench graphs only
#   bash bench/gpu_session18.sh OUT_DIR next    # for the next session (not run yet): the split-K GEMMs in row blocks
#                                               # (Kernels.gemm_row_blocks): the kernel GPU tests (row blocks' bits,
#                                               # the bf16 batch-8 identity count), bench graphs (`row-blocks`),
#                                               # bench services at batch 8 in bfloat16
#   bash bench/gpu_session18.sh OUT_DIR last    # the final code, what the final call left out: bench profile (one ~1B
#                                               # round), bench adaptive, bench peer at batch 8 (both models)
#
# Set-up: bench/gpu_env.sh (the pinned wheels in .whl/, see docs/gpu.md).
source "$(dirname "$0")/gpu_env.sh" "$@"
mode="${2:-first}"
gpu_prologue
case "$mode" in
first|head|short|next) tests=(tests/gpu/test_kernels_gpu.py) ;;
last) tests=() ;;
final) tests=(tests/gpu/test_kernels_gpu.py tests/gpu/test_propose_gpu.py tests/gpu/test_loop_gpu.py) ;;
*) echo "unknown mode $mode"; exit 2 ;;
esac
[ ${#tests[@]} -gt 0 ] && timeout 240 python3 -m pytest -q -s -p no:cacheprovider -m gpu "${tests[@]}" 2>&1 | tee "$out/gpu_tests.log" \
  | grep -E "passed|failed|error|Error|assert|\[gpu" | tail -16
[ "$mode" != last ] && timeout 180 python3 -m specsplit bench graphs --device cuda:0 2>&1 | quiet | tee "$out/bench_graphs.txt" | tail -3
if [ "$mode" = first ]; then
  timeout 200 python3 -m specsplit bench adaptive --backend torch --device cuda:0 --prompts 8 --max-tokens 128 \
    --repeats 3 2>&1 | quiet | tee "$out/adaptive.txt" | tail -12
  timeout "$(left 570)" python3 -m specsplit bench services --backend torch --device cuda:0 --batch 8 --prompts 16 \
    --max-tokens 128 2>&1 | quiet | tee "$out/services.txt" | tail -6
elif [ "$mode" = last ]; then
  timeout 100 python3 -m specsplit bench profile --device cuda:0 2>&1 | quiet | tee "$out/bench_profile.txt" | tail -30
  timeout 200 python3 -m specsplit bench adaptive --backend torch --device cuda:0 --prompts 8 --max-tokens 128 \
    --repeats 3 2>&1 | quiet | tee "$out/adaptive.txt" | tail -12
  timeout "$(left 570)" python3 -m specsplit bench peer --device cuda:0 --batch 8 --prompts 8 --max-tokens 128 \
    2>&1 | quiet | tee "$out/bench_peer_b8.txt" | tail -3
elif [ "$mode" = next ]; then
  timeout "$(left 570)" python3 -m specsplit bench services --backend torch --device cuda:0 --batch 8 --prompts 16 \
    --max-tokens 128 --dtype bfloat16 2>&1 | quiet | tee "$out/services_bf16.txt" | tail -4
elif [ "$mode" = head ]; then
  timeout 120 python3 -m specsplit bench services --backend torch --device cuda:0 --batch 8 --prompts 16 \
    --max-tokens 128 --dtype bfloat16 2>&1 | quiet | tee "$out/services_bf16.txt" | tail -4
  timeout "$(left 570)" python3 -m specsplit bench profile --small --batch 8 --device cuda:0 2>&1 | quiet \
    | tee "$out/profile_small.txt" | tail -40
elif [ "$mode" = final ]; then
  timeout 150 python3 -m specsplit bench services --backend torch --device cuda:0 --batch 8 1 --prompts 16 \
    --max-tokens 128 2>&1 | quiet | tee "$out/services.txt" | tail -6
  timeout "$(left 570)" python3 -m specsplit bench peer --device cuda:0 --batch 1 --prompts 8 --max-tokens 128 \
    2>&1 | quiet | tee "$out/bench_peer.txt" | tail -3
fi
