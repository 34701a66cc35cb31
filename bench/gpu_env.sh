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
