#!/usr/bin/env bash
# Time the real command (`python -m loopvq_calib` = `loopvq-calibrate`) with the shipped configs on
# random-weight checkpoints of the real shapes (scripts/make_random_checkpoint.py), local data; one JSON
# line per step in OUT/results.jsonl (whole-command wall time, exit status, the code's identity from
# benchmarks/calibration/code_identity.py, then the run's stages as benchmarks/calibration/bench_pipeline.py
# --summarize reads them), every command's output in OUT/measure.log.
#
#   benchmarks/calibration/measure_real_command.sh OUT [SCALE_DOWN] [--set overrides for every run ...]
#   benchmarks/calibration/measure_real_command.sh /tmp/out 8 --set data.num_sequences=4 ...  # CPU dry run, scaled
#
# Runs (docs/performance.md; STEPS picks some, default all): ouro-1.4b (shipped config), ouro-1.4b-48gb (the
# 48 GB-card setting: capture.store memory, finetune.cache_teacher false, finetune.selection_batch 1),
# huginn-3.5b (shipped config);
# on request (not in the default): ouro-2.6b (shipped config, GPU 0 alone) and ouro-2.6b-2gpu (the same under
# `accelerate launch --multi_gpu --num_processes 2`, GPUs 0 and 1).
# DEADLINE (seconds from the start, default 3600) cuts every step's time limit so that the script ends in time
# (a step stopped by its limit is recorded with rc 124 and the stages it finished). KEEP_CHECKPOINTS=1 leaves
# the random checkpoints in WORK (default /tmp/loopvq-measure) for later probes.
set -u
OUT=${1:?usage: measure_real_command.sh OUT [SCALE_DOWN] [--set ...]}
SCALE=${2:-1}
shift $(( $# < 2 ? $# : 2 ))
EXTRA=("$@")
WORK=${WORK:-/tmp/loopvq-measure}
PY=${PYTHON:-python3}
DATA=artifacts/data/shakespeare-calib.jsonl
mkdir -p "$OUT" "$WORK"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# the checkout's package for the scripts too (a machine where it is not installed: the GPU image)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT/measure.log"
# the code measured (benchmarks/calibration/code_identity.py; `--find` names its commit where the history is)
export CODE_IDENTITY=$($PY benchmarks/calibration/code_identity.py)

record() {  # name rc start end [run dir]
  $PY - "$@" >> "$OUT/results.jsonl" <<'EOF'
import json, os, sys
from pathlib import Path
name, rc, start, end = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
line = {"step": name, "rc": rc, "command_s": round(end - start, 2), "code": os.environ["CODE_IDENTITY"]}
run = Path(sys.argv[5]) if len(sys.argv) > 5 else None
if run is not None and (run / "manifest.json").is_file() and "config" in json.loads((run / "manifest.json").read_text()):
    from benchmarks.calibration.bench_pipeline import summarize
    line.update(summarize(run))
    manifest = json.loads((run / "manifest.json").read_text())
    if "entered_at" in (manifest.get("startup") or {}):  # from the command's start to the pipeline's checks
        line["before_pipeline_s"] = round(manifest["startup"]["entered_at"] - start, 2)
    if "stages_done_at" in manifest:  # from the last stage's end to the command's exit
        line["after_stages_s"] = round(end - manifest["stages_done_at"], 2)
print(json.dumps(line))
EOF
}

checkpoint() {  # model folder
  local start end rc
  start=$(date +%s.%N)
  timeout 300 $PY scripts/make_random_checkpoint.py --model "$1" --out "$2" --scale-down "$SCALE" >> "$LOG" 2>&1
  rc=$?
  end=$(date +%s.%N)
  record "checkpoint-$1" "$rc" "$start" "$end"
}

calibrate() {  # name limit config overrides...
  local name=$1 limit=$2 config=$3 start end rc left
  shift 3
  left=$(( ${DEADLINE:-3600} - SECONDS - 10 ))
  [ "$left" -lt "$limit" ] && limit=$left
  [ "$limit" -le 0 ] && { echo "{\"step\": \"$name\", \"skipped\": \"no time left\"}" >> "$OUT/results.jsonl"; return; }
  rm -rf "${WORK:?}/$name"
  echo "=== $name: $config $*" >> "$LOG"
  start=$(date +%s.%N)
  timeout "$limit" ${LAUNCH:-$PY} -m loopvq_calib --config "$config" --output "$WORK/$name" --set data.dataset=$DATA "$@" \
    "${EXTRA[@]}" >> "$LOG" 2>&1
  rc=$?
  end=$(date +%s.%N)
  record "$name" "$rc" "$start" "$end" "$WORK/$name"
  [ -f "$WORK/$name/run.log" ] && cp "$WORK/$name/run.log" "$OUT/run-$name.log"
  rm -rf "${WORK:?}/$name"
}

STEPS=${STEPS:-ouro-1.4b ouro-1.4b-48gb huginn-3.5b}
if [[ " $STEPS " == *" ouro-1.4b"* ]]; then
  checkpoint ouro-1.4b "$WORK/ouro-1.4b-random"
  [[ " $STEPS " == *" ouro-1.4b "* ]] && calibrate ouro-1.4b 200 configs/ouro-1.4b.yaml \
    --set model.name_or_path="$WORK/ouro-1.4b-random"
  [[ " $STEPS " == *" ouro-1.4b-48gb "* ]] && calibrate ouro-1.4b-48gb 200 configs/ouro-1.4b.yaml \
    --set model.name_or_path="$WORK/ouro-1.4b-random" --set capture.store=memory --set finetune.cache_teacher=false --set finetune.selection_batch=1
  [ -z "${KEEP_CHECKPOINTS:-}" ] && rm -rf "${WORK:?}/ouro-1.4b-random"
fi
if [[ " $STEPS " == *" huginn-3.5b "* ]]; then
  checkpoint huginn-3.5b "$WORK/huginn-3.5b-random"
  calibrate huginn-3.5b 600 configs/huginn-3.5b.yaml --set model.name_or_path="$WORK/huginn-3.5b-random"
  [ -z "${KEEP_CHECKPOINTS:-}" ] && rm -rf "${WORK:?}/huginn-3.5b-random"
fi
if [[ " $STEPS " == *" ouro-2.6b"* ]]; then
  checkpoint ouro-2.6b "$WORK/ouro-2.6b-random"
  [[ " $STEPS " == *" ouro-2.6b "* ]] && CUDA_VISIBLE_DEVICES=0 calibrate ouro-2.6b 300 configs/ouro-2.6b.yaml \
    --set model.name_or_path="$WORK/ouro-2.6b-random"
  [[ " $STEPS " == *" ouro-2.6b-2gpu "* ]] && CUDA_VISIBLE_DEVICES=0,1 \
    LAUNCH="$PY -m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no" \
    calibrate ouro-2.6b-2gpu 300 configs/ouro-2.6b.yaml --set model.name_or_path="$WORK/ouro-2.6b-random"
  [ -z "${KEEP_CHECKPOINTS:-}" ] && rm -rf "${WORK:?}/ouro-2.6b-random"
fi
cat "$OUT/results.jsonl"
