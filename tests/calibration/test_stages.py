"""The stages as plain functions, called without a Pipeline: the capture returns its reader (memory and disk
read alike), k-means returns and saves its report, parts are joined."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_ouro
from support.builders import tiny_run_config
from support.quantizers import sampled_quantizer

from loopvq_calib.calibration.capture.store import StoreChoice
from loopvq_calib.calibration.finetune.train import FinetuneResult
from loopvq_calib.calibration.stages import (
    KMeansReport,
    as_saved_finetune,
    as_saved_quantizer,
    join_parts,
    load_calibration,
    load_finetune,
    load_quantizer,
    run_capture,
    run_kmeans,
    save_calibration,
    save_finetune,
)
from loopvq_calib.data.corpus import CalibrationSet
from loopvq_calib.runtime.processes import SINGLE


def test_capture_returns_its_reader_and_kmeans_its_report(tmp_path):
    model, cfg = make_tiny_ouro(), tiny_run_config()
    kv = model.kv_layout()
    calib = CalibrationSet(
        torch.randint(0, 4096, (4, 32), generator=torch.Generator().manual_seed(0)), [0, 1, 2], [3], 4
    )
    readers = {}
    for store in ("memory", "disk"):
        folder = tmp_path / store
        folder.mkdir()
        readers[store] = run_capture(
            model, calib, kv, cfg=cfg, store=StoreChoice(store, "test"), folder=folder, dist=SINGLE
        )
    on_disk = json.loads((tmp_path / "disk" / "meta.json").read_text())
    assert readers["memory"].meta == {**on_disk, "store": "memory"} and readers["disk"].meta == on_disk
    assert (
        on_disk["store"] == "disk" and json.loads((tmp_path / "memory" / "meta.json").read_text())["store"] == "memory"
    )
    for name in ("key", "fisher_value"):
        assert torch.equal(readers["memory"].load(name, (0, 1)), readers["disk"].load(name, (0, 1)))
    out = tmp_path / "kmeans"
    out.mkdir()
    report = run_kmeans(readers["disk"], None, kv, cfg=cfg, folder=out, dist=SINGLE, device=torch.device("cpu"))
    assert isinstance(report, KMeansReport) and len(report.totals) == 1
    assert list(report.layouts) == list(report.quantizer.codecs) and not (out / "part0").exists()
    again = KMeansReport.load(out)
    assert again.layouts == json.loads(json.dumps(report.layouts)) and again.totals == report.totals
    for key, codec in report.quantizer.codecs.items():
        assert torch.equal(again.quantizer.codecs[key].codebook, codec.codebook)
    assert_same_quantizer(as_saved_quantizer(report.quantizer), load_quantizer(out), report.quantizer)
    tuned = FinetuneResult(
        report.quantizer,
        1,
        [
            {"epoch": 0, "step": 0, "selection_kl": 1 / 3},
            {"epoch": 1, "step": 2, "selection_kl": 0.1, "train_kl": 2 / 7},
        ],
        teacher_kept=3,
        best_step=2,
    )
    (tmp_path / "finetune").mkdir()
    save_finetune(tuned, tmp_path / "finetune")
    kept, read = as_saved_finetune(tuned), load_finetune(tmp_path / "finetune")
    assert (kept.best_epoch, kept.best_step, kept.curve, kept.teacher_kept) == (
        read.best_epoch,
        read.best_step,
        read.curve,
        read.teacher_kept,
    )
    assert_same_quantizer(kept.quantizer, read.quantizer, report.quantizer)


def assert_same_quantizer(kept, read, source) -> None:
    """``kept`` equals ``read`` (metadata; each codec's own codebook, group table and TaSQ weight: values, dtype
    and device) and shares no memory with ``source``."""
    assert kept.meta() == read.meta() and kept.codecs.keys() == read.codecs.keys()
    for key, codec in kept.codecs.items():
        other = read.codecs[key]
        assert (codec.transform is None) == (other.transform is None), key
        pairs = [(codec.codebook, other.codebook), (codec.layout.groups, other.layout.groups)]
        if codec.transform is not None:
            pairs.append((codec.transform.weight, other.transform.weight))
            assert codec.transform.sigma_min == other.transform.sigma_min, key
        for ours, theirs in pairs:
            assert ours.dtype == theirs.dtype and ours.device == theirs.device and torch.equal(ours, theirs), key
        assert codec.codebook.data_ptr() != source.codecs[key].codebook.data_ptr()


def test_calibration_round_trip_and_parts(tmp_path):
    calib = CalibrationSet(torch.arange(12).view(3, 4), [0, 1], [2], 1, {"source": "test"})
    details = save_calibration(calib, tmp_path)
    back = load_calibration(tmp_path)
    assert torch.equal(back.input_ids, calib.input_ids) and (back.train, back.heldout) == ([0, 1], [2])
    assert details["content_sha256"] == back.content_hash == calib.content_hash and details["tokens"] == 12
    parts = join_parts(
        SINGLE, tmp_path, lambda d: (d / "x.txt").write_text("part"), load=lambda d: (d / "x.txt").read_text()
    )
    assert parts == ["part"] and not (tmp_path / "part0").exists()


def test_same_quantizer_check_sees_each_codecs_own_tensors():
    """The round-trip check compares what the codecs hold, not their exported copies (which are always CPU with
    fixed dtypes): a group table in int32 instead of int64, or a TaSQ weight in float64, fails it."""
    model = make_tiny_ouro()
    source = sampled_quantizer(
        model,
        torch.randint(0, 4096, (1, 16), generator=torch.Generator().manual_seed(0)),
        "tasq+loopvq",
        codebook_size=8,
    )
    kept, read = as_saved_quantizer(source), as_saved_quantizer(source)
    assert_same_quantizer(kept, read, source)
    groups = as_saved_quantizer(source)
    next(iter(groups.codecs.values())).layout.groups = next(iter(read.codecs.values())).layout.groups.int()
    weight = as_saved_quantizer(source)
    transform = next(iter(weight.codecs.values())).transform
    transform.weight = transform.weight.double()
    for wrong in (groups, weight):
        with pytest.raises(AssertionError):
            assert_same_quantizer(kept, wrong, source)
