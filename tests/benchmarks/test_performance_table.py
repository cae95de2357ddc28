"""benchmarks/performance_table.py: the targets table of docs/performance.md computed from measurement files."""

from __future__ import annotations

import json

import pytest
from conftest import load_script

pt = load_script("performance_table")


def _run(step: str, command_s: float, stages: dict[str, float], peak: float, rc: int = 0) -> dict:
    return {"step": step, "rc": rc, "command_s": command_s, "peak_gpu_gib": peak, "stages_s": sum(stages.values()),
            "stages": {k: {"wall_s": v, "status": "done"} for k, v in stages.items()},
            "before_pipeline_s": 10.0, "after_stages_s": 1.0, "startup": {"pipeline_init_s": 2.0}}


def test_verdicts_follow_the_targets_and_later_files_win(tmp_path):
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    old.write_text("\n".join(json.dumps(r) for r in [
        {"step": "checkpoint-ouro-1.4b", "rc": 0, "command_s": 20.0},
        _run("ouro-1.4b", 99.0, {"tasq": 9.0, "kmeans": 9.0, "finetune": 50.0}, 50.0),
        _run("ouro-1.4b-48gb", 80.0, {"finetune": 30.0}, 38.0),  # 38 GiB = 40.8 GB: over 40 GB
    ]) + "\n{\"profile\": 1}\n")
    new.write_text(json.dumps(_run("ouro-1.4b", 72.0, {"tasq": 2.5, "kmeans": 12.0, "finetune": 42.0}, 50.0)) + "\n")
    rows = {target: (measured, verdict, src) for target, measured, verdict, src in
            pt.rows(pt.read_steps([old, new]))}
    whole = rows["Ouro-1.4B shipped config, whole command <= 60 s"]
    assert whole[1] == "missed by 12.0 s (1.20x)" and whole[2] == "new.jsonl"
    assert "10.0 s before the pipeline + 2.0 s of checks + 56.5 s of stages" in whole[0]
    assert rows["TaSQ stage <= 3 s"][1] == "met"
    assert rows["k-means stage <= 10 s"][1] == "missed by 2.0 s (1.20x)"
    ft = rows["fine-tuning stage <= 1.5x its 28.5 s before the fine-tuning work"]
    assert ft[0] == "42.0 s (x1.47)" and ft[1] == "met"
    small = rows["48 GB card setting: peak GPU memory <= 40 GB, <= 90 s"]
    assert small[1] == "memory missed; time met" and small[2] == "old.jsonl"
    assert rows["Huginn-3.5B shipped config completes, <= 240 s"][1] == "not measured"


def test_a_command_stopped_before_its_target_time_does_not_replace_a_finished_one(tmp_path):
    """The measurement's deadline stopped Huginn after 213 s (< 240): no verdict on the target, the earlier finished
    run stays; a command stopped after its target time has missed it and replaces the earlier line."""
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    old.write_text("\n".join(json.dumps(r) for r in [_run("huginn-3.5b", 215.0, {"capture": 40.0}, 60.0),
                                                    _run("ouro-1.4b", 55.0, {"kmeans": 9.0}, 50.0)]) + "\n")
    new.write_text("\n".join(json.dumps(r) for r in [_run("huginn-3.5b", 213.0, {"capture": 40.0}, 60.0, rc=124),
                                                    _run("ouro-1.4b", 61.0, {"kmeans": 9.0}, 50.0, rc=124),
                                                    _run("ouro-1.4b-48gb", 50.0, {"capture": 9.0}, 20.0, rc=124)]) + "\n")
    steps = pt.read_steps([old, new])
    assert steps["huginn-3.5b"][1] == "old.jsonl" and steps["huginn-3.5b"][0]["rc"] == 0
    killed = tmp_path / "killed.jsonl"  # 137: killed by something else (the kernel's OOM killer): a failure, shown
    killed.write_text(json.dumps(_run("huginn-3.5b", 150.0, {"capture": 40.0}, 60.0, rc=137)) + "\n")
    assert pt.read_steps([old, killed])["huginn-3.5b"][1] == "killed.jsonl"
    failed_first = tmp_path / "failed.jsonl"  # an earlier failed line is no finished run to keep
    failed_first.write_text(json.dumps(_run("huginn-3.5b", 100.0, {"capture": 40.0}, 60.0, rc=1)) + "\n")
    assert pt.read_steps([failed_first, new])["huginn-3.5b"][1] == "new.jsonl"
    assert steps["ouro-1.4b"][1] == "new.jsonl"  # stopped at 61 s: the 60 s target is missed whatever came before
    assert steps["ouro-1.4b-48gb"][1] == "new.jsonl"  # nothing earlier to keep: shown, and not measured
    rows = {t: (m, v) for t, m, v, _ in pt.rows(steps)}
    assert rows["Huginn-3.5B shipped config completes, <= 240 s"][1] == "met"
    assert rows["Ouro-1.4B shipped config, whole command <= 60 s"][1] == "not measured"
    assert rows["48 GB card setting: peak GPU memory <= 40 GB, <= 90 s"][1] == "memory met; time not measured"


def test_failed_run_is_not_met_and_markers_are_required(tmp_path):
    res = tmp_path / "r.jsonl"
    res.write_text(json.dumps(_run("huginn-3.5b", 100.0, {"capture": 90.0}, 60.0, rc=3)) + "\n")
    rows = {t: (m, v) for t, m, v, _ in pt.rows(pt.read_steps([res]))}
    assert rows["Huginn-3.5B shipped config completes, <= 240 s"][1] == "not measured"
    assert "(exit status 3)" in rows["Huginn-3.5B shipped config completes, <= 240 s"][0]
    page = tmp_path / "perf.md"
    page.write_text("# P\n")
    with pytest.raises(SystemExit, match="no <!-- targets:begin -->"):
        pt.write_between_markers(page, "x\n")
    page.write_text(f"# P\n{pt.BEGIN}\nold table\n{pt.END}\ntail\n")
    pt.write_between_markers(page, pt.table(pt.read_steps([res])))
    text = page.read_text()
    assert "old table" not in text and text.endswith(f"{pt.END}\ntail\n") and "| Huginn-3.5B" in text


