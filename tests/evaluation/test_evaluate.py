"""Evaluation metrics against independent computations; loopvq-eval's report and gates."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from conftest import DATA, REFERENCE_MODEL, make_tiny_huginn, make_tiny_ouro, needs_lm_eval
from support.quantizers import sampled_quantizer

from loopvq_calib.bundle.reader import BundleError
from loopvq_calib.cli import eval_main
from loopvq_calib.data.files import DataError
from loopvq_calib.evaluation.evaluate import EvalReport, check_gates, evaluate, evaluate_quantizer
from loopvq_calib.evaluation.inputs import EvalInputError
from loopvq_calib.evaluation.options import Gates
from loopvq_calib.evaluation.report import markdown_report
from loopvq_calib.models.loading import load_model, model_identity


def explicit_metrics(model, ids, quantizer, sink, only_step=None):
    """KL, NLL sums and per-site squared errors written out by hand: record every site's pre-RoPE K/V,
    decode(encode(.)) each block, substitute positions >= sink (only at ``only_step`` when given)."""
    rec = {}

    def record(site, k, v, pos):
        rec[site] = (k.clone(), v.clone())
        return k, v

    p_logits = model(ids, kv_hook=record).logits.double()
    recon = {}
    for codec in quantizer.codecs.values():
        slot = 0 if codec.layout.kind == "key" else 1
        x = torch.stack([rec[s][slot] for s in codec.layout.sites], dim=2)  # [B, S, T, H, D]
        y = codec.decode(codec.encode(x.flatten(0, 1))).reshape(x.shape)
        for m, s in enumerate(codec.layout.sites):
            recon.setdefault(s, [None, None])[slot] = y[:, :, m]
    steps = {s.site: s for s in quantizer.kv.sites}

    def substitute(site, k, v, pos):
        if only_step is not None and not (steps[site].looped and steps[site].step == only_step):
            return k, v
        k, v = k.clone(), v.clone()
        k[:, sink:], v[:, sink:] = recon[site][0][:, sink:], recon[site][1][:, sink:]
        return k, v

    q_logits = model(ids, kv_hook=substitute).logits.double()
    p, q = torch.softmax(p_logits, -1), torch.softmax(q_logits, -1)
    kl = (p * (p.log() - q.log())).sum(-1)[:, sink:]
    tgt = ids[:, sink:]

    def nll(logits):
        return -torch.log_softmax(logits[:, sink - 1 : -1], -1).gather(-1, tgt[..., None]).sum().item()

    err = {s: [(rec[s][i][:, sink:] - recon[s][i][:, sink:]).pow(2).sum().item() for i in (0, 1)] for s in rec}
    ref = {s: [rec[s][i][:, sink:].pow(2).sum().item() for i in (0, 1)] for s in rec}
    return kl.sum().item(), kl.numel(), nll(p_logits), nll(q_logits), tgt.numel(), err, ref


@pytest.mark.parametrize("make, method, steps", [(make_tiny_ouro, "loopvq", 4), (make_tiny_huginn, "tasq+loopvq", 2)])
def test_metrics_equal_independent_computation(make, method, steps):
    model = make()
    gen = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, 4096, (2, 24), generator=gen)
    q = sampled_quantizer(
        model,
        torch.randint(0, 4096, (1, 40), generator=gen),
        method,
        codebook_size=16,
        group_size=8,
        steps_per_block=steps,
    )
    sink = 4
    r = evaluate_quantizer(model, seqs, q, sink_tokens=sink)
    parts = [explicit_metrics(model, seqs[i : i + 1], q, sink) for i in range(2)]
    kl = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    assert r["eval_kl"] == pytest.approx(kl, rel=1e-4, abs=1e-7)
    assert r["kl_positions"] == 2 * (24 - sink) and r["nll_targets"] == 2 * (24 - sink)
    ppl_fp = math.exp(sum(p[2] for p in parts) / sum(p[4] for p in parts))
    ppl_q = math.exp(sum(p[3] for p in parts) / sum(p[4] for p in parts))
    assert r["ppl_fp"] == pytest.approx(ppl_fp, rel=1e-5)
    assert r["ppl_quantized"] == pytest.approx(ppl_q, rel=1e-5)
    assert r["ppl_increase"] == pytest.approx(ppl_q / ppl_fp - 1, rel=1e-4, abs=1e-7)
    for row in r["nmse_per_site"]:
        s = row["site"]
        for i, kind in enumerate(("key", "value")):
            want = sum(p[5][s][i] for p in parts) / sum(p[6][s][i] for p in parts)
            assert row[kind] == pytest.approx(want, rel=1e-5)
    kv = q.kv
    for kind in ("key", "value"):
        i = 0 if kind == "key" else 1
        for t in range(kv.loop_steps):
            sites = [s.site for s in kv.sites if s.looped and s.step == t]
            want = sum(p[5][s][i] for p in parts for s in sites) / sum(p[6][s][i] for p in parts for s in sites)
            assert r["nmse_per_step"][kind][t] == pytest.approx(want, rel=1e-5)
    assert len(r["per_step_kl"]) == kv.loop_steps
    t = kv.loop_steps - 1
    step_parts = [explicit_metrics(model, seqs[i : i + 1], q, sink, only_step=t) for i in range(2)]
    assert r["per_step_kl"][t] == pytest.approx(sum(p[0] for p in step_parts) / sum(p[1] for p in step_parts), rel=1e-4)
    assert r["bits"] == q.bits() and r["codebook_bytes"] == q.codebook_bytes()


@pytest.mark.parametrize("name", ["kivi2", "last-step-kv", "fp8"])
def test_baseline_metrics_equal_independent_computation(name):
    """Baselines go through the same evaluation as bundles (KL against the hand computation)."""
    from loopvq_calib.codes.baselines import make_baseline

    model = make_tiny_ouro()
    seqs = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(2))
    q = make_baseline(name, model.kv_layout(), group=16)
    r = evaluate_quantizer(model, seqs, q, sink_tokens=4, per_step=False)
    parts = [explicit_metrics(model, seqs[i : i + 1], q, 4) for i in range(2)]
    assert r["eval_kl"] == pytest.approx(sum(p[0] for p in parts) / sum(p[1] for p in parts), rel=1e-4, abs=1e-7)
    assert r["eval_kl"] > 0 and r["method"] == name and r["codebook_bytes"] == 0


@pytest.mark.parametrize("method", ["loopvq", "cq"])
def test_codebooks_holding_every_group_vector_give_zero(method):
    model = make_tiny_ouro()
    seqs = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(5))
    q = sampled_quantizer(model, seqs, method, codebook_size=64, group_size=8)  # 64 >= 48 tokens
    r = evaluate_quantizer(model, seqs, q, sink_tokens=4)
    assert r["eval_kl"] <= 1e-12 and max(r["per_step_kl"]) <= 1e-12
    assert r["ppl_increase"] == pytest.approx(0.0, abs=1e-12)
    assert r["nmse"] == {"key": 0.0, "value": 0.0}
    assert all(row["key"] == 0.0 and row["value"] == 0.0 for row in r["nmse_per_site"])


@pytest.fixture(scope="module")
def reference():
    model, tok = load_model(REFERENCE_MODEL, "float32", torch.device("cpu"))
    lines = [json.loads(x)["text"] for x in (DATA / "shakespeare-heldout.jsonl").read_text().splitlines()]
    held = torch.tensor([tok(lines[0][:3000])["input_ids"][:48]])
    calib_text = json.loads((DATA / "shakespeare-calib.jsonl").read_text().splitlines()[0])["text"][:3000]
    calib = torch.tensor([tok(calib_text)["input_ids"][:96]])
    return model, held, calib


def test_per_step_table_on_the_reference_model(reference):
    model, held, calib = reference
    q = sampled_quantizer(model, calib, "loopvq", codebook_size=16, group_size=16, steps_per_block=4)
    r = evaluate_quantizer(model, held, q, sink_tokens=8)
    assert len(r["per_step_kl"]) == 4 and all(v > 0 for v in r["per_step_kl"])
    assert r["eval_kl"] > max(r["per_step_kl"])
    assert r["ppl_quantized"] > r["ppl_fp"]
    assert r["bits"] == {"key": 0.25, "value": 0.25}


def test_check_gates():
    rows = [
        {"name": "a", "eval_kl": 0.02, "ppl_fp": 10.0, "ppl_quantized": 10.3, "ppl_increase": 0.03},
        {"name": "b", "eval_kl": 0.08, "ppl_fp": 10.0, "ppl_quantized": 11.0, "ppl_increase": 0.1},
    ]
    assert check_gates(rows, None, None) == []
    assert check_gates(rows, 0.08, 0.1) == []  # equality passes
    fails = check_gates(rows, 0.05, 0.05)
    assert len(fails) == 2 and fails[0].startswith("b: evaluation KL") and "perplexity increase" in fails[1]
    assert check_gates([{**rows[0], "eval_kl": float("nan")}], 1.0, None)  # NaN never passes


@pytest.fixture(scope="module")
def bundle_dir(reference, tmp_path_factory):
    from loopvq_calib.bundle import writer as bundle
    from loopvq_calib.config.schema import ServingConfig

    model, _, calib = reference
    q = sampled_quantizer(model, calib, "loopvq", codebook_size=16, group_size=16, steps_per_block=4)
    out = tmp_path_factory.mktemp("bundles") / "crude"
    curve = [{"epoch": 0, "train_kl": None, "heldout_kl": 0.3}, {"epoch": 1, "train_kl": 0.2, "heldout_kl": 0.25}]
    bundle.write_bundle(
        out,
        q,
        name="crude-0.25bit",
        identity=model_identity(REFERENCE_MODEL, str(REFERENCE_MODEL)),
        calibration={},
        metrics={"heldout_kl": 0.25, "finetune_curve": curve},
        serving=ServingConfig(sink_tokens=8, recent_window=64, page_size=8),
        codebook_dtype="float32",
        config={},
        producer_version="test",
    )
    return out


def test_evaluate_returns_the_report_and_the_gate_failures(bundle_dir):
    """The library returns the report and the failed gates and prints nothing."""
    passed = evaluate(
        [bundle_dir],
        num_sequences=1,
        sequence_length=32,
        device="cpu",
        gates=Gates(max_kl=100.0, max_ppl_increase=100.0),
    )
    assert isinstance(passed, EvalReport) and passed.passed and passed.gate_failures == []
    (row,) = passed.report["bundles"]
    assert row["name"] == "crude-0.25bit" and row["method"] == "loopvq" and row["sink_tokens"] == 8
    assert passed.report["data"]["num_sequences"] == 1 and row["kl_positions"] == 32 - 8
    assert len(row["per_step_kl"]) == 4 and row["eval_kl"] > 0 and row["selection_kl"] == 0.25
    assert passed.report["loop_steps"] == 4 and passed.report["device"] == "cpu"
    failed = evaluate([str(bundle_dir)], num_sequences=1, sequence_length=32, device="cpu", gates=Gates(max_kl=1e-9))
    assert failed.report["bundles"][0]["eval_kl"] == row["eval_kl"]  # the same sequences, the same numbers
    assert failed.gate_failures == check_gates(failed.report["bundles"], 1e-9, None) and not failed.passed
    assert failed.gate_failures[0].startswith("crude-0.25bit: evaluation KL")


def test_evaluate_raises_on_bad_input(bundle_dir, tmp_path):
    with pytest.raises(EvalInputError, match="no such bundle folder"):
        evaluate([tmp_path / "missing"], num_sequences=1, sequence_length=32)
    with pytest.raises(EvalInputError, match="nothing.jsonl: no such file"):
        evaluate([bundle_dir], data=str(tmp_path / "nothing.jsonl"), num_sequences=1, sequence_length=32)
    with pytest.raises(BundleError, match="loopvq.json"):  # a folder that is no bundle
        evaluate([tmp_path], num_sequences=1, sequence_length=32)
    with pytest.raises(EvalInputError, match="leaves no position after the 8 sink tokens"):
        evaluate([bundle_dir], num_sequences=1, sequence_length=8)
    (tmp_path / "notes.md").write_text("# not a corpus file type")
    with pytest.raises(DataError, match="--data: cannot infer the file type") as err:
        evaluate([bundle_dir], data=str(tmp_path / "notes.md"), num_sequences=1, sequence_length=32)
    assert "data.type" not in str(err.value)
    with pytest.raises(DataError, match="--num-sequences: "):
        evaluate([bundle_dir], num_sequences=10**5, sequence_length=2048)
    with pytest.raises(
        EvalInputError,
        match=r"--sequence-length 2,049 exceeds the model's window of 2,048 tokens "
        r"\(max_position_embeddings in .*config.json\)",
    ):
        evaluate([bundle_dir], num_sequences=1, sequence_length=2049)
    with pytest.raises(EvalInputError, match=r"--max-ppl-increase must be a finite number >= 0, got -1"):
        evaluate([bundle_dir], gates=Gates(max_ppl_increase=-1.0))


def test_eval_main_prints_writes_and_picks_the_exit_status(bundle_dir, tmp_path, capsys):
    """The CLI prints report.md, writes the report folder, prints each failed gate: 0, 1, or 2 for bad input."""
    out = tmp_path / "report"
    common = ["--bundle", str(bundle_dir), "--num-sequences", "1", "--sequence-length", "32", "--device", "cpu"]
    assert eval_main(common + ["--out", str(out), "--max-kl", "100", "--max-ppl-increase", "100"]) == 0
    names = {p.name for p in out.iterdir()} - {".loopvq-eval.json"}  # its record of them: test_out_folder.py
    assert names == {
        "report.json",
        "report.md",
        "kl_by_method.png",
        "kl_per_step.png",
        "nmse_per_step.png",
        "finetune_curve.png",
    }
    assert all((out / n).stat().st_size > 0 for n in names)
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    md = (out / "report.md").read_text()
    assert md == markdown_report(report) and printed.startswith(md)  # what it wrote is what it printed
    assert all(f"wrote {out / n}" in printed for n in names) and "gate failed" not in printed
    (row,) = report["bundles"]
    assert "| crude-0.25bit | loopvq | 0.250 / 0.250 | 8 |" in md and "KL step 4 only" in md
    assert "selection KL" in md and "evaluation KL" in md and f"{row['eval_kl']:.5f}" in md
    assert eval_main(common + ["--max-kl", "1e-9"]) == 1
    assert "gate failed: crude-0.25bit: evaluation KL" in capsys.readouterr().out
    (tmp_path / "report.md").write_text("not a folder")
    assert eval_main(common + ["--out", str(tmp_path / "report.md")]) == 2
    err = capsys.readouterr().err
    assert f"error: --out {tmp_path / 'report.md'}: exists and is not a folder" in err
    assert eval_main(["--bundle", str(tmp_path / "missing")]) == 2
    assert "no such bundle folder" in capsys.readouterr().err


@needs_lm_eval
@pytest.mark.slow  # quick equivalents: test_eval_main_prints_writes_and_picks_the_exit_status (report),
# test_harness (tasks, baselines served through the cache), test_report (the served plot)
def test_cli_served_tasks_and_baselines_on_the_reference_model(bundle_dir, tmp_path, capsys):
    """``loopvq-eval --tasks <local task> --baseline ...``: the bundle, the baselines and full precision side
    by side in report.json / report.md / served_accuracy.png, and the accuracy gate."""
    out = tmp_path / "served"
    argv = [
        "--bundle",
        str(bundle_dir),
        "--num-sequences",
        "1",
        "--sequence-length",
        "40",
        "--device",
        "cpu",
        "--tasks",
        "loopvq_recall",
        "--limit",
        "2",
        "--baseline",
        "kivi2,last-step-kv",
        "--recent-window",
        "16",
        "--out",
        str(out),
        "--max-accuracy-drop",
        "1.0",
    ]
    assert eval_main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    served = report["served"]
    names = [e["name"] for e in served["entries"]]
    assert names == ["float32", "crude-0.25bit", "kivi2", "last-step-kv"]
    assert [r["name"] for r in report["bundles"]] == ["crude-0.25bit", "kivi2", "last-step-kv"]
    assert all(e["serving"]["recent_window"] == 16 for e in served["entries"][1:])
    assert served["entries"][2]["serving"]["page_size"] == 32  # KIVI: a page is one key token group
    scores = served["tasks"]["scores"]
    assert set(scores) == set(names) and served["tasks"]["samples"] == {"loopvq_recall": 2}
    fp = scores["float32"]["loopvq_recall"]["exact_match,answer"]
    for name in names[1:]:
        got = scores[name]["loopvq_recall"]["exact_match,answer"]
        assert served["accuracy_drop"][name]["loopvq_recall"] == pytest.approx(fp - got)
    encoded = [e["bytes"]["encoded_bytes_per_token"] for e in served["entries"]]
    assert encoded[0] is None and encoded[1] == 4 * 2 * 6 * 16  # 0.25-bit LoopVQ: one byte per 16-element group
    md = (out / "report.md").read_text()
    assert "## Served through the cache" in md and "| loopvq_recall | exact_match,answer |" in md
    assert (out / "served_accuracy.png").stat().st_size > 0
    strict = argv[:8] + ["--tasks", "loopvq_recall", "--limit", "1", "--max-accuracy-drop", "-0.5"]  # fails all
    assert eval_main(strict) == 1
    assert "accuracy drop" in capsys.readouterr().out


def test_cli_served_bad_input_exits_2(bundle_dir, capsys):
    base = ["--bundle", str(bundle_dir), "--num-sequences", "1", "--sequence-length", "40", "--device", "cpu"]
    assert eval_main(base + ["--baseline", "kivi3"]) == 2
    assert "--baseline kivi3: unknown" in capsys.readouterr().err
    assert eval_main(base + ["--passkey-lengths", "8"]) == 2
    assert ">= 16 tokens" in capsys.readouterr().err


def test_cli_tasks_and_passkey_without_the_eval_extra_exit_2_naming_it(bundle_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # how Python answers an import of a missing package
    base = ["--bundle", str(bundle_dir), "--num-sequences", "1", "--sequence-length", "40", "--device", "cpu"]
    for extra in (["--tasks", "loopvq_recall"], ["--passkey-lengths", "64"]):
        assert eval_main(base + extra) == 2
        assert "need lm-evaluation-harness: pip install 'loopvq-calib[eval]'" in capsys.readouterr().err
    assert eval_main(base + ["--passkey-lengths", "8"]) == 2  # a bad length is named first, with or without it
    assert ">= 16 tokens" in capsys.readouterr().err


@needs_lm_eval
@pytest.mark.slow  # an unknown name makes lm-eval index all its own tasks (~20 s of YAML); CI's full suite runs it
def test_cli_unknown_task_exits_2(bundle_dir, capsys):
    base = ["--bundle", str(bundle_dir), "--num-sequences", "1", "--sequence-length", "40", "--device", "cpu"]
    assert eval_main(base + ["--tasks", "no_such_task_xyz"]) == 2
    assert "--tasks no_such_task_xyz: not an lm-eval task" in capsys.readouterr().err
