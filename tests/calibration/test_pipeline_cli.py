"""The staged run through loopvq-calibrate: a run writes its bundle and reports; exit codes for a failed stage, a
bad run directory or output and settings refused before any work, the capture store among them."""

from __future__ import annotations

import json

from support.builders import tiny_config

from loopvq_calib.calibration.pipeline import calibrate
from loopvq_calib.cli import calibrate_main
from loopvq_calib.config.load import load_config


def test_cli_run_writes_bundle_and_reports(tiny_ouro_dir, calib_corpus, tmp_path, capsys):
    import yaml

    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "unused")))
    out = tmp_path / "cli-run"
    assert calibrate_main(["--config", str(cfg_path), "--output", str(out), "--set", "finetune.epochs=1"]) == 0
    printed = capsys.readouterr().out
    assert f"bundle: {out / 'bundle'}" in printed and "selection KL" in printed
    assert load_config(out / "config.yaml").finetune.epochs == 1
    assert calibrate_main(["--config", str(cfg_path), "--stages", "bogus"]) == 2


def test_cli_exit_codes_for_a_failed_stage_and_a_bad_run_directory(
    tiny_ouro_dir, calib_corpus, tmp_path, capsys, monkeypatch
):
    import yaml

    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run")))

    def broken(*args, **kwargs):
        raise RuntimeError("simulated k-means failure")

    monkeypatch.setattr("loopvq_calib.calibration.stages.fit_codebooks", broken)
    assert calibrate_main(["--config", str(cfg_path), "--stages", "kmeans"]) == 3
    err = capsys.readouterr().err
    assert "stage kmeans failed: RuntimeError: simulated k-means failure" in err and "run.log" in err
    assert "simulated k-means failure" in (tmp_path / "run" / "run.log").read_text()
    assert "Traceback" in (tmp_path / "run" / "run.log").read_text()

    (tmp_path / "run" / "manifest.json").write_text('{"stages": {')
    assert calibrate_main(["--config", str(cfg_path), "--stages", "data"]) == 2
    assert "manifest.json is not valid JSON" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert calibrate_main(["--config", str(cfg_path), "--output", str(tmp_path / "afile")]) == 2
    assert "afile exists and is not a directory" in capsys.readouterr().err
    assert calibrate_main(["--config", str(cfg_path), "--output", str(tmp_path / "r2"), "--stages", "tasq"]) == 2
    assert "tasq stage exists only for quant.method tasq or tasq+loopvq" in capsys.readouterr().err
    cfg_path.write_text(
        yaml.safe_dump(
            tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "r3", kmeans={"backend": "triton", "device": "cpu"})
        )
    )
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert calibrate_main(["--config", str(cfg_path)]) == 2  # k-means on the CPU: refused before the data stage
    assert "kmeans.backend: 'triton' needs the triton package and a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "r3" / "data").exists()


def test_auto_store_is_chosen_before_any_work_and_refused_with_the_numbers(
    tiny_ouro_dir, calib_corpus, tmp_path, capsys, monkeypatch
):
    import yaml

    import loopvq_calib.calibration.capture.store as cs

    cfg = tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run", capture={"store": "auto"})
    run = calibrate(cfg, stages=["capture"]).run_dir
    record = json.loads((run / "manifest.json").read_text())["stages"]["capture"]["details"]
    assert record["store"] == "memory" and record["store_reason"].startswith("capture.store auto -> memory: ")
    assert "capture.store auto -> memory" in (run / "run.log").read_text()
    assert json.loads((run / "capture" / "meta.json").read_text())["store"] == "memory"

    monkeypatch.setattr(cs, "host_available", lambda: 1000)
    monkeypatch.setattr(cs, "disk_available", lambda folder: 2000)
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(
        yaml.safe_dump(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "refused", capture={"store": "auto"}))
    )
    assert calibrate_main(["--config", str(cfg_path)]) == 2
    err = capsys.readouterr().err
    assert "capture.store: no store holds the capture" in err and "memory: 0.00 GB" in err
    assert not (tmp_path / "refused" / "data").exists()  # refused before the data stage
