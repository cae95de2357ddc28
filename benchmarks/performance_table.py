"""The targets table of docs/performance.md, computed from `benchmarks/measure_real_command.sh` output.

Each RESULTS file is one `results.jsonl` (one JSON line per step of the measurement); a step measured in
several files is taken from the last file given, the 2-GPU pair from the last file that holds both. Below the
table, every run of each step with a time target, in the files from the one ``--spread-from`` names (its name
without ``measure-real-command-`` and ``-results.jsonl``; all by default), and how many met it: one run of a command
on a fresh machine carries seconds of host noise.
The text is printed, or with ``--write`` put between the ``<!-- targets:begin -->`` / ``<!-- targets:end -->``
markers of docs/performance.md.

    python benchmarks/performance_table.py benchmarks/results/measure-real-command-h200-run19-results.jsonl
    python benchmarks/performance_table.py RUN16.jsonl RUN19.jsonl --spread-from RUN16 --write docs/performance.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

GB = 1e9
GIB = 2**30
FINETUNE_BASELINE_S = 28.5  # the fine-tuning stage when the fine-tuning issue was filed (docs/finetune.md)
BEGIN, END = "<!-- targets:begin -->", "<!-- targets:end -->"
Run = tuple[dict[str, Any], str]  # one step's JSON line and the name of its file
Pair = tuple[Run, Run]  # Ouro-2.6B on 1 and on 2 GPUs, from one file


TIME_TARGET_S = {"ouro-1.4b": 60.0, "ouro-1.4b-48gb": 90.0, "huginn-3.5b": 240.0}  # whole command, per step
STEP_LABEL = {"ouro-1.4b": "Ouro-1.4B", "ouro-1.4b-48gb": "48 GB card setting", "huginn-3.5b": "Huginn-3.5B"}
STOPPED = 124  # `timeout`'s exit status (measure_real_command.sh sends no KILL): its time limit or DEADLINE stopped it


def step_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a results file that are steps (other lines, a profile's or a probe's, have no ``step``)."""
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return [row for row in rows if "step" in row]


def stopped_early(row: dict[str, Any]) -> bool:
    """A command the measurement stopped before its target's time had passed: it says nothing about the target."""
    return row.get("rc") == STOPPED and row.get("command_s", 0) < TIME_TARGET_S.get(row["step"], 0)


def read_steps(paths: list[Path]) -> dict[str, Run]:
    """step name -> (its JSON line, the file it came from); later files win, except a command
    :func:`stopped_early` when an earlier line of that step finished: the earlier line stays whole (the stopped
    run's stage times and memory are not used)."""
    steps: dict[str, Run] = {}
    for path in paths:
        for row in step_rows(path):
            if stopped_early(row) and row["step"] in steps and steps[row["step"]][0].get("rc") == 0:
                continue
            steps[row["step"]] = (row, path.name)
    return steps


def _stage(row: dict[str, Any], name: str) -> float | None:
    stage = row.get("stages", {}).get(name)
    return stage["wall_s"] if stage and stage.get("status") == "done" else None


def _verdict(value: float | None, limit: float, unit: str = "s") -> str:
    if value is None:
        return "not measured"
    if value <= limit:
        return "met"
    return f"missed by {value - limit:.1f} {unit} ({value / limit:.2f}x)"


def _command(row: dict[str, Any]) -> str:
    """Whole command = before the pipeline + checks + stages + exit, as the run recorded them."""
    stages = ", ".join(f"{name} {s['wall_s']:.1f}" for name, s in row.get("stages", {}).items()
                       if s.get("status") == "done" and name != "data")
    checks = (row.get("startup") or {}).get("pipeline_init_s")
    parts = [f"**{row['command_s']:.1f} s**"]
    if "before_pipeline_s" in row and checks is not None:
        parts.append(f"= {row['before_pipeline_s']:.1f} s before the pipeline + {checks:.1f} s of checks + "
                     f"{row.get('stages_s', 0):.1f} s of stages ({stages}) + {row.get('after_stages_s', 0):.1f} s exit")
    if row.get("rc"):
        parts.append(f"(exit status {row['rc']})")
    return " ".join(parts)