def test_two_gpu_speedup_needs_both_runs_from_one_file(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    shared = {"capture": 0.0, "kmeans": 0.0}
    a.write_text("\n".join(json.dumps(r) for r in [_run("ouro-2.6b", 98.0, {**shared, "finetune": 49.0}, 90.0),
                                                    _run("ouro-2.6b-2gpu", 78.4, {**shared, "finetune": 38.0}, 60.0)]))
    target = "Ouro-2.6B on 2 GPUs >= 1.7x faster than on 1"
    one_gpu = "Ouro-2.6B shipped config on 1 GPU (no target of its own)"

    def table(*files):
        return {t: (m, v, s) for t, m, v, s in pt.rows(pt.read_steps(list(files)), pt.two_gpu_pair(list(files)))}

    rows = table(a)
    # 98 / (78.4 - 38 + 49 / 2) = 98 / 64.9: what halving the shared stages' 49 s would give at most
    assert rows[target][1] == "missed: 1.25x" and rows[target][2] == "a.jsonl"
    assert rows[target][0].endswith("**1.25x** (a perfect split of capture, kmeans, finetune: 1.51x)")
    assert one_gpu not in rows  # the pair's own 1-GPU run is in the pair's row
    b.write_text(json.dumps(_run("ouro-2.6b-2gpu", 50.0, {"finetune": 20.0}, 60.0)) + "\n")
    assert table(a, b)[target] == rows[target]  # a file with one of the two runs does not make a pair
    c = tmp_path / "c.jsonl"
    c.write_text(json.dumps(_run("ouro-2.6b", 88.0, {"capture": 12.0, "kmeans": 0.0, "finetune": 42.0, "bundle": 2.0},
                                 90.0)) + "\n")
    later = table(a, c)
    assert later[target] == rows[target]
    # a later 1-GPU run alone: the speed-up a perfect split would give with the rest as on 1 GPU, 88 / (34 + 27)
    assert later[one_gpu][1:] == ("bound of the 2-GPU speed-up, the rest as on 1 GPU: 1.44x", "c.jsonl")
    c.write_text(json.dumps(_run("ouro-2.6b", 88.0, {"capture": 12.0, "finetune": 42.0}, 90.0)) + "\n")
    assert table(a, c)[one_gpu][1].endswith("1 GPU: not measured")  # k-means did not run: no bound
    b.write_text("\n".join(json.dumps(r) for r in [_run("ouro-2.6b", 98.0, {}, 90.0),
                                                    _run("ouro-2.6b-2gpu", 57.0, {}, 60.0)]) + "\n")
    met = table(a, b)[target]
    assert met[1:] == ("met", "b.jsonl")
    assert met[0].endswith("(a perfect split of capture, kmeans, finetune: not measured)")  # no stage times
    assert table()[target][:2] == ("not run", "not measured")


def test_spread_lists_every_run_from_the_named_file_and_counts_the_finished_ones(tmp_path):
    files = [tmp_path / f"measure-real-command-h200-run{n}-results.jsonl" for n in (7, 8, 9, 80)]
    files[0].write_text(json.dumps(_run("ouro-1.4b", 80.0, {}, 1.0)) + "\n")  # before --spread-from: left out
    files[1].write_text("\n".join(json.dumps(r) for r in [
        _run("ouro-1.4b", 58.0, {"tasq": 1.5, "kmeans": 10.2}, 1.0),
        _run("huginn-3.5b", 230.0, {}, 1.0, rc=pt.STOPPED)]))
    files[2].write_text("\n".join(json.dumps(r) for r in [
        _run("ouro-1.4b", 61.5, {}, 1.0), _run("ouro-1.4b", 40.0, {}, 1.0, rc=1)]) + "\n")
    files[3].write_text(json.dumps(_run("huginn-3.5b", 250.0, {}, 1.0, rc=pt.STOPPED)) + "\n")
    text = pt.spread(files, "h200-run8")
    ouro = next(line for line in text.splitlines() if line.startswith("- Ouro-1.4B"))
    assert ouro == ("- Ouro-1.4B (<= 60 s), every run, s: 58.0 (h200-run8), 61.5 (h200-run9), "
                    "40.0 (h200-run9, exit status 1): met in 1 of 3")
    huginn = next(line for line in text.splitlines() if line.startswith("- Huginn-3.5B"))
    # stopped at 230 s, before the 240 s target: not counted; stopped at 250 s: missed
    assert huginn.endswith("230.0 (h200-run8, stopped by the measurement), 250.0 (h200-run80, stopped by the "
                           "measurement): met in 0 of 1")
    stages = [line for line in text.splitlines() if "stage" in line]  # the stage targets, from the runs that ran them
    assert stages == ["- Ouro-1.4B's tasq stage (<= 3 s), every run, s: 1.5 (h200-run8): met in 1 of 1",
                      "- Ouro-1.4B's kmeans stage (<= 10 s), every run, s: 10.2 (h200-run8): met in 0 of 1"]
    assert "from `h200-run8` on" in text and "48 GB" not in text
    assert "none finished" in pt.spread(files[1:2]) and "80.0" in pt.spread(files)
    assert "met in 1 of 4" in pt.spread(files)
    with pytest.raises(SystemExit, match="--spread-from h200-run: no results file labelled so"):
        pt.spread(files, "h200-run")  # a label, not a part of one
