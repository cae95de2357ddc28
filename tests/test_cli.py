"""Console scripts: calibrate with --stages for every method, inspect, push --dry-run, eval gates."""

from __future__ import annotations

import pytest
import yaml
from test_pipeline import tiny_config

from loopvq_calib.cli import calibrate_main, eval_main, inspect_main, push_main
from loopvq_calib.pipeline import calibrate


@pytest.mark.parametrize("method", ["cq", "tasq", "loopvq", "tasq+loopvq"])
def test_capture_and_kmeans_stages_for_every_method(tiny_ouro_dir, calib_corpus, tmp_path, method):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run", quant={"method": method})))
    assert calibrate_main(["--config", str(cfg), "--stages", "capture,kmeans"]) == 0
    assert (tmp_path / "run" / "kmeans" / "quantizer.safetensors").is_file()
    assert (tmp_path / "run" / "tasq").is_dir() == ("tasq" in method)
    assert not (tmp_path / "run" / "finetune").exists()


@pytest.fixture(scope="module")
def bundle(tiny_ouro_dir, calib_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli-run")
    return calibrate(tiny_config(tiny_ouro_dir, calib_corpus, out, finetune={"epochs": 1})).bundle


def test_inspect_prints_the_summary(bundle, capsys):
    assert inspect_main([str(bundle)]) == 0
    out = capsys.readouterr().out
    assert "loopvq" in out and "K=16" in out
    assert inspect_main([str(bundle.parent / "missing")]) == 2


def test_push_dry_run_lists_the_files(bundle, capsys):
    assert push_main([str(bundle), "--repo-id", "org/tiny", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would upload 3 files to org/tiny" in out
    for name in ("codebooks.safetensors", "loopvq.json", "README.md"):
        assert name in out


def test_eval_gates_exit_status(bundle, tiny_ouro_dir, heldout_corpus, tmp_path):
    common = ["--bundle", str(bundle), "--model", str(tiny_ouro_dir), "--data", str(heldout_corpus),
              "--num-sequences", "2", "--sequence-length", "32", "--out", str(tmp_path / "rep")]
    assert eval_main(common + ["--max-kl", "100"]) == 0
    assert (tmp_path / "rep" / "report.json").is_file() and (tmp_path / "rep" / "report.md").is_file()
    assert eval_main(common + ["--max-kl", "0"]) == 1
    assert eval_main(["--bundle", str(tmp_path / "nope")]) == 2


def test_bundle_names_its_model_by_absolute_path_and_evaluates_from_anywhere(bundle, tiny_ouro_dir, heldout_corpus,
                                                                              tmp_path, monkeypatch, capsys):
    """A local model is recorded by its absolute path (the card then has no base_model), so loopvq-eval
    finds it from any working directory without --model."""
    import json

    meta = json.loads((bundle / "loopvq.json").read_text())
    assert meta["model"]["name"] == str(tiny_ouro_dir.absolute())
    assert "base_model:" not in (bundle / "README.md").read_text()
    monkeypatch.chdir(tmp_path)
    assert eval_main(["--bundle", str(bundle), "--data", str(heldout_corpus), "--num-sequences", "1",
                      "--sequence-length", "32"]) == 0
    assert "Traceback" not in capsys.readouterr().err
