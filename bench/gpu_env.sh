# Sourced by the bench/gpu_*.sh scripts (never run alone): repository root as the
# working directory, OUT_DIR ($1) created as $out, and the GPU host's Python set up:
# structlog and the pinned grpc/protobuf wheels from .whl/ (see docs/gpu.md) on
# PYTHONPATH ahead of the host's own packages.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-${OUT:-.out/gpu}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# What the session scripts share: NCCL with NVLink multicast off (KINDS.md), the seconds a call has left, a filter
# for the services' log lines, pytest -m gpu on some files, bench services and the round host probe on the bundled
# model, and the run's date, GPUs and commit in $out/env.txt.
left() { echo $(( ${1:-${LIMIT:-585}} - SECONDS )); }   # seconds left of a call's $1 (default $LIMIT, else 585)
quiet() { grep -v -E "^20[0-9][0-9]-|USDT|Warning|warn"; }
svc() {  # bench services on the bundled model: $1 the output's name, $2 the seconds it may take, then extra flags
  local name="$1" limit="$2"; shift 2
  timeout "$limit" python3 -m specsplit bench services --backend torch --prompts 16 --max-tokens 128 "$@" 2>&1 \
    | quiet | tee "$out/$name.txt" | tail -14
}
probe() {  # scripts/round_host_probe.py on the bundled model, cuda:0: $1 the output's name, $2 its seconds, then its args
  local name="$1" limit="$2"; shift 2
  timeout "$limit" python3 scripts/round_host_probe.py models/tiny cuda:0 "$@" 2>&1 | quiet | tee "$out/$name.txt" \
    | head -"${HEAD:-70}"
}
gpu_tests() {  # pytest -m gpu on the files given: $1 the log's name, $2 its seconds
  local name="$1" limit="$2"; shift 2
  timeout "$limit" python3 -m pytest -q -s -p no:cacheprovider -m gpu "$@" 2>&1 | tee "$out/$name.log" \
    | grep -E "passed|failed|error|Error|assert|\[gpu " | tail -12
}
gpu_prologue() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  { date -u; nvidia-smi --query-gpu=index,name --format=csv,noheader; git log --oneline -1; } | tee "$out/env.txt"
}
