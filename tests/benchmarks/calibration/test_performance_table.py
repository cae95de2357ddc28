"""benchmarks/calibration/performance_table.py: docs/performance.md generated from the stored measurement files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

from benchmarks.calibration import code_identity as ci, performance_runs as pr, performance_table as pt


def _run(step: str, command_s: float, stages: dict[str, float], peak: float = 50.0, rc: int = 0, **extra) -> dict:
    return {
        "step": step,
        "rc": rc,
        "command_s": command_s,
        "peak_gpu_gib": peak,
        "stages_s": sum(stages.values()),
        "stages": {k: {"wall_s": v, "peak_gpu_gib": peak / 2, "status": "done"} for k, v in stages.items()},
        "before_pipeline_s": 10.0,
        "after_stages_s": 1.0,
        "startup": {"pipeline_init_s": 2.0},
        "method": "tasq+loopvq",
        "bits": 0.5,
        "sequences": 16,
        "seq_len": 2048,
        "store": "device",
        **extra,
    }


def _write(path, *rows) -> None:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_the_committed_page_is_the_one_the_stored_results_give(tmp_path, monkeypatch):
    out = tmp_path / "performance.md"
    monkeypatch.setattr(sys, "argv", ["performance_table.py", "--write", str(out)])
    pt.main()
    assert out.read_text() == (ROOT / "docs" / "performance.md").read_text()
    assert len(out.read_text().splitlines()) <= 300


def test_each_step_shows_its_latest_finished_run_in_run_number_order(tmp_path):
    run9, run10 = (tmp_path / f"measure-real-command-h200-run{n}-results.jsonl" for n in (9, 10))
    _write(
        run9,
        {"step": "checkpoint-ouro-1.4b", "rc": 0, "command_s": 20.0},
        _run("ouro-1.4b", 70.0, {"capture": 9.0}),
        _run("huginn-3.5b", 230.0, {"finetune": 120.0}),
        {"profile": "a probe's line, no step"},
    )
    _write(run10, _run("ouro-1.4b", 61.0, {"capture": 8.0}), _run("huginn-3.5b", 213.0, {"finetune": 99.0}, rc=124))
    runs = pr.latest_runs([run10, run9])  # file order does not matter; run 10 comes after run 9, not before it
    assert list(runs) == ["ouro-1.4b", "huginn-3.5b"]
    assert runs["ouro-1.4b"].path == run10 and runs["ouro-1.4b"].stage("capture") == 8.0
    assert runs["huginn-3.5b"].path == run9  # run 10's was stopped (exit status 124): not a result
    table = pt.time_table(runs)
    assert table[2] == "| Ouro-1.4B | 1 | **61.0** | 10.0 | 2.0 | 8.0 | - | - | - | - | 1.0 |"
    with pytest.raises(SystemExit, match="not a results file name"):
        pr.latest_runs([tmp_path / "results.jsonl"])


def test_commits_come_from_the_code_identity_or_the_files_record(tmp_path):
    with_code, without = (tmp_path / f"measure-real-command-h200-run{n}-results.jsonl" for n in (40, 37))
    _write(with_code, _run("ouro-1.4b", 60.0, {}, code="ab" * 32))
    _write(without, _run("huginn-3.5b", 220.0, {}), _run("ouro-1.4b-48gb", 70.0, {}))
    runs = pr.latest_runs([with_code, without])
    commits = {"codes": {"ab" * 32: ["1234567", "89abcde"]}, "files": {without.name: "01c06a7"}}
    assert pr.commit_of(runs["ouro-1.4b"], commits) == "1234567"
    assert pr.commit_of(runs["huginn-3.5b"], commits) == "01c06a7"
    assert pr.commit_of(runs["ouro-1.4b"], {"files": {with_code.name: "x"}}) is None  # an identity wins over files
    table = "\n".join(pt.source_table(runs, {"files": {}}, {"h200": "1 x NVIDIA H200"}))
    assert table.count("not recorded (--resolve)") == 3 and "| 1 x NVIDIA H200 |" in table
    assert '`STEPS="ouro-1.4b-48gb" benchmarks/calibration/measure_real_command.sh OUT`' in table


def test_two_gpu_speedup_pairs_the_runs_of_one_call(tmp_path):
    pair, later = (tmp_path / f"measure-real-command-h200x2-run{n}-results.jsonl" for n in (20, 21))
    shared = {"capture": 10.0, "kmeans": 20.0}
    _write(
        pair,
        _run("ouro-2.6b", 98.0, {**shared, "finetune": 50.0}),
        _run("ouro-2.6b-2gpu", 78.4, {**shared, "finetune": 40.0}),
    )
    _write(later, _run("ouro-2.6b", 88.0, {"finetune": 42.0}))
    runs = pr.latest_runs([pair, later])
    assert runs["ouro-2.6b"].path == later and runs["ouro-2.6b-2gpu"].path == pair
    text = " ".join(" ".join(pt.two_gpu_lines(runs)).split())  # the paragraph unwrapped
    # 98 / 78.4; halving the 1-GPU run's shared 80 s: 98 / (78.4 - 70 + 40)
    assert "**1.25x**" in text and f"{98 / 48.4:.2f}x" in text and "98.0 s on one GPU of the same call" in text
    _write(pair, _run("ouro-2.6b-2gpu", 78.4, {}))
    assert pt.two_gpu_lines(pr.latest_runs([pair])) == []  # no 1-GPU run in that call: no speed-up


def test_machine_files_describe_each_machine_label(tmp_path):
    (tmp_path / "measure-real-command-h200x2-run20-machine.txt").write_text(
        "GPU 0: NVIDIA H200 (UUID: GPU-1)\nGPU 1: NVIDIA H200 (UUID: GPU-2)\n32\n"
        "               total        used        free\nMem:             251           0         250\n"
    )
    (tmp_path / "measure-real-command-h200-run22-machine.txt").write_text("name, memory.total [MiB]\nNVIDIA H200\n")
    (tmp_path / "measure-real-command-h200-run25-machine.txt").write_text(
        "GPU 0: NVIDIA H200 (UUID: GPU-3)\n16\nMem:             125           0         124\n"
    )
    assert pr.machines(tmp_path) == {
        "h200x2": "2 x NVIDIA H200, 32 CPU cores, 251 GiB host memory",
        "h200": "1 x NVIDIA H200, 16 CPU cores, 125 GiB host memory",
    }


def test_the_demo_section_reads_the_log_of_scripts_demo_sh(tmp_path):
    log = tmp_path / "demo-sh-cpu-0824725.log"
    log.write_text(
        "| data | done | 0.0 | - | 0.51 |\n| capture | done | 13.3 | - | 1.30 |\n"
        "| finetune | done | 27.6 | - | 2.38 |\nrun: runs/x (63 s; stage times in runs/x/manifest.json)\n"
    )
    text = " ".join(" ".join(pt.demo_section(log)).split())
    assert "commit `0824725`" in text and "**63 s** (capture 13.3, fine-tuning 27.6 s)" in text
    assert pt.demo_section(tmp_path / "none.log") == []
    bad = tmp_path / "demo-sh-cpu-idle.log"
    bad.write_text(log.read_text())
    with pytest.raises(SystemExit, match="no commit in the file name"):
        pt.demo_section(bad)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_resolve_names_the_commits_with_a_runs_code_identity(tmp_path):
    repo = tmp_path / "repo"
    (repo / "loopvq_calib").mkdir(parents=True)
    (repo / "loopvq_calib" / "a.py").write_text("A = 1\n")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = git("rev-parse", "HEAD").strip()
    results = tmp_path / "measure-real-command-h200-run40-results.jsonl"
    _write(results, _run("ouro-1.4b", 60.0, {}, code=ci.commit_identity("HEAD", repo)))
    runs = pr.latest_runs([results])
    kept = {"files": {"f": "c"}}
    code = runs["ouro-1.4b"].row["code"]
    assert pr.resolve(runs, kept, root=repo) == {"files": {"f": "c"}, "codes": {code: [head[:7]]}}
    _write(results, _run("ouro-1.4b", 60.0, {}, code="0" * 64))
    with pytest.raises(SystemExit, match="no commit among the last 300 has code identity 0000"):
        pr.resolve(pr.latest_runs([results]), kept, root=repo)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the repository")
def test_the_stored_commit_record_agrees_with_the_history():
    commits = json.loads(pr.COMMITS.read_text())
    for code, found in commits["codes"].items():
        assert {ci.commit_identity(commit) for commit in found} == {code}
    for name, commit in commits["files"].items():
        assert (pt.RESULTS / name).is_file()
        subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], check=True)


def test_the_steps_are_those_of_the_measurement_script():
    script = (ROOT / "benchmarks" / "calibration" / "measure_real_command.sh").read_text()
    for step, spec in pr.STEPS.items():
        assert f"calibrate {step} " in script and spec.config in script
        assert all(f"--set {override}" in script for override in spec.overrides)
