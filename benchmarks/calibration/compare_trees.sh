#!/usr/bin/env bash
# The same shipped command from two checkouts in turn on one machine (B A B A ...: the other tree first), on one
# random-weight checkpoint of the real shapes (scripts/make_random_checkpoint.py) and local data: one JSON line
# per run in OUT/compare.jsonl (tree, round, exit status, the whole command's seconds, each stage's seconds and
# peak GPU bytes from the run's manifest, the seconds before the pipeline and after its last stage), every
# command's output in OUT/compare.log. Alternating keeps a machine's drift out of the comparison.
#
#   benchmarks/calibration/compare_trees.sh OUT OTHER_TREE [ROUNDS] [CONFIG] [MODEL] [--set overrides for every run ...]
#   benchmarks/calibration/compare_trees.sh /tmp/cmp /tmp/before 2 configs/ouro-1.4b.yaml ouro-1.4b   # on the GPU
#   SCALE=16 benchmarks/calibration/compare_trees.sh /tmp/cmp /tmp/before 1 configs/ouro-1.4b.yaml ouro-1.4b \
#     --set model.device=cpu --set data.num_sequences=4 --set data.sequence_length=64 ...        # a CPU dry run
set -u
OUT=${1:?usage: compare_trees.sh OUT OTHER_TREE [ROUNDS] [CONFIG] [MODEL]}
OTHER=$(cd "${2:?the other checkout}" && pwd)
ROUNDS=${3:-2}
CONFIG=${4:-configs/ouro-1.4b.yaml}
MODEL=${5:-ouro-1.4b}
shift $(( $# < 5 ? $# : 5 ))
EXTRA=("$@")
HERE=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${WORK:-/tmp/loopvq-compare}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" $PY "$HERE/scripts/make_random_checkpoint.py" --model "$MODEL" --out "$WORK/checkpoint" --scale-down "${SCALE:-1}" >> "$OUT/compare.log" 2>&1 || exit 1

run() {  # tree label round
  local tree=$1 label=$2 round=$3 start end rc
  rm -rf "${WORK:?}/run"
  echo "=== $label round $round: $tree" >> "$OUT/compare.log"
  start=$(date +%s.%N)
  (cd "$tree" && $PY -m loopvq_calib --config "$CONFIG" --output "$WORK/run" --set model.name_or_path="$WORK/checkpoint" \
    --set data.dataset="$HERE/artifacts/data/shakespeare-calib.jsonl" "${EXTRA[@]}") >> "$OUT/compare.log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  $PY - "$label" "$round" "$rc" "$start" "$end" "$WORK/run/manifest.json" >> "$OUT/compare.jsonl" <<'EOF'
import json, sys
from pathlib import Path
label, round_, rc, start, end, manifest = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *map(float, sys.argv[4:6]), Path(sys.argv[6])
record = json.loads(manifest.read_text()) if manifest.is_file() else {}
line = {"tree": label, "round": round_, "rc": rc, "command_s": round(end - start, 2),
        "stages": {name: {"wall_s": round(rec.get("wall_s", 0.0), 2), "peak_gpu_bytes": rec.get("peak_gpu_bytes")}
                   for name, rec in record.get("stages", {}).items()}}
if "entered_at" in record.get("startup", {}):  # from the command's start to the pipeline's checks
    line["before_pipeline_s"] = round(record["startup"]["entered_at"] - start, 2)
if "stages_done_at" in record:  # from the last stage's end to the command's exit
    line["after_stages_s"] = round(end - record["stages_done_at"], 2)
print(json.dumps(line))
EOF
}

for round in $(seq 1 "$ROUNDS"); do
  run "$OTHER" other "$round"
  run "$HERE" this "$round"
done
rm -rf "${WORK:?}"
cat "$OUT/compare.jsonl"