def rows(steps: dict[str, Run], pair: Pair | None = None) -> list[tuple[str, str, str, str]]:
    """(target, measured, verdict, source file) for every target; ``pair``: :func:`two_gpu_pair`."""
    out = []
    main = steps.get("ouro-1.4b")
    if main:
        row, src = main
        ok = row["rc"] == 0
        out.append(("Ouro-1.4B shipped config, whole command <= 60 s", _command(row),
                    _verdict(row["command_s"] if ok else None, TIME_TARGET_S["ouro-1.4b"]), src))
        for name, label, limit in (("tasq", "TaSQ stage <= 3 s", 3.0), ("kmeans", "k-means stage <= 10 s", 10.0)):
            value = _stage(row, name)
            out.append((label, "not run" if value is None else f"{value:.1f} s", _verdict(value, limit), src))
        ft = _stage(row, "finetune")
        out.append((f"fine-tuning stage <= 1.5x its {FINETUNE_BASELINE_S} s before the fine-tuning work",
                    "not run" if ft is None else f"{ft:.1f} s (x{ft / FINETUNE_BASELINE_S:.2f})",
                    _verdict(ft, 1.5 * FINETUNE_BASELINE_S), src))
    small = steps.get("ouro-1.4b-48gb")
    if small:
        row, src = small
        peak = row.get("peak_gpu_gib")
        peak_txt = "peak n/a" if peak is None else f"peak {peak:.1f} GiB = {peak * GIB / GB:.1f} GB"
        memory = "not measured" if peak is None else ("memory met" if peak * GIB <= 40 * GB else "memory missed")
        time = _verdict(row["command_s"] if row["rc"] == 0 else None, TIME_TARGET_S["ouro-1.4b-48gb"])
        out.append(("48 GB card setting: peak GPU memory <= 40 GB, <= 90 s", f"{peak_txt}; {_command(row)}",
                    f"{memory}; time {time}", src))
    huginn = steps.get("huginn-3.5b")
    if huginn:
        row, src = huginn
        out.append(("Huginn-3.5B shipped config completes, <= 240 s", _command(row),
                    _verdict(row["command_s"] if row["rc"] == 0 else None, TIME_TARGET_S["huginn-3.5b"]), src))
    else:
        out.append(("Huginn-3.5B shipped config completes, <= 240 s", "not run", "not measured", "-"))
    one = steps.get("ouro-2.6b")
    if one is not None and (pair is None or one[1] != pair[0][1]):  # a later 1-GPU run than the pair's
        row, src = one
        out.append(("Ouro-2.6B shipped config on 1 GPU (no target of its own)", _command(row),
                    f"bound of the 2-GPU speed-up, the rest as on 1 GPU: {_split_bound(row, row)}", src))
    out.append(_two_gpus(pair))
    return out


SPLIT = ("capture", "kmeans", "finetune")  # the stages whose work the processes share


def _split_bound(row1: dict[str, Any], row2: dict[str, Any]) -> str:
    """The 2-GPU speed-up if the 1-GPU run's ``SPLIT`` stages took half their time and the rest of the command took
    what it took in ``row2`` (the 2-GPU run, or the 1-GPU run itself for a bound from it alone); "not measured"
    unless both runs finished and ran those stages (a reused or failed stage has no time)."""
    times1, times2 = ([_stage(row, name) for name in SPLIT] for row in (row1, row2))
    if row1["rc"] or row2["rc"] or None in times1 + times2:
        return "not measured"
    return f"{row1['command_s'] / (row2['command_s'] - sum(times2) + sum(times1) / 2):.2f}x"


def two_gpu_pair(paths: list[Path]) -> Pair | None:
    """The Ouro-2.6B runs on 1 and on 2 GPUs of the last file that holds both (one machine, one tree); a 2-GPU run
    without its 1-GPU run in the same file says nothing about the speed-up and is left out."""
    for path in reversed(paths):
        found = {row["step"]: row for row in step_rows(path) if row["step"] in ("ouro-2.6b", "ouro-2.6b-2gpu")}
        if len(found) == 2:
            return (found["ouro-2.6b"], path.name), (found["ouro-2.6b-2gpu"], path.name)
    return None


