#!/usr/bin/env bash
# Set up .venv if needed, then run the tests offline (CI runs exactly this, through .ci/run).
# Without arguments, everything CI checks: lint (ruff check, ruff format --check), the whole suite on every core
# (pytest-xdist; LOOPVQ_TEST_WORKERS sets the number of workers) with the 20 slowest tests printed, then the Triton
# kernels' tests (k-means, nearest codeword, decode attention) in Triton's CPU interpreter (TRITON_INTERPRET=1, when
# triton is installed; they skip in the first pass without a GPU).
# With arguments, only pytest with them, on every core: scripts/test.sh -m "not slow" is the quick loop,
# scripts/test.sh tests/codes one folder, scripts/test.sh -n 0 -x tests/codes/test_codec.py one file in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
workers="${LOOPVQ_TEST_WORKERS:-logical}"  # every logical core (auto counts physical ones only)
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q -n "$workers" "$@"
fi
echo "lint: ruff check, ruff format --check"
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -q -n "$workers" --durations=20
if .venv/bin/python -c "import triton" 2>/dev/null; then
  echo "fused Triton k-means and decode-attention kernels in Triton's CPU interpreter (TRITON_INTERPRET=1):"
  TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -n "$workers" -k "triton or fused" tests/kernels/test_kmeans_kernels.py \
    tests/calibration/kmeans/test_kmeans_solvers.py tests/calibration/kmeans/test_kmeans_init.py
  TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -n "$workers" -m "not slow" tests/serving/test_decode_attention.py \
    tests/serving/test_decode_attention_dispatch.py
fi
