"""The lm-eval model class through the served cache, on the shipped local task and the reference model; without
lm-eval the evaluation still imports and ServedLM still decodes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REFERENCE_MODEL, ROOT, needs_lm_eval
from support.quantizers import sampled_quantizer

from loopvq_calib.codes.baselines import make_baseline
from loopvq_calib.codes.quantizer import KVQuantizer
from loopvq_calib.evaluation.harness import TASKS_DIR, ServedLM, run_tasks, task_manager
from loopvq_calib.evaluation.options import ServedOptions
from loopvq_calib.evaluation.served import Entry, accuracy_drops, measured_bytes, model_details
from loopvq_calib.models.loading import load_model

TASK = "loopvq_recall"
LIMIT = 3


@pytest.fixture(scope="module")
def reference():
    return load_model(REFERENCE_MODEL, "float32", torch.device("cpu"))


def task_items(n: int) -> list[dict]:
    lines = (TASKS_DIR / TASK / "recall.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines[:n]]


def identity_quantizer(model, tokenizer, prompts: list[str]) -> KVQuantizer:
    """A LoopVQ quantizer whose codebooks hold every group vector of ``prompts``: it reproduces their
    keys and values exactly, so serving through it must not change any answer."""
    parts = []
    for p in prompts:
        ids = torch.tensor([tokenizer(p, add_special_tokens=False)["input_ids"]])
        parts.append(
            sampled_quantizer(model, ids, "loopvq", codebook_size=ids.shape[1], group_size=16, steps_per_block=4)
        )
    first = parts[0]
    for key, codec in first.codecs.items():
        codec.codebook = torch.cat([q.codecs[key].codebook for q in parts], dim=2)
    first.codebook_size = first.codecs[key].codebook.shape[2]
    return first


@needs_lm_eval
def test_local_task_is_registered_offline():
    manager = task_manager([], [TASK])
    assert manager.all_tasks == [TASK]  # lm-eval's own tasks were not indexed for a local-only run
    items = task_items(1000)
    assert len(items) >= 200 and all(i["prompt"] and i["answer"] == i["answer"].strip() != "" for i in items)


@needs_lm_eval
def test_full_precision_accuracy_matches_an_independent_run(reference):
    """lm-eval's exact match through ServedLM equals greedy generate() scored by hand."""
    model, tok = reference
    options = ServedOptions(tasks=[TASK], limit=LIMIT)
    scores = run_tasks(model, tok, [Entry("fp", "full-precision")], options=options)
    got = scores["scores"]["fp"][TASK]["exact_match,answer"]
    hits = 0
    for item in task_items(LIMIT):
        ids = torch.tensor([tok(item["prompt"], add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, max_new_tokens=40, do_sample=False)
        hits += tok.decode(out[0, ids.shape[1] :]).split("\n")[0].lstrip() == item["answer"]
    assert scores["samples"] == {TASK: LIMIT}
    assert got == pytest.approx(hits / LIMIT)


@needs_lm_eval
# slow; quick equivalents: test_huginn_served_through_a_bundle_and_a_baseline here, test_qcache's cache-vs-plain
# generation tests
@pytest.mark.slow
def test_identity_quantizer_keeps_accuracy_and_answers(reference):
    """Served through a quantizer that reproduces the prompts' keys/values exactly, every answer (and so
    the accuracy) equals full precision, while pages are really encoded and decoded."""
    model, tok = reference
    prompts = [i["prompt"] for i in task_items(2)]
    q = identity_quantizer(model, tok, prompts)
    ident = Entry("identity", "bundle", q, sink_tokens=4, recent_window=16, page_size=8)
    crude = Entry(
        "crude",
        "bundle",
        sampled_quantizer(model, torch.tensor([tok(prompts[0])["input_ids"][:64]]), codebook_size=2),
        4,
        16,
        8,
    )
    fp = ServedLM(model, tok, None)
    served = ServedLM(model, tok, ident.make_cache())
    bad = ServedLM(model, tok, crude.make_cache())
    outs = {
        name: [lm.greedy([p], [], 8)[0] for p in prompts]
        for name, lm in (("fp", fp), ("identity", served), ("crude", bad))
    }
    assert outs["identity"] == outs["fp"]
    assert outs["crude"] != outs["fp"]  # the same path with a lossy codebook does change answers
    scores = run_tasks(
        model, tok, [Entry("fp", "full-precision"), ident], options=ServedOptions(tasks=[TASK], limit=2)
    )["scores"]
    assert scores["identity"] == scores["fp"]
    cache = ident.make_cache()()
    with torch.no_grad():
        model(torch.tensor([tok(prompts[0], add_special_tokens=False)["input_ids"]]), cache=cache, use_cache=True)
    assert cache.regions()["encoded"] > 100  # the prompt's old pages went through encode/decode


def test_loglikelihood_reads_the_context_from_the_cache(reference):
    model, tok = reference
    ctx, cont = task_items(1)[0]["prompt"], " 12345 and more"
    lm = ServedLM(model, tok, None)
    ((logp, greedy),) = lm.loglikelihood([type("R", (), {"args": (ctx, cont)})()])
    ids = tok(ctx + cont, add_special_tokens=False)["input_ids"]
    n = len(tok(ctx, add_special_tokens=False)["input_ids"])
    full = torch.tensor([[0] + ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(full).logits[0].float(), -1)
    expected = sum(lp[n + i, t].item() for i, t in enumerate(ids[n:]))
    assert logp == pytest.approx(expected, abs=1e-3)
    assert isinstance(greedy, bool)


def test_huginn_details_and_batched_greedy(tiny_huginn_dir):
    model, tok = load_model(tiny_huginn_dir, "float32", torch.device("cpu"))
    details = model_details(model)
    assert details == {"model_type": "huginn_raven", "loop_steps": 4, "recurrences": 4, "initial_state": "zero"}
    prompts = ["The king is dead, long live", "Thou"]
    one = [ServedLM(model, tok, None).greedy([p], [], 5)[0] for p in prompts]
    batched = ServedLM(model, tok, None, batch_size=2).greedy(prompts, [], 5)
    assert batched == one  # left padding does not change full-precision greedy answers


@needs_lm_eval
def test_huginn_served_through_a_bundle_and_a_baseline(tiny_huginn_dir):
    """Huginn end to end: a sampled quantizer and last-step KV served on the local task, side by side."""
    model, tok = load_model(tiny_huginn_dir, "float32", torch.device("cpu"))
    ids = torch.tensor([tok(task_items(1)[0]["prompt"], add_special_tokens=False)["input_ids"][:96]])
    entries = [
        Entry("fp", "full-precision"),
        Entry(
            "b",
            "bundle",
            sampled_quantizer(model, ids, "loopvq", codebook_size=16, group_size=16, steps_per_block=2),
            4,
            16,
            8,
        ),
        Entry("last", "baseline", make_baseline("last-step-kv", model.kv_layout()), 4, 16, 8),
    ]
    result = run_tasks(model, tok, entries, options=ServedOptions(tasks=[TASK], limit=1))
    assert set(result["scores"]) == {"fp", "b", "last"}
    assert set(accuracy_drops(result, "fp")) == {"b", "last"}
    bytes_ = measured_bytes(model, entries[2], ids)
    kv = model.kv_layout()  # prelude 1 + 4 x core 2 + coda 1 sites, 4 heads of 16, fp32
    stored_sites = 1 + 2 + 1  # last-step KV keeps one step of the 2 core layers, prelude and coda as they are
    assert bytes_["encoded_bytes_per_token"] == stored_sites * 2 * kv.kv_heads * kv.head_dim * 4


WITHOUT_LM_EVAL = """
import sys
sys.modules["lm_eval"] = None  # how Python answers an import of a missing package
from pathlib import Path
import torch
from loopvq_calib.evaluation import evaluate, harness, passkey, served
from loopvq_calib.models.loading import load_model
model, tok = load_model(Path(sys.argv[1]), "float32", torch.device("cpu"))
lm = harness.ServedLM(model, tok, served.Entry("fp", "full-precision").make_cache())
print(harness.lm_eval_available(), [c.__name__ for c in type(lm).__mro__], repr(lm.greedy(["Thou art"], [], 4)[0]))
"""


def test_without_lm_eval_the_evaluation_imports_and_served_lm_decodes(tiny_huginn_dir):
    """The eval extra is optional: without lm-eval every evaluation module imports and ServedLM (then a plain
    class) answers as it does with lm-eval's base class."""
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_LM_EVAL, str(tiny_huginn_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "", "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    model, tok = load_model(tiny_huginn_dir, "float32", torch.device("cpu"))
    expected = ServedLM(model, tok, None).greedy(["Thou art"], [], 4)[0]
    assert done.stdout.split("\n")[0] == f"False ['ServedLM', 'object'] {expected!r}"
