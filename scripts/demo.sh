#!/usr/bin/env bash
# Quick start: set up .venv if needed, then calibrate the shipped reference model on the shipped corpus
# (configs/tiny-ouro.yaml; no downloads) and say what it wrote. Extra arguments go to loopvq-calibrate
# (e.g. --set kmeans.iterations=10); LOOPVQ_DEMO_OUTPUT picks the run directory.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"
run="${LOOPVQ_DEMO_OUTPUT:-runs/tiny-ouro-loopvq-0.5}"
start=$SECONDS
.venv/bin/loopvq-calibrate --config configs/tiny-ouro.yaml --output "$run" "$@"
echo "run: $run ($((SECONDS - start)) s; stage times in $run/manifest.json)"
echo "disk: $(du -sh "$run" | cut -f1) in $run, of which the bundle $(du -sh "$run/bundle" | cut -f1)"
echo "next: .venv/bin/loopvq-eval --bundle $run/bundle --out $run/eval   # KL and perplexity on held-out text"
