#!/usr/bin/env bash
# Set up .venv if needed, then run the tests offline (CI runs exactly this, through .ci/run). Extra arguments
# go to pytest: scripts/test.sh -m "not slow" is the quick loop, scripts/test.sh tests/test_kmeans.py one file.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec .venv/bin/python -m pytest -q "$@"
