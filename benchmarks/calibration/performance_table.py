"""docs/performance.md, generated from the stored output of `benchmarks/calibration/measure_real_command.sh`.

Reads every ``benchmarks/results/measure-real-command-<machine>-run<N>[-<tag>]-results.jsonl`` (one JSON line per step
of one call), takes each shipped config's latest finished run (highest run number, exit status 0) and writes the whole
page: the command's seconds, each stage's seconds and peak GPU memory, the machine, the command that reproduces it and
the commit of the code that ran. A results line names its code by identity
(`benchmarks/calibration/code_identity.py`); ``benchmarks/results/measure-real-command-commits.json`` maps identities
to commits (and names the commits of the runs recorded before lines carried one). ``--resolve`` adds the identities
the map lacks, through ``code_identity --find`` over the git history. The CPU section reads a stored `scripts/demo.sh`
log.

    python benchmarks/calibration/performance_table.py                                   # print the page
    python benchmarks/calibration/performance_table.py --resolve --write docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.* and an uninstalled loopvq_calib

from benchmarks.calibration.performance_runs import (
    COMMITS,
    STEPS,
    Run,
    commit_of,
    default_results,
    latest_runs,
    machines,
    one_gpu_partner,
    resolve,
)
from benchmarks.calibration.tree_comparison import comparison_section
from benchmarks.common.markdown import wrap
from benchmarks.common.paths import RESULTS

DEMO_LOG = RESULTS / "demo-sh-cpu-0824725.log"  # the latest stored run of scripts/demo.sh
STEP_PROFILE = RESULTS / "measure-real-command-h200-run36-finetune-step-profile.txt"  # one fine-tuning step, profiled
IMPORT_PROFILE = RESULTS / "startup-profile-h200-run28a-importtime.txt"  # python -X importtime of the command
PAGE_STAGES = ("capture", "tasq", "kmeans", "finetune", "bundle")
STAGE_NAMES = {"capture": "capture", "tasq": "TaSQ", "kmeans": "k-means", "finetune": "fine-tuning", "bundle": "bundle"}
SHARED = ("capture", "kmeans", "finetune")  # the stages whose work two processes share
DATA = "artifacts/data/shakespeare-calib.jsonl"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def time_table(runs: dict[str, Run]) -> list[str]:
    head = [
        "config (random weights)",
        "GPUs",
        "whole command",
        "before the pipeline",
        "checks",
        *(STAGE_NAMES[s] for s in PAGE_STAGES),
        "exit",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for step, run in runs.items():
        row = run.row
        checks = (row.get("startup") or {}).get("pipeline_init_s")
        cells = [
            STEPS[step].label,
            str(STEPS[step].gpus),
            f"**{row['command_s']:.1f}**",
            _s(row.get("before_pipeline_s")),
            _s(checks),
            *(_s(run.stage(s)) for s in PAGE_STAGES),
            _s(row.get("after_stages_s")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def memory_table(runs: dict[str, Run]) -> list[str]:
    head = ["config (random weights)", "GPUs", "peak", *(STAGE_NAMES[s] for s in PAGE_STAGES), "capture held in"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for step, run in runs.items():
        cells = [
            STEPS[step].label,
            str(STEPS[step].gpus),
            f"**{_gib(run.row.get('peak_gpu_gib'))}**",
            *(_gib(run.stage(s, "peak_gpu_gib")) for s in PAGE_STAGES),
            str(run.row.get("store") or "-"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def source_table(runs: dict[str, Run], commits: dict[str, Any], machine: dict[str, str]) -> list[str]:
    lines = [
        "| config | GPUs | machine | calibration | commit | raw results (benchmarks/results/) | command |",
        "|---|---|---|---|---|---|---|",
    ]
    for step, run in runs.items():
        row, spec = run.row, STEPS[step]
        commit = commit_of(run, commits)
        setup = f"{row['method']} {row['bits']:g} bit, {row['sequences']} x {row['seq_len']:,} tokens"
        command = f'`STEPS="{spec.steps or step}" benchmarks/calibration/measure_real_command.sh OUT`'
        lines.append(
            f"| {spec.label} | {spec.gpus} | {machine.get(run.machine, run.machine)} | {setup} | "
            f"{f'`{commit}`' if commit else 'not recorded (--resolve)'} | `{run.path.name}` | {command} |"
        )
    return lines


def two_gpu_lines(runs: dict[str, Run]) -> list[str]:
    """The 2-GPU speed-up against the 1-GPU run of the same call, and what a perfect split would give."""
    two = runs.get("ouro-2.6b-2gpu")
    one = one_gpu_partner(two) if two else None
    if one is None:
        return []
    speedup = one.row["command_s"] / two.row["command_s"]
    shared1, shared2 = (sum(run.stage(s) or 0.0 for s in SHARED) for run in (one, two))
    bound = one.row["command_s"] / (two.row["command_s"] - shared2 + shared1 / 2)
    return [
        wrap(
            f"On 2 GPUs (`accelerate launch --multi_gpu --num_processes 2`) Ouro-2.6B took "
            f"{two.row['command_s']:.1f} s against {one.row['command_s']:.1f} s on one GPU of the same call "
            f"(`{two.path.name}`): **{speedup:.2f}x**. The processes share "
            f"{', '.join(STAGE_NAMES[s] for s in SHARED)}; halving those stages of the 1-GPU run and keeping the "
            f"rest as the 2-GPU run took it would give {bound:.2f}x."
        )
    ]


def profile_totals(path: Path) -> tuple[float, float] | None:
    """(host ms, GPU ms) of a torch profiler table's ``Self CPU/CUDA time total`` lines."""
    if not path.is_file():
        return None
    found = dict(re.findall(r"Self (CPU|CUDA) time total: ([\d.]+)ms", path.read_text()))
    return (float(found["CPU"]), float(found["CUDA"])) if {"CPU", "CUDA"} <= found.keys() else None