def _two_gpus(pair: Pair | None) -> tuple[str, str, str, str]:
    """The 2-GPU speed-up row from :func:`two_gpu_pair` (both runs must succeed), with the speed-up a perfect split
    of the shared stages would give."""
    target = "Ouro-2.6B on 2 GPUs >= 1.7x faster than on 1"
    if pair is None:
        return target, "not run", "not measured", "-"
    (row1, src), (row2, _) = pair
    measured = f"1 GPU: {_command(row1)}; 2 GPUs: {_command(row2)}"
    if row1["rc"] or row2["rc"]:
        return target, measured, "not measured", src
    speedup = row1["command_s"] / row2["command_s"]
    verdict = "met" if speedup >= 1.7 else f"missed: {speedup:.2f}x"
    bound = _split_bound(row1, row2)
    return target, f"{measured}; **{speedup:.2f}x** (a perfect split of {', '.join(SPLIT)}: {bound})", verdict, src


def table(steps: dict[str, Run], pair: Pair | None = None) -> str:
    lines = ["| target | measured | verdict | raw output (benchmarks/results/) |", "|---|---|---|---|"]
    lines += [f"| {t} | {m} | {v} | {f'`{s}`' if s != '-' else '-'} |" for t, m, v, s in rows(steps, pair)]
    return "\n".join(lines) + "\n"


def run_label(path: Path) -> str:
    """A results file's name without what every measurement file shares: ``h200-run30`` for
    ``measure-real-command-h200-run30-results.jsonl``."""
    return path.name.removeprefix("measure-real-command-").removesuffix(".jsonl").removesuffix("-results")


STAGE_TARGET_S = {("ouro-1.4b", "tasq"): 3.0, ("ouro-1.4b", "kmeans"): 10.0}  # the stage targets of a step


def spread(paths: list[Path], since: str | None = None) -> str:
    """Per step with a time target: its whole-command time in every file from the one labelled ``since``
    (:func:`run_label`; in file order, each run named by its file's label), and how many met the target. A
    command :func:`stopped_early` is listed but not counted, one stopped later or one that failed counts as
    missed. Then each stage target's
    stage in the runs of its step that finished that stage."""
    if since is not None:
        starts = [i for i, path in enumerate(paths) if run_label(path) == since]
        if not starts:
            raise SystemExit(f"--spread-from {since}: no results file labelled so (e.g. h200-run30)")
        paths = paths[starts[0]:]
    labels: dict[Any, str] = {step: f"{STEP_LABEL[step]} (<= {limit:.0f} s)" for step, limit in TIME_TARGET_S.items()}
    labels |= {(step, stage): f"{STEP_LABEL[step]}'s {stage} stage (<= {limit:.0f} s)"
               for (step, stage), limit in STAGE_TARGET_S.items()}
    runs: dict[Any, list[str]] = {key: [] for key in labels}
    met: dict[Any, list[bool]] = {key: [] for key in labels}
    for path in paths:
        for row in step_rows(path):
            step = row["step"]
            if step not in TIME_TARGET_S:
                continue
            note = {0: "", STOPPED: ", stopped by the measurement"}.get(row["rc"], f", exit status {row['rc']}")
            runs[step].append(f"{row['command_s']:.1f} ({run_label(path)}{note})")
            if not stopped_early(row):
                met[step].append(row["rc"] == 0 and row["command_s"] <= TIME_TARGET_S[step])
            for (target_step, stage), limit in STAGE_TARGET_S.items():
                value = _stage(row, stage) if step == target_step else None
                if value is not None:
                    runs[(step, stage)].append(f"{value:.1f} ({run_label(path)})")
                    met[(step, stage)].append(value <= limit)
    lines = [f"- {labels[key]}, every run, s: {', '.join(runs[key])}: "
             + (f"met in {sum(met[key])} of {len(met[key])}" if met[key] else "none finished")
             for key in labels if runs[key]]
    head = "Every run of the timed commands" + (f" from `{since}` on" if since else "") + ":\n\n"
    return head + "\n".join(lines) + "\n" if lines else ""


def write_between_markers(doc: Path, text: str) -> None:
    page = doc.read_text()
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{doc}: no {BEGIN} ... {END} markers to write between")
    head, rest = page.split(BEGIN, 1)
    doc.write_text(head + BEGIN + "\n" + text + END + rest.split(END, 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="results.jsonl files of measure_real_command.sh")
    ap.add_argument("--spread-from", help="list every run from the results file of this label (e.g. h200-run30)")
    ap.add_argument("--write", type=Path, help="put the table between the markers of this page")
    args = ap.parse_args()
    runs = spread(args.results, args.spread_from)
    text = table(read_steps(args.results), two_gpu_pair(args.results)) + (f"\n{runs}" if runs else "")
    if args.write:
        write_between_markers(args.write, text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
