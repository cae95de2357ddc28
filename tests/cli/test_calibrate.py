"""loopvq-calibrate: --stages for every method, ``python -m loopvq_calib`` and the console script's exit, a process
group left on every way out, byte-identical bundles, and a calibrated bundle through loopvq-eval: its gates, and
its model named by absolute path."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import calibrate_child
from support.builders import tiny_config

from loopvq_calib.calibration.pipeline import calibrate
from loopvq_calib.cli.calibrate import command, main
from loopvq_calib.cli.eval import main as eval_main


@pytest.mark.parametrize("method", ["cq", "tasq", "loopvq", "tasq+loopvq"])
def test_capture_and_kmeans_stages_for_every_method(tiny_ouro_dir, calib_corpus, tmp_path, method):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run", quant={"method": method})))
    assert main(["--config", str(cfg), "--stages", "capture,kmeans"]) == 0
    assert (tmp_path / "run" / "kmeans" / "quantizer.safetensors").is_file()
    assert (tmp_path / "run" / "tasq").is_dir() == ("tasq" in method)
    assert not (tmp_path / "run" / "finetune").exists()


def test_python_m_exits_with_the_status_after_flushing_output_and_log(tiny_ouro_dir, calib_corpus, tmp_path):
    """``python -m loopvq_calib`` (cli.calibrate.process, which ends the process without the interpreter's
    teardown) exits with the command's status: the printed error, the printed bundle and the run log's last
    lines (the stage summary, logged just before the command returns) all arrive."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("quant:\n  bits: [1\n")
    done = subprocess.run(**calibrate_child(bad), capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "error: config error" in done.stderr and "Traceback" not in done.stderr
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run", finetune={"epochs": 1})))
    done = subprocess.run(**calibrate_child(cfg), capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"bundle: {tmp_path / 'run' / 'bundle'}" in done.stdout and "selection KL" in done.stdout
    log = (tmp_path / "run" / "run.log").read_text()
    assert "stage bundle: done" in log and log.rstrip().splitlines()[-1].startswith("| bundle | done |")  # the summary


def test_the_console_script_returns_the_status_and_closes_the_run_log(
    tiny_ouro_dir, calib_corpus, tmp_path, monkeypatch
):
    """cli.calibrate.command (what the ``loopvq-calibrate`` process runs) returns main's status, with
    run.log's handler flushed and closed."""
    import logging

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run")))
    monkeypatch.setattr(sys, "argv", ["loopvq-calibrate", "--config", str(cfg), "--stages", "data"])
    assert command() == 0
    handlers = [h for h in logging.getLogger("loopvq_calib").handlers if isinstance(h, logging.FileHandler)]
    assert handlers and all(h.stream is None for h in handlers)  # closed: nothing left unwritten
    assert "stage data: done" in (tmp_path / "run" / "run.log").read_text()
    monkeypatch.setattr(sys, "argv", ["loopvq-calibrate", "--config", str(tmp_path / "none.yaml")])
    assert command() == 2


def test_the_console_script_leaves_its_process_group_on_a_failed_run_too(tiny_ouro_dir, tmp_path, monkeypatch, capsys):
    """A command that joined a process group (one gloo process here) leaves it however it ends: here with exit 2,
    bad data found after the processes started."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    corpus = tmp_path / "short.jsonl"
    corpus.write_text(json.dumps({"text": "Too short."}) + "\n")  # fewer tokens than the calibration needs
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(tiny_ouro_dir, corpus, tmp_path / "run")))
    monkeypatch.setattr(sys, "argv", ["loopvq-calibrate", "--config", str(cfg), "--stages", "data"])
    assert command() == 2
    assert "data.num_sequences" in capsys.readouterr().err  # found by the checks, after the processes started
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_identical_runs_write_byte_identical_bundles(tiny_ouro_dir, calib_corpus, tmp_path, monkeypatch):
    """Without SOURCE_DATE_EPOCH ``created`` is the Unix epoch, so two runs of one config give the same bytes;
    with it, ``created`` is that time."""
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        yaml.safe_dump(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "unused", finetune={"epochs": 1}))
    )
    for run in ("a", "b"):
        assert main(["--config", str(cfg), "--output", str(tmp_path / run)]) == 0
    files = sorted(p.name for p in (tmp_path / "a" / "bundle").iterdir())
    assert files == ["README.md", "codebooks.safetensors", "loopvq.json"]
    for name in files:
        assert (tmp_path / "a" / "bundle" / name).read_bytes() == (tmp_path / "b" / "bundle" / name).read_bytes(), name
    assert json.loads((tmp_path / "a" / "bundle" / "loopvq.json").read_text())["created"] == "1970-01-01T00:00:00Z"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1767225600")
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    shutil.rmtree(tmp_path / "c" / "bundle")  # only the bundle stage reruns
    assert main(["--config", str(cfg), "--output", str(tmp_path / "c")]) == 0
    assert json.loads((tmp_path / "c" / "bundle" / "loopvq.json").read_text())["created"] == "2026-01-01T00:00:00Z"


@pytest.fixture(scope="module")
def bundle(tiny_ouro_dir, calib_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli-run")
    return calibrate(tiny_config(tiny_ouro_dir, calib_corpus, out, finetune={"epochs": 1})).bundle


@pytest.mark.slow  # quick equivalent: test_evaluate's test_eval_main_prints_writes_and_picks_the_exit_status
def test_eval_gates_exit_status(bundle, tiny_ouro_dir, heldout_corpus, tmp_path):
    """loopvq-eval on a calibrated bundle: 0 when the gates pass, 1 when one fails, 2 for bad input."""
    common = [
        "--bundle",
        str(bundle),
        "--model",
        str(tiny_ouro_dir),
        "--data",
        str(heldout_corpus),
        "--num-sequences",
        "2",
        "--sequence-length",
        "32",
        "--out",
        str(tmp_path / "rep"),
    ]
    assert eval_main(common + ["--max-kl", "100"]) == 0
    assert (tmp_path / "rep" / "report.json").is_file() and (tmp_path / "rep" / "report.md").is_file()
    assert eval_main(common + ["--max-kl", "0"]) == 1
    assert eval_main(["--bundle", str(tmp_path / "nope")]) == 2


def test_bundle_names_its_model_by_absolute_path_and_evaluates_from_anywhere(
    bundle, tiny_ouro_dir, heldout_corpus, tmp_path, monkeypatch, capsys
):
    """A local model is recorded by its absolute path (the card then has no base_model), so loopvq-eval
    finds it from any working directory without --model."""
    meta = json.loads((bundle / "loopvq.json").read_text())
    assert meta["model"]["name"] == str(tiny_ouro_dir.absolute())
    assert "base_model:" not in (bundle / "README.md").read_text()
    monkeypatch.chdir(tmp_path)
    assert (
        eval_main(
            ["--bundle", str(bundle), "--data", str(heldout_corpus), "--num-sequences", "1", "--sequence-length", "32"]
        )
        == 0
    )
    assert "Traceback" not in capsys.readouterr().err
