"""The stored output of `benchmarks/calibration/measure_real_command.sh` read for docs/performance.md
(benchmarks/calibration/performance_table.py): the steps it measures, each shipped config's latest finished run among
the ``measure-real-command-<machine>-run<N>[-<tag>]-results.jsonl`` files, the machine each ran on (its
``*-machine.txt``) and the commit of the code each measured (``measure-real-command-commits.json``, filled by
:func:`resolve` through ``code_identity --find``)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.calibration.code_identity import find_commits
from benchmarks.common.paths import RESULTS, ROOT

COMMITS = RESULTS / "measure-real-command-commits.json"
RESULTS_NAME = re.compile(
    r"measure-real-command-(?P<machine>[a-z0-9]+)-run(?P<run>\d+)(?P<tag>-[a-z]+)?"
    r"-results\.jsonl"
)


@dataclass(frozen=True)
class Step:
    """One measured command of measure_real_command.sh: what the page calls it and how it is run."""

    label: str
    config: str
    gpus: int
    overrides: tuple[str, ...] = ()
    steps: str = ""  # the STEPS that measure it (default: the step's own name)


STEPS = {
    "ouro-1.4b": Step("Ouro-1.4B", "configs/ouro-1.4b.yaml", 1),
    "ouro-1.4b-48gb": Step(
        "Ouro-1.4B, 48 GB-card setting",
        "configs/ouro-1.4b.yaml",
        1,
        ("capture.store=memory", "finetune.cache_teacher=false", "finetune.selection_batch=1"),
    ),
    "huginn-3.5b": Step("Huginn-3.5B", "configs/huginn-3.5b.yaml", 1),
    "ouro-2.6b": Step("Ouro-2.6B", "configs/ouro-2.6b.yaml", 1),
    "ouro-2.6b-2gpu": Step("Ouro-2.6B", "configs/ouro-2.6b.yaml", 2, steps="ouro-2.6b ouro-2.6b-2gpu"),
}


@dataclass(frozen=True)
class Run:
    """One step's JSON line and the results file it came from."""

    row: dict[str, Any]
    path: Path

    @property
    def machine(self) -> str:
        return RESULTS_NAME.fullmatch(self.path.name)["machine"]

    def stage(self, name: str, key: str = "wall_s") -> float | None:
        stage = self.row.get("stages", {}).get(name)
        return stage.get(key) if stage and stage.get("status") == "done" else None


def run_order(path: Path) -> tuple[int, str]:
    """Results files sort by run number, then tag (``run31`` before ``run31-warm``); other names are refused."""
    match = RESULTS_NAME.fullmatch(path.name)
    if match is None:
        raise SystemExit(f"{path}: not a results file name (measure-real-command-<machine>-run<N>-results.jsonl)")
    return int(match["run"]), match["tag"] or ""


def step_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a results file that are steps (a profile's or a probe's lines have no ``step``)."""
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return [row for row in rows if "step" in row]


def latest_runs(paths: list[Path]) -> dict[str, Run]:
    """Shipped step -> its latest finished run (exit status 0, stages recorded) over ``paths`` in run order."""
    latest: dict[str, Run] = {}
    for path in sorted(paths, key=run_order):
        for row in step_rows(path):
            if row["step"] in STEPS and row.get("rc") == 0 and "stages" in row:
                latest[row["step"]] = Run(row, path)
    return {step: latest[step] for step in STEPS if step in latest}


def one_gpu_partner(run: Run) -> Run | None:
    """The 1-GPU Ouro-2.6B run of the same call (same file) as a 2-GPU one: the pair that gives the speed-up."""
    rows = [row for row in step_rows(run.path) if row["step"] == "ouro-2.6b" and row.get("rc") == 0]
    return Run(rows[-1], run.path) if rows else None


def read_machine(path: Path) -> str | None:
    """``N x GPU, C CPU cores, M GiB host memory`` from a ``*-machine.txt`` (``nvidia-smi -L``, ``nproc``,
    ``free -g``); None for a file without all three."""
    lines = path.read_text().splitlines()
    gpus = [line.split(": ", 1)[1].split(" (UUID")[0] for line in lines if re.match(r"GPU \d+: ", line)]
    cores = [line.strip() for line in lines if line.strip().isdigit()]
    memory = [line.split()[1] for line in lines if line.startswith("Mem:")]
    if not (gpus and cores and memory):
        return None
    return f"{len(gpus)} x {gpus[0]}, {cores[0]} CPU cores, {memory[0]} GiB host memory"


def machines(results: Path) -> dict[str, str]:
    """Machine label (``h200``, ``h200x2``) -> its description from the label's latest complete machine file."""
    found: dict[str, tuple[int, str]] = {}
    for path in results.glob("measure-real-command-*-machine.txt"):
        match = re.fullmatch(r"measure-real-command-([a-z0-9]+)-run(\d+)-machine\.txt", path.name)
        text = read_machine(path) if match else None
        if text and int(match[2]) >= found.get(match[1], (-1, ""))[0]:
            found[match[1]] = (int(match[2]), text)
    return {label: text for label, (_, text) in found.items()}


def commit_of(run: Run, commits: dict[str, Any]) -> str | None:
    """The commit of the code a run measured: its identity's first commit, else the one recorded for its file."""
    code = run.row.get("code")
    if code:
        found = commits.get("codes", {}).get(code)
        return found[0] if found else None
    return commits.get("files", {}).get(run.path.name)


def resolve(runs: dict[str, Run], commits: dict[str, Any], *, root: Path = ROOT, last: int = 300) -> dict[str, Any]:
    """``commits`` with every identity of ``runs`` that it lacks mapped to its commits in ``root``'s history."""
    codes = dict(commits.get("codes", {}))
    for run in runs.values():
        code = run.row.get("code")
        if code and code not in codes:
            found = find_commits(code, last, root)
            if not found:
                raise SystemExit(f"{run.path.name}: no commit among the last {last} has code identity {code}")
            codes[code] = [commit[:7] for commit in found]
    return {**commits, "codes": codes}


def default_results(results: Path = RESULTS) -> list[Path]:
    return sorted(results.glob("measure-real-command-*-results.jsonl"), key=run_order)
