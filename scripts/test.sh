#!/usr/bin/env bash
# Set up .venv if needed, then run the tests offline (CI runs exactly this, through .ci/run). Without
# arguments: the whole suite, then the Triton kernels' tests (k-means, decode attention) in Triton's CPU interpreter
# (TRITON_INTERPRET=1, when triton is installed; they skip in the first pass without a GPU). With arguments,
# only pytest with them: scripts/test.sh -m "not slow" is the quick loop, scripts/test.sh tests/calibration/kmeans/test_kmeans.py
# one file.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
.venv/bin/python -m pytest -q "$@"
if [ $# -eq 0 ] && .venv/bin/python -c "import triton" 2>/dev/null; then
  echo "fused Triton k-means and decode-attention kernels in Triton's CPU interpreter (TRITON_INTERPRET=1):"
  TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -k "triton or fused" tests/kernels/test_kmeans_kernels.py tests/calibration/kmeans/test_kmeans_solvers.py
  TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -m "not slow" tests/serving/test_decode_attention.py
fi
