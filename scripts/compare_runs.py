"""Compare the codebooks of two run directories (e.g. the same config before and after a code change): per
stage (kmeans, finetune) whether the quantizer files are byte-identical, else the largest absolute and
relative codebook difference; plus both runs' selection KL (kept and k-means) and kept step. Prints one JSON line.

    python scripts/compare_runs.py RUN_A RUN_B
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors.torch import load_file

from loopvq_calib.calibration.stages import load_finetune, selection_metrics


def compare(a: Path, b: Path) -> dict:
    out: dict = {"a": str(a), "b": str(b)}
    for stage in ("kmeans", "finetune"):
        fa, fb = a / stage / "quantizer.safetensors", b / stage / "quantizer.safetensors"
        if not (fa.is_file() and fb.is_file()):
            continue
        if fa.read_bytes() == fb.read_bytes():
            out[stage] = {"identical_bytes": True}
            continue
        ta, tb = load_file(str(fa)), load_file(str(fb))
        books = [k for k in ta if k.endswith(".codebook")]
        diff = max(float((ta[k] - tb[k]).abs().max()) for k in books)
        scale = max(float(ta[k].abs().max()) for k in books)
        same_groups = all(bool((ta[k] == tb[k]).all()) for k in ta if k.endswith(".groups"))
        out[stage] = {"identical_bytes": False, "max_abs_diff": diff, "max_abs_diff_relative": diff / scale,
                      "same_groups": same_groups}
    for name, run in (("a", a), ("b", b)):
        if (run / "finetune" / "curve.json").is_file():  # the package's own reading of the curve
            out.update({f"{k}_{name}": v for k, v in selection_metrics(load_finetune(run / "finetune")).items()})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    args = p.parse_args()
    print(json.dumps(compare(args.a, args.b)))


if __name__ == "__main__":
    main()
