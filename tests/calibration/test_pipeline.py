"""The staged run: fingerprinted reuse and invalidation, determinism, in-memory stores, multi-process, start-up
timings. Crash recovery and resume: test_pipeline_resume.py; the console script: test_pipeline_cli.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.builders import tiny_config

import loopvq_calib.calibration.stage_table as stage_table
from loopvq_calib.calibration.pipeline import Pipeline, calibrate
from loopvq_calib.calibration.stage_table import STAGES
from loopvq_calib.config.load import load_config


def without_timings(path: Path):
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not k.startswith("seconds")}
        return [strip(v) for v in x] if isinstance(x, list) else x

    return strip(json.loads(path.read_text()))


def test_full_run_then_reuse_then_partial_invalidation(tiny_ouro_dir, calib_corpus, tmp_path):
    out = tmp_path / "run"
    first = calibrate(tiny_config(tiny_ouro_dir, calib_corpus, out))
    assert [s["name"] for s in first.stages] == ["data", "capture", "kmeans", "finetune", "bundle"]
    assert all(not s["reused"] for s in first.stages) and first.bundle == out / "bundle"
    assert (out / "bundle" / "loopvq.json").is_file() and (out / "run.log").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model_identity"]["config_sha256"] and manifest["data_sha256"] and manifest["toolkit_version"]
    assert len(manifest["finetune_curve"]) == 3

    again = calibrate(tiny_config(tiny_ouro_dir, calib_corpus, out))
    assert all(s["reused"] for s in again.stages)

    changed = calibrate(tiny_config(tiny_ouro_dir, calib_corpus, out, finetune={"epochs": 2, "lr": 5e-3}))
    assert {s["name"]: s["reused"] for s in changed.stages} == {
        "data": True,
        "capture": True,
        "kmeans": True,
        "finetune": False,
        "bundle": False,
    }

    requant = calibrate(tiny_config(tiny_ouro_dir, calib_corpus, out, quant={"method": "cq"}))
    assert {s["name"]: s["reused"] for s in requant.stages} == {
        "data": True,
        "capture": True,
        "kmeans": False,
        "finetune": False,
        "bundle": False,
    }


def test_stages_option_stops_early_and_tasq_only_for_tasq_methods(tiny_ouro_dir, calib_corpus, tmp_path):
    out = tmp_path / "run"
    res = calibrate(
        tiny_config(tiny_ouro_dir, calib_corpus, out, quant={"method": "tasq"}), stages=["capture", "kmeans"]
    )
    assert [s["name"] for s in res.stages] == ["data", "capture", "tasq", "kmeans"]
    assert not (out / "finetune").exists() and res.bundle is None
    assert (out / "tasq" / "tasq.safetensors").is_file() and (out / "kmeans" / "quantizer.safetensors").is_file()


def test_two_runs_with_the_same_seed_are_byte_identical(tiny_ouro_dir, calib_corpus, tmp_path, monkeypatch):
    """Run a keeps the k-means and fine-tuning results it saved (no file read back); run b reads them back from
    its files, as a reused stage does: the same bytes everywhere, so the kept values are the reread ones."""
    reads = []
    table = tuple(
        dataclasses.replace(s, load=lambda folder, s=s: reads.append(s.name) or s.load(folder))
        if s.name in ("kmeans", "finetune")
        else s
        for s in STAGES
    )
    a = Pipeline(load_config(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "a")), table=table).run_all().run_dir
    assert reads == []
    for name in ("as_saved_quantizer", "as_saved_finetune"):
        monkeypatch.setattr(stage_table, name, lambda result: None)
    b = Pipeline(load_config(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "b")), table=table).run_all().run_dir
    assert reads == ["kmeans", "finetune"]
    for stage in ("data", "capture", "kmeans", "finetune"):
        for path in sorted((a / stage).iterdir()):
            if path.name == "report.json":  # holds wall times; everything else in it must match
                assert without_timings(path) == without_timings(b / stage / path.name)
            else:
                assert path.read_bytes() == (b / stage / path.name).read_bytes(), f"{stage}/{path.name}"
    assert (a / "bundle" / "codebooks.safetensors").read_bytes() == (
        b / "bundle" / "codebooks.safetensors"
    ).read_bytes()


@pytest.mark.parametrize(
    "store", ["memory"]
)  # "device" on a CPU is "memory"; its GPU case is in test_capture_memory.py
def test_in_memory_stores_give_the_disk_codebooks_and_later_stages_are_reused(
    tiny_ouro_dir, calib_corpus, tmp_path, store
):
    """An in-memory capture is never kept, but the stages after it are reused (their fingerprints do not
    depend on the store), so a rerun skips the capture; a changed k-means setting captures again."""
    disk = calibrate(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "disk"), stages=["capture", "kmeans"]).run_dir
    cfg = tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / store, capture={"store": store, "dtype": "bfloat16"})
    run = calibrate(cfg, stages=["capture", "kmeans"]).run_dir
    assert not list((run / "capture").glob("seq*.safetensors"))
    assert json.loads((run / "capture" / "meta.json").read_text())["store"] == store
    a, b = load_file(disk / "kmeans" / "quantizer.safetensors"), load_file(run / "kmeans" / "quantizer.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    again = calibrate(cfg, stages=["capture", "kmeans"])
    assert {s["name"]: s["reused"] for s in again.stages} == {"data": True, "kmeans": True}
    changed = tiny_config(
        tiny_ouro_dir,
        calib_corpus,
        tmp_path / store,
        capture={"store": store, "dtype": "bfloat16"},
        kmeans={"iterations": 3},
    )
    rerun = calibrate(changed, stages=["capture", "kmeans"])
    assert {s["name"]: s["reused"] for s in rerun.stages} == {"data": True, "capture": False, "kmeans": False}


@pytest.mark.slow
@pytest.mark.parametrize("store, method", [("disk", "loopvq"), ("memory", "loopvq"), ("memory", "tasq+loopvq")])
def test_two_cpu_processes_equal_one(tiny_ouro_dir, calib_corpus, tmp_path, store, method):
    """accelerate launch, 2 processes on gloo: capture shards sequences (disk: files; memory: each process
    receives its layouts of the other's sequences), TaSQ and k-means share the layouts, fine-tuning averages
    gradients. Everything up to k-means equals the single-process run exactly."""
    import yaml

    cfg = tiny_config(
        tiny_ouro_dir,
        calib_corpus,
        tmp_path / "x",
        finetune={"epochs": 1, "batch_size": 2, "lr": 1e-2},
        capture={"store": store},
        quant={"method": method},
    )
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    single = calibrate(cfg, output=tmp_path / "one").run_dir
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # accelerate's multi-process launcher (its flag says GPU; without CUDA our processes use gloo on CPU)
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        "loopvq_calib",
        "--config",
        str(cfg_path),
        "--output",
        str(tmp_path / "two"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = tmp_path / "two"
    shards = sorted((single / "capture").glob("seq*.safetensors"))
    assert len(shards) == (6 if store == "disk" else 0)
    for path in shards:
        assert path.read_bytes() == (two / "capture" / path.name).read_bytes()
    recorded = json.loads((two / "manifest.json").read_text())["stages"]["capture"]["sha256"]  # both processes' shards
    assert recorded == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (two / "capture").iterdir()}
    if "tasq" in method:
        tasq_a, tasq_b = (load_file(run / "tasq" / "tasq.safetensors") for run in (single, two))
        assert tasq_a.keys() == tasq_b.keys() and all(torch.equal(tasq_a[n], tasq_b[n]) for n in tasq_a)
        reports = [json.loads((run / "tasq" / "tasq.json").read_text()) for run in (single, two)]
        for report in reports:  # wall-clock phase timings differ between runs; everything else must not
            assert set(report["report"].pop("seconds")) == {"query_stats", "load", "covariance", "grouping", "report"}
        assert reports[0] == reports[1]
    kmeans_a = load_file(single / "kmeans" / "quantizer.safetensors")
    kmeans_b = load_file(two / "kmeans" / "quantizer.safetensors")
    assert kmeans_a.keys() == kmeans_b.keys() and all(torch.equal(kmeans_a[n], kmeans_b[n]) for n in kmeans_a)
    a = load_file(single / "finetune" / "quantizer.safetensors")
    b = load_file(two / "finetune" / "quantizer.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)
    curve_a = json.loads((single / "finetune" / "curve.json").read_text())["curve"]
    curve_b = json.loads((two / "finetune" / "curve.json").read_text())["curve"]
    assert curve_a[1]["selection_kl"] == pytest.approx(curve_b[1]["selection_kl"], rel=1e-4)
    assert json.loads((two / "manifest.json").read_text())["processes"] == 2


def test_edited_corpus_reruns_the_data_stage(tiny_ouro_dir, calib_corpus, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(calib_corpus.read_bytes())
    cfg = tiny_config(tiny_ouro_dir, corpus, tmp_path / "run")
    first = calibrate(cfg, stages=["data"]).run_dir
    ids = load_file(first / "data" / "sequences.safetensors")["input_ids"]
    assert all(s["reused"] for s in calibrate(cfg, stages=["data"]).stages)
    lines = corpus.read_text().splitlines()
    corpus.write_text("\n".join(reversed(lines)) + "\n")
    again = calibrate(cfg, stages=["data"])
    assert not again.stages[0]["reused"]
    assert not torch.equal(load_file(first / "data" / "sequences.safetensors")["input_ids"], ids)


def test_the_manifest_records_the_start_up_steps(tiny_ouro_dir, calib_corpus, tmp_path):
    """Every check before the first stage is timed into the manifest's ``startup`` (with the seconds from the
    process's start), so a slow start can be told apart from slow stages."""
    import time

    before = time.time()
    result = calibrate(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run"), stages=["data"])
    startup = json.loads((result.run_dir / "manifest.json").read_text())["startup"]
    steps = (
        "processes_s",
        "model_shape_s",
        "model_identity_s",
        "kmeans_backend_s",
        "data_fingerprint_s",
        "calibration_set_s",
        "pipeline_init_s",
    )
    assert set(steps) <= set(startup) and all(startup[k] >= 0 for k in steps) and result.is_main
    assert startup["pipeline_init_s"] >= sum(startup[k] for k in steps[:-1]) - 0.01  # the parts are inside the whole
    assert before <= startup["entered_at"] <= time.time() and startup["process_start_s"] > 0


def test_a_config_built_in_code_gets_its_derived_values_on_a_copy(tiny_ouro_dir, calib_corpus, tmp_path):
    """``Pipeline`` fills what a Config built in code leaves null (here ``capture.fisher_channels``: the largest
    exact value, as the loader does) on a copy, so validation and capture agree and the caller's object is kept."""
    from loopvq_calib.config.validate import exact_fisher_channels

    cfg = load_config(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run"))
    cfg.capture.fisher_channels = None
    pipeline = Pipeline(cfg, None, ["data"])
    assert pipeline.cfg.capture.fisher_channels == exact_fisher_channels(cfg.quant) > 1
    assert pipeline.cfg.capture.channels_per_fisher == exact_fisher_channels(cfg.quant)
    assert cfg.capture.fisher_channels is None