def limits(runs: dict[str, Run]) -> list[str]:
    """A few lines on what bounds each part, with the numbers of the runs in the tables."""
    lines = []
    main = runs.get("ouro-1.4b")
    if main:
        row = main.row
        lines.append(
            f"- **Start-up** ({_s(row.get('before_pipeline_s'))} of Ouro-1.4B's {row['command_s']:.1f} s): "
            f"importing torch and transformers, whose auto classes import its generation, tensor-parallel and "
            f"masking code (`python -X importtime`: `benchmarks/results/{IMPORT_PROFILE.name}`). It is host "
            "time and moves by seconds between fresh machines of one kind."
        )
        step = profile_totals(STEP_PROFILE)
        host = (
            (
                f": one step used {step[0]:.0f} ms of host time for {step[1]:.0f} ms of GPU time "
                f"(`benchmarks/results/{STEP_PROFILE.name}`)"
            )
            if step
            else ""
        )
        lines.append(
            f"- **Fine-tuning** ({_s(main.stage('finetune'))} s) is bound by launching small kernels{host}, "
            f"so its time follows the host's speed."
        )
        lines.append(
            f"- **k-means** ({_s(main.stage('kmeans'))} s) is GPU work: k-means++ seeding reads each "
            f"layout's points once per draw (memory bandwidth), then the fused Lloyd kernels; "
            f"**capture** ({_s(main.stage('capture'))} s) is the model's forward and backward passes."
        )
    huginn = runs.get("huginn-3.5b")
    if huginn:
        lines.append(
            f"- **Huginn-3.5B**: fine-tuning takes {_s(huginn.stage('finetune'))} of its "
            f"{huginn.row['command_s']:.1f} s; its peak ({_gib(huginn.row.get('peak_gpu_gib'))} GiB) is set "
            f"by `finetune.cache_teacher: auto`, which keeps what the card leaves free."
        )
    if "ouro-2.6b-2gpu" in runs:
        lines.append(
            "- **Two GPUs**: what the processes do not share (start-up, checks, TaSQ, bundle, exit) bounds "
            "the speed-up (the line below the first table)."
        )
    return [wrap(line, "  ") for line in lines]


