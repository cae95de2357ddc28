"""Where the main thread of a profiled ``loopvq-calibrate`` spends its time, from a py-spy raw (collapsed
stacks) profile taken with ``--threads --idle``: seconds in the imports before the pipeline, in ``Pipeline``'s
set-up and in each stage, then, per stage, the deepest loopvq_calib frame and the innermost frame of the
heaviest stacks. One JSON line per part. Used for the profile in docs/performance.md.

    py-spy record -r 50 --nonblocking --threads --idle --format raw -o prof.txt -- \
        python -m loopvq_calib --config configs/ouro-1.4b.yaml --set ...
    python scripts/pyspy_summary.py prof.txt --rate 50 --top 8
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

STAGES = ("capture", "tasq", "kmeans", "finetune", "bundle")


def main_thread_stacks(path: Path) -> list[tuple[list[str], int]]:
    """(frames outermost first, samples) of every main-thread stack in a py-spy raw file (gzip or text)."""
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if frames and "MainThread" in frames[0]:
                out.append((frames[1:], int(count)))
    return out


def part_of(frames: list[str]) -> str:
    """The stage a stack belongs to, else the pipeline's set-up, the imports, or other."""
    joined = ";".join(frames)
    for stage in STAGES:
        if f"Pipeline.stage_{stage}" in joined:
            return stage
    if "Pipeline.__init__" in joined:
        return "pipeline_init"
    return "imports" if "_find_and_load" in joined else "other"


def short(frame: str) -> str:
    """``func (path/file.py:line)`` -> ``func file.py:line``."""
    name, _, where = frame.partition(" (")
    return f"{name} {where.rstrip(')').rsplit('/', 1)[-1]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", type=Path)
    ap.add_argument("--rate", type=float, default=50.0, help="py-spy's sampling rate (-r), samples per second")
    ap.add_argument("--top", type=int, default=8, help="heaviest frames listed per stage")
    args = ap.parse_args()
    stacks = main_thread_stacks(args.profile)
    seconds: collections.Counter[str] = collections.Counter()
    frames_by_part: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for frames, count in stacks:
        part = part_of(frames)
        seconds[part] += count
        ours = [f for f in frames if "loopvq_calib/" in f]
        where = f"{short(ours[-1]) if ours else '-'} | {short(frames[-1]) if frames else '-'}"
        frames_by_part[part][where] += count
    print(json.dumps({"profile": str(args.profile), "main_thread_s": round(sum(seconds.values()) / args.rate, 2),
                      **{part: round(n / args.rate, 2) for part, n in seconds.most_common()}}))
    for part in STAGES:
        top = frames_by_part[part].most_common(args.top)
        print(json.dumps({"stage": part, "seconds": round(seconds[part] / args.rate, 2),
                          "heaviest": [[where, round(n / args.rate, 2)] for where, n in top]}))


if __name__ == "__main__":
    main()
