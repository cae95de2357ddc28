"""benchmarks/quality/eval_reference.py: the per-model settings table against the shipped models, the runs it plans (a
k-means-only twin per fine-tuned run, reusing its k-means stage), the loopvq-eval command it builds, setup.json,
and (slow) a whole tiny run on the Huginn reference model read back by benchmarks/quality/quality_table.py."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import pytest
from conftest import ROOT, load_script

from loopvq_calib.calibration.fingerprints import stage_fingerprints
from loopvq_calib.cli import eval_parser
from loopvq_calib.config.load import load_config
from loopvq_calib.config.schema import FinetuneConfig

er = load_script("eval_reference")
qt = load_script("quality_table")


def test_the_settings_table_matches_the_shipped_models():
    assert tuple(qt.MODELS) == ("ouro", "huginn")
    blocks = {}
    for name in qt.MODELS:
        ref = er.MODELS[name]
        config = json.loads((ROOT / ref.folder / "config.json").read_text())
        loops = config.get("total_ut_steps", config.get("mean_recurrence"))
        window = config.get("max_position_embeddings", config.get("block_size"))
        assert loops % ref.steps_per_block == 0 and ref.steps_per_block == 4, name
        blocks[name] = loops // ref.steps_per_block
        assert (ROOT / ref.calibration).is_file() and (ROOT / ref.heldout).is_file(), name
        assert ref.calibration != ref.heldout and qt.FOLDERS[name] == ref.folder
        lengths = [int(n) for n in er.parser().parse_args([]).passkey_lengths.split(",")]
        assert max(lengths) + 8 <= window, name  # the passkey's answer tokens fit the model's window
        assert {b: ref.group_size(b) for b in er.WIDTHS} == er.WIDTHS == {0.5: 16, 0.25: 32}
    assert blocks == {"ouro": 1, "huginn": 2}


def test_every_method_width_and_fine_tuning_once_with_its_twin():
    runs = er.plan()
    assert len(runs) == 20 and len({r.name for r in runs}) == 20
    assert {(r.method, r.bits, r.finetuned) for r in runs} == {
        (m, b, t) for m in er.METHODS for b in (0.5, 0.25) for t in (True, False)}
    names = {r.bundle_name("huginn") for r in runs}
    assert "tiny-huginn-tasq+loopvq-0.25bit" in names and "tiny-huginn-tasq+loopvq-0.25bit-kmeans" in names


def test_a_k_means_only_run_reuses_its_twins_codebooks_and_only_those():
    """The twin's config differs only in fine-tuning and the bundle's name, so its data, TaSQ and k-means stages
    have the same fingerprints (the pipeline reuses them) and its fine-tuning and bundle do not."""
    tuned, kmeans = (load_config(er.run_config("huginn", er.Run("tasq+loopvq", 0.25, t))) for t in (True, False))
    assert tuned.finetune.enabled and not kmeans.finetune.enabled
    assert (tuned.model.name_or_path, tuned.data.dataset) == (str(ROOT / "artifacts/tiny-huginn"),
                                                              str(ROOT / "artifacts/data/python-calib.jsonl"))
    assert (tuned.quant.group_size, tuned.quant.codebook_size, tuned.quant.steps_per_block) == (32, 256, 4)
    a, b = (stage_fingerprints(c, "data", {"model": "m"}, loop_steps=8) for c in (tuned, kmeans))
    assert [s for s in a if a[s] == b[s]] == ["data", "capture", "tasq", "kmeans"]


def test_the_channels_variant_is_tasq_loopvq_with_the_channel_grouping():
    free, channels = (load_config(er.run_config("ouro", er.Run(m, 0.5, True)))
                      for m in ("tasq+loopvq", "tasq+loopvq-channels"))
    assert free.quant == channels.quant and free.quant.method == "tasq+loopvq"
    assert (free.tasq.grouping, channels.tasq.grouping) == ("free", "channels")
    assert channels.output.bundle_name == "tiny-ouro-tasq+loopvq-channels-0.5bit"


def test_share_codebooks_links_the_finished_shared_stages(tmp_path):
    src, dst = tmp_path / "loopvq-0.5", tmp_path / "loopvq-0.5-kmeans"
    stages = {"data": "done", "kmeans": "done", "finetune": "done", "bundle": "done", "tasq": "running"}
    for stage in stages:
        (src / stage).mkdir(parents=True)
        (src / stage / "f.bin").write_bytes(stage.encode())
    manifest = {"config": {"x": 1}, "stages": {s: {"fingerprint": s, "status": v} for s, v in stages.items()}}
    (src / "manifest.json").write_text(json.dumps(manifest))
    er.share_codebooks(src, dst)
    assert sorted(p.name for p in dst.iterdir()) == ["data", "kmeans", "manifest.json"]
    assert os.path.samefile(src / "kmeans" / "f.bin", dst / "kmeans" / "f.bin")  # a hard link, no copy
    written = json.loads((dst / "manifest.json").read_text())
    assert written == {"config": {"x": 1}, "stages": {s: manifest["stages"][s] for s in ("data", "kmeans")}}
    (dst / "manifest.json").write_text("{}")  # a twin that has started is left as it is
    er.share_codebooks(src, dst)
    assert (dst / "manifest.json").read_text() == "{}"


def test_the_loopvq_eval_command_parses_and_names_every_part(tmp_path):
    args = er.parser().parse_args(["--model", "huginn", "--out", str(tmp_path), "--limit", "12"])
    paths = [tmp_path / "runs" / r.name / "bundle" for r in er.plan()]
    parsed = eval_parser().parse_args(er.eval_argv("huginn", paths, args))
    assert parsed.bundle == [str(p) for p in paths] and parsed.out == str(tmp_path)
    assert (parsed.model, parsed.data) == (str(ROOT / "artifacts/tiny-huginn"),
                                           str(ROOT / "artifacts/data/python-heldout.jsonl"))
    assert parsed.tasks == ["loopvq_recall"] and parsed.limit == 12 and parsed.dtype == "bfloat16"
    assert parsed.baseline == ["last-step-kv", "kivi2", "kivi4", "fp8"]
    assert parsed.passkey_lengths == [256, 1024, 2040] and parsed.passkey_trials == 2
    assert parsed.device == "cpu" and parsed.num_sequences == 8 and parsed.recent_window is None
    none = er.parser().parse_args(["--passkey-lengths", "", "--limit", "0", "--recent-window", "0"])
    parsed = eval_parser().parse_args(er.eval_argv("ouro", paths[:1], none))
    assert parsed.passkey_lengths == [] and parsed.limit is None and parsed.recent_window == 0
    assert parsed.data == str(ROOT / "artifacts/data/shakespeare-heldout.jsonl")


def test_an_unknown_method_or_width_is_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        er.main(["--methods", "loopvq,vq", "--widths", "0.5,1", "--runs", str(tmp_path / "runs")])
    assert exit_.value.code == 2 and not (tmp_path / "runs").exists()
    err = capsys.readouterr().err
    assert "unknown method or width vq, 1 (methods cq,tasq,loopvq,tasq+loopvq,tasq+loopvq-channels; widths 0.5,0.25)" in err


def test_setup_records_the_command_the_settings_and_each_bundle():
    runs = er.plan(("loopvq",), (0.25,))
    record = er.setup("huginn", runs, ["--model", "huginn", "--limit", "12"], seconds={"calibration": 1.0})
    assert record["command"] == "python benchmarks/quality/eval_reference.py --model huginn --limit 12"
    assert record["bundles"] == [
        {"name": "tiny-huginn-loopvq-0.25bit", "method": "loopvq", "width": 0.25, "finetuned": True},
        {"name": "tiny-huginn-loopvq-0.25bit-kmeans", "method": "loopvq", "width": 0.25, "finetuned": False}]
    cal = record["calibration"]
    assert (record["model"], record["heldout"], cal["dataset"]) == (
        "huginn", "artifacts/data/python-heldout.jsonl", "artifacts/data/python-calib.jsonl")
    assert cal["group_size"] == {"0.5": 16, "0.25": 32} and cal["finetune"] == asdict(FinetuneConfig())
    assert record["commit"] and record["seconds"] == {"calibration": 1.0} and record["device"] == "cpu"


@pytest.mark.slow  # about 80 s on 2 CPU cores: two calibrations and a served evaluation of 4 entries
def test_a_tiny_huginn_run_writes_what_the_quality_table_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(er, "DATA", {"num_sequences": 8, "sequence_length": 256, "heldout_sequences": 2,
                                     "sink_tokens": 8})
    monkeypatch.setattr(er, "FINETUNE", {"epochs": 1})
    monkeypatch.setattr(er, "BASELINES", "fp8")
    out = tmp_path / "results" / "eval-reference-huginn"
    status = er.main(["--model", "huginn", "--methods", "loopvq", "--widths", "0.5", "--limit", "1",
                      "--passkey-lengths", "256", "--passkey-trials", "1", "--kl-sequences", "1", "--workers", "1",
                      "--runs", str(tmp_path / "runs"), "--out", str(out)])
    assert status == 0
    codebooks = next(p for p in (tmp_path / "runs" / "loopvq-0.5" / "kmeans").iterdir() if p.is_file())
    assert os.path.samefile(codebooks, tmp_path / "runs" / "loopvq-0.5-kmeans" / "kmeans" / codebooks.name)
    result = qt.load("huginn", tmp_path / "results")
    names = [e["name"] for e in result["report"]["served"]["entries"]]
    assert names == ["bfloat16", "tiny-huginn-loopvq-0.5bit", "tiny-huginn-loopvq-0.5bit-kmeans", "fp8"]
    assert [b["name"] for b in result["setup"]["bundles"]] == names[1:3]
    assert [row[:3] for row in qt.rows(result)] == [["bfloat16", "16 / 16", ""], ["LoopVQ", "0.5 / 0.5", "yes"],
                                                   ["LoopVQ", "0.5 / 0.5", "no"], ["fp8", "8 / 8", ""]]
    assert (out / "accuracy_vs_bytes.png").is_file() and result["setup"]["seconds"]["loopvq-eval"] > 0