def demo_section(log: Path) -> list[str]:
    """The CPU demo: its calibration's seconds and stages from a stored `scripts/demo.sh` log."""
    if not log.is_file():
        return []
    text = log.read_text()
    total = re.search(r"^run: \S+ \((\d+) s;", text, re.MULTILINE)
    stages = re.findall(r"^\| (\w+) \| done \| ([\d.]+) \|", text, re.MULTILINE)
    commit = re.fullmatch(r"demo-sh-cpu-([0-9a-f]{7,40})\.log", log.name)
    if total is None or commit is None:
        raise SystemExit(f"{log}: no 'run: ... (N s;' line or no commit in the file name (demo-sh-cpu-<commit>.log)")
    parts = ", ".join(f"{STAGE_NAMES.get(name, name)} {seconds}" for name, seconds in stages if float(seconds) > 0)
    return [
        "## CPU: the demo",
        "",
        wrap(
            f"`bash scripts/demo.sh` (the reference model `artifacts/tiny-ouro`, `configs/tiny-ouro.yaml`: "
            f"LoopVQ 0.5 bit, 16 x 512 tokens) on the 2-core CPU development machine at commit `{commit[1]}`: "
            f"the calibration took **{total[1]} s** ({parts} s). Raw log: `benchmarks/results/{log.name}`."
        ),
    ]


INTRO = (
    "The real command, `loopvq-calibrate --config configs/<model>.yaml`, with the shipped settings on a "
    "**random-weight checkpoint** of the model's real shapes (speed and memory do not depend on the weight "
    f"values) and local calibration text (`{DATA}`). `benchmarks/calibration/measure_real_command.sh` times "
    "the whole command, from the interpreter's start to its exit, and reads each stage's wall time and peak GPU "
    "memory (`torch.cuda.max_memory_allocated` over the stage) from the run's manifest. Each row is the latest "
    "finished run of that config among the stored results, at the commit its row names (a config as it was at "
    "that commit); one run of a command on a fresh machine carries seconds of host noise."
)
BY_HAND = [
    "```bash",
    "python scripts/make_random_checkpoint.py --model ouro-1.4b --out /tmp/ouro-1.4b-random   # bf16",
    "loopvq-calibrate --config configs/ouro-1.4b.yaml --set model.name_or_path=/tmp/ouro-1.4b-random \\",
    f"    --set data.dataset={DATA}",
    "```",
]


def page(paths: list[Path], commits: dict[str, Any], *, results: Path = RESULTS, demo_log: Path = DEMO_LOG) -> str:
    """The whole of docs/performance.md."""
    runs = latest_runs(paths)
    command = "python benchmarks/calibration/performance_table.py --write docs/performance.md"
    small = " ".join(f"--set {o}" for o in STEPS["ouro-1.4b-48gb"].overrides)
    lines = [
        "# Performance",
        "",
        f"<!-- Generated by `{command}`; do not edit. -->",
        "",
        wrap(INTRO),
        "",
        "## Seconds per stage (random weights)",
        "",
        *time_table(runs),
        "",
    ]
    two = two_gpu_lines(runs)
    lines += [*two, ""] if two else []
    lines += [
        "## Peak GPU memory, GiB (random weights)",
        "",
        *memory_table(runs),
        "",
        "## Where each row comes from",
        "",
        *source_table(runs, commits, machines(results)),
        "",
        "The same command by hand, for one config:",
        "",
        *BY_HAND,
        "",
        wrap(
            f"The 48 GB-card setting adds `{small}`. `python benchmarks/calibration/code_identity.py --find "
            "HASH` names the commits of a results line's `code`."
        ),
        "",
        "## What limits it",
        "",
        *limits(runs),
        "",
    ]
    compared = comparison_section(results)
    lines += [*compared, ""] if compared else []
    demo = demo_section(demo_log)
    return "\n".join(lines + ([*demo, ""] if demo else []))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="*", type=Path, help="results files (default: every stored one)")
    ap.add_argument("--resolve", action="store_true", help=f"map new code identities to commits in {COMMITS.name}")
    ap.add_argument("--write", type=Path, help="write the page here instead of printing it")
    args = ap.parse_args()
    paths = args.results or default_results()
    commits = json.loads(COMMITS.read_text())
    if args.resolve:
        commits = resolve(latest_runs(paths), commits)
        COMMITS.write_text(json.dumps(commits, indent=1, sort_keys=True) + "\n")
    text = page(paths, commits)
    if args.write:
        args.write.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
