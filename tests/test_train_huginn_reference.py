"""scripts/train_huginn_reference.py: prepare on a few stdlib files, train 3 steps on the CPU, and the saved folder
loads through the toolkit's loader with the trained model's logits and 8 recurrences by default."""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
import torch
from conftest import load_script
from safetensors import safe_open

from loopvq_calib.models import KVRecorder, kv_hook
from loopvq_calib.models.loading import load_model, load_tokenizer

thr = load_script("train_huginn_reference")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(data folder, model folder, in-memory trained model) of a tiny prepare + 3-step train."""
    root = tmp_path_factory.mktemp("huginn")
    data, out = root / "data", root / "model"
    thr.prepare(
        thr.parser().parse_args(["prepare", "--out", str(data), "--max-files", "8", "--heldout-fraction", "0.3"])
    )
    model = thr.train(
        thr.parser().parse_args(
            [
                "train",
                "--data",
                str(data),
                "--out",
                str(out),
                "--steps",
                "3",
                "--batch",
                "2",
                "--seq-len",
                "32",
                "--windows",
                "2",
                "--eval-every",
                "1",
                "--warmup",
                "1",
                "--device",
                "cpu",
                "--max-recurrence",
                "6",
            ]
        )
    )
    return data, out, model


def test_prepare_writes_token_ids_that_decode_to_the_held_out_files(trained):
    data, _, _ = trained
    meta = json.loads((data / "meta.json").read_text())
    held = [json.loads(line) for line in (data / "python-heldout.jsonl").read_text().splitlines()]
    assert sorted(d["source"] for d in held) == meta["heldout_files"] and len(held) == round(8 * 0.3)
    tokenizer = load_tokenizer(data / "tokenizer")
    ids = np.load(data / "heldout.npy")
    assert ids.dtype == np.uint16 and len(ids) == meta["heldout_tokens"]
    assert tokenizer.decode(ids.tolist()) == "".join(d["text"] + "<|endoftext|>" for d in held)
    train_ids = np.load(data / "train.npy")
    assert int(train_ids.max()) < thr.ARCH["vocab_size"] and (train_ids == 0).sum() == meta["files"] - len(held)
    assert len(train_ids) == meta["train_tokens"]


def test_the_saved_folder_loads_with_the_trained_logits_and_eight_recurrences(trained):
    _, out, model = trained
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "huginn_raven" and config["mean_recurrence"] >= 8
    loaded, _ = load_model(out, "bfloat16", torch.device("cpu"))
    assert loaded.kv_layout().loop_steps == config["mean_recurrence"]
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and all(s.stat().st_size < 8e6 for s in shards)  # each under 8 MB
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert sum(s.stat().st_size for s in shards) < 20e6
    ids = torch.randint(0, thr.ARCH["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    state = torch.randn(2, 24, thr.ARCH["n_embd"], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        ours = loaded(ids, input_states=state).logits
        theirs = model(ids, input_states=state, num_steps=8).logits
    assert torch.equal(ours, theirs)
    log = json.loads((out / "train_log.json").read_text())["log"]
    assert [e["step"] for e in log] == [1, 2, 3] and all(np.isfinite(e["heldout_loss"]) for e in log)


def test_truncated_loss_equals_the_full_forward_loss_and_draws_recurrences_around_the_mean(trained):
    _, _, model = trained
    model = copy.deepcopy(model).float()
    ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), model.seeded_initial_state(0):
        full = model(ids, labels=ids, num_steps=5).loss
        truncated = thr.truncated_loss(model, ids, 3, grad=2)
    assert torch.allclose(full, truncated, atol=1e-5)
    rng = random.Random(0)
    draws = [thr.sample_recurrence(rng, 8, 4, cap=24) for _ in range(4000)]
    assert all(0 < grad <= 4 and free + grad <= 24 for free, grad in draws)
    assert abs(np.mean([free + grad for free, grad in draws]) - 9.0) < 0.3  # 1 + E[Poisson-lognormal] = 1 + mean


def test_report_writes_losses_per_recurrence_and_retrieval_rates(trained, tmp_path):
    data, out, _ = trained
    path = tmp_path / "report.json"
    thr.report(
        thr.parser().parse_args(
            [
                "report",
                "--data",
                str(data),
                "--model",
                str(out),
                "--out",
                str(path),
                "--device",
                "cpu",
                "--recurrences",
                "1",
                "8",
                "--lengths",
                "96",
                "--items",
                "2",
                "--seq-len",
                "32",
                "--windows",
                "2",
            ]
        )
    )
    result = json.loads(path.read_text())
    for dtype in ("float32", "bfloat16"):
        assert set(result[dtype]["heldout_loss_per_recurrence"]) == {"1", "8"}
        rows = result[dtype]["retrieval"]
        assert [r["kind"] for r in rows] == list(thr.KINDS) and all(r["exact"] in (0.0, 0.5, 1.0) for r in rows)
        assert all(r["mean_tokens"] <= 96 for r in rows)


def test_train_stops_at_max_seconds_and_still_saves(trained, tmp_path):
    data, _, _ = trained
    out = tmp_path / "stopped"
    thr.train(
        thr.parser().parse_args(
            [
                "train",
                "--data",
                str(data),
                "--out",
                str(out),
                "--steps",
                "1000",
                "--batch",
                "1",
                "--seq-len",
                "16",
                "--windows",
                "1",
                "--device",
                "cpu",
                "--max-seconds",
                "0",
            ]
        )
    )
    log = json.loads((out / "train_log.json").read_text())["log"]
    assert [e["step"] for e in log] == [1]
    load_model(out, "float32", torch.device("cpu"))  # a whole, loadable folder


def test_structure_correlates_each_core_layer_across_its_recurrences(trained, tmp_path):
    data, out, _ = trained
    file = tmp_path / "structure.json"
    thr.structure(
        thr.parser().parse_args(
            ["structure", "--data", str(data), "--model", str(out), "--out", str(file), "--seq-len", "24"]
        )
    )
    result = json.loads(file.read_text())
    assert result["recurrences"] == 8 and result["tokens_for_correlation"] == 16 * 16
    model, _ = load_model(out, "float32", torch.device("cpu"))
    core = [s for s in model.kv_layout().sites if s.looped]
    held = torch.from_numpy(np.load(data / "heldout.npy")[: 16 * 24].astype(np.int64)).view(16, 24)
    rec = KVRecorder()
    torch.manual_seed(0)  # the like-init state is drawn at random: the script's draw
    with torch.no_grad(), kv_hook(model, rec):
        model(held)
    keys = [rec.keys[s.site][:, 8:].flatten(0, 1).double() for s in core if s.layer == 0]  # layer 0, steps in order
    z = [(k - k.mean(0)) / (k - k.mean(0)).norm(dim=0) for k in keys]
    first_pair = (z[0] * z[1]).sum(0).abs().mean().item()  # steps 1-2, mean over heads and channels
    layer1 = [rec.keys[s.site][:, 8:].flatten(0, 1).double() for s in core if s.layer == 1]
    y = [(k - k.mean(0)) / (k - k.mean(0)).norm(dim=0) for k in layer1]
    expected = (first_pair + (y[0] * y[1]).sum(0).abs().mean().item()) / 2  # averaged over the two core layers
    got = result["correlation"]["key"]
    assert got["layers"] == 2 and len(got["adjacent_steps"]) == 7
    assert got["adjacent_steps"][0] == pytest.approx(expected, rel=1e-5)
