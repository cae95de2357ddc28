"""Every file is read with a bound (docs/reliability.md, "Bounds"): the hostile inputs D1-D13 of the audit, each
refused with exit 2 and one short line naming the file and field within DEADLINE_S, writing and deleting nothing;
for --out (D11) and the model card (D12), outside files and the card stay safe. The inputs are built by
tests/support/bounds.py; those that would hang or fill memory on a reader without bounds run in a child process
with a deadline and a memory ceiling, and a FIFO is opened for writing after a while, so that a regression fails
instead of hanging."""

from __future__ import annotations

import ast
import json
import re
import time

import pytest
from support.bounds import (
    DEADLINE_S,
    HUGE,
    MAINS,
    bundle_with,
    config_field,
    eval_out,
    fifo,
    finished_run_widened,
    model_at,
    report_through,
    run_in_child,
    score_of,
    tiny_eval_args,
    transposed_shard,
    unblocked_after,
    widened_model,
    zero_link,
)
from support.fuzz import (
    JSONL,
    MAX_MESSAGE,
    model_copy,
    report_push,
    snapshot,
    ws,  # noqa: F401 (the fixture)
)

from loopvq_calib.bundle.card import model_card, prepare_eval_report
from loopvq_calib.bundle.reader import BundleError, load_bundle
from loopvq_calib.cli import calibrate_main, eval_main, inspect_main, push_main

BAD_ROW = b'{"text": "caf\xe9"}\n'  # latin-1, not UTF-8
SHORT = 400  # characters: what the line of a value thousands of digits long may take

CASES = [
    # D1: loopvq.json numbers past a float, checksum resealed
    (
        "d1-theta-inspect",
        lambda ws: (inspect_main, [bundle_with(ws, "rope", "theta", value=HUGE)]),
        "{}/bundle/loopvq.json: field rope.theta is an integer of 401 digits",
    ),
    (
        "d1-bits-push",
        lambda ws: (push_main, [bundle_with(ws, "bits", "key", value=HUGE), "--repo-id", "org/x", "--dry-run"]),
        "{}/bundle/loopvq.json: field bits.key is an integer of 401 digits",
    ),
    (
        "d1-theta-eval",
        lambda ws: (eval_main, ["--bundle", bundle_with(ws, "rope", "theta", value=HUGE)]),
        "field rope.theta is an integer of 401 digits",
    ),
    (
        "d1-float-past-range",
        lambda ws: (
            inspect_main,
            [
                ws.bundle(
                    lambda p: (p / "loopvq.json").write_text(
                        (p / "loopvq.json").read_text().replace('"theta": 10000.0', '"theta": 1e999')
                    )
                )
            ],
        ),
        "field rope.theta is the number 1e999, which is no finite float",
    ),
    # D2: evaluation report numbers past a float
    (
        "d2-eval-kl",
        lambda ws: report_push(ws, lambda r: r["bundles"][0].update(eval_kl=HUGE)),
        "{}/report.json: field bundles[0].eval_kl is an integer of 401 digits",
    ),
    (
        "d2-codebook-size",
        lambda ws: report_push(ws, lambda r: r["bundles"][0].update(codebook_size=HUGE)),
        "field bundles[0].codebook_size is an integer of 401 digits",
    ),
    (
        "d2-task-score",
        lambda ws: report_push(ws, lambda r: score_of(r, HUGE)),
        "field served.tasks.scores.ouro_loopvq.loopvq_recall.exact_match,answer is an integer of 401 digits",
    ),
    # D3: config.json against the weights, before any work; a finished stage is never touched
    (
        "d3-hidden-size-over-narrow-shards",
        widened_model,
        (
            "model.name_or_path: {}/model/model.safetensors: tensor 'model.embed_tokens.weight' has shape "
            "[4096, 64], but {}/model/config.json describes a model whose model.embed_tokens.weight is [4096, 128]"
        ),
    ),
    ("d3-finished-run-kept", finished_run_widened, "tensor 'model.embed_tokens.weight' has shape [4096, 64]"),
    ("d3-transposed-header", lambda ws: model_copy(ws, transposed_shard), "(config.json and the weights disagree)"),
    (
        "d3-zero-loop-steps",
        lambda ws: model_copy(ws, config_field("total_ut_steps", 0)),
        "{}/model/config.json: field total_ut_steps (loop steps) must be a positive integer, got 0",
    ),
    (
        "d3-rope-theta-text",
        lambda ws: model_copy(ws, config_field("rope_theta", "abc")),
        "{}/model/config.json: field rope_theta (the RoPE base) must be a finite number > 0, got 'abc'",
    ),
    # D4: sizes that drive memory, as a float
    (
        "d4-layers-float",
        lambda ws: model_copy(ws, config_field("num_hidden_layers", 1e9)),
        "{}/model/config.json: field num_hidden_layers must be a positive integer, got 1000000000.0",
    ),
    # D6: text that is not Unicode, named by file and row
    (
        "d6-lone-surrogate-calibrate",
        lambda ws: ws.data("s.jsonl", JSONL + json.dumps({"text": "a \ud800 b"}) + "\n"),
        "data.dataset: {}/s.jsonl line 41: field 'text' holds a lone surrogate",
    ),
    (
        "d6-lone-surrogate-eval",
        lambda ws: (
            eval_main,
            [*tiny_eval_args(ws), "--data", ws.file("s.jsonl", JSONL + json.dumps({"text": "\ud800"}) + "\n")],
        ),
        "--data: {}/s.jsonl line 41: field 'text' holds a lone surrogate",
    ),
    (
        "d6-invalid-utf8-row",
        lambda ws: ws.data("l.jsonl", JSONL.encode() + BAD_ROW),
        f"l.jsonl is not UTF-8 text: byte offset {len(JSONL.encode()) + BAD_ROW.index(0xE9)} (line 41: ",
    ),
    # D8: a FIFO in a corpus folder or glob
    (
        "d8-fifo-in-folder",
        lambda ws: (
            fifo(ws.root / "corp" / "b.jsonl"),
            ws.file("corp/a.jsonl", JSONL),
            ws.run_with("--set", f"data.dataset={ws.root / 'corp'}"),
        )[-1],
        "data.dataset: {}/corp/b.jsonl is a FIFO (named pipe), not a regular file",
    ),
    (
        "d8-fifo-in-eval-glob",
        lambda ws: (
            fifo(ws.root / "corp" / "b.jsonl"),
            ws.file("corp/a.jsonl", JSONL),
            (eval_main, [*tiny_eval_args(ws), "--data", f"{ws.root}/corp/*.jsonl"]),
        )[-1],
        "--data: {}/corp/b.jsonl is a FIFO (named pipe)",
    ),
    # D9: FIFOs in a model folder
    (
        "d9-fifo-tokenizer-config",
        lambda ws: model_copy(
            ws, lambda f: ((f / "tokenizer_config.json").unlink(), fifo(f / "tokenizer_config.json"))
        ),
        "model.name_or_path: {}/model/tokenizer_config.json is a FIFO (named pipe), not a regular file",
    ),
    (
        "d9-fifo-extra-shard",
        lambda ws: model_copy(ws, lambda f: fifo(f / "extra.safetensors")),
        "model.name_or_path: {}/model/extra.safetensors is a FIFO (named pipe)",
    ),
    # D10: --eval-report naming a FIFO
    (
        "d10-report-fifo",
        lambda ws: report_through(ws, fifo),
        "--eval-report: cannot read an evaluation report: {}/report.json is a FIFO (named pipe)",
    ),
    # D11: --out never writes through a link nor over a file loopvq-eval did not write
    (
        "d11-report-md-links-out",
        lambda ws: eval_out(ws, lambda md: md.symlink_to(ws.file("outside.md", "mine"))),
        "--out {}/eval: report.md is a symbolic link; loopvq-eval never writes through a link",
    ),
    (
        "d11-users-report-md",
        lambda ws: eval_out(ws, lambda md: md.write_text("my notes")),
        "--out {}/eval: report.md was not written by loopvq-eval",
    ),
    # D13: a value thousands of digits long, shown in a few dozen characters
    (
        "d13-codebook-bytes-4200-digits",
        lambda ws: (inspect_main, [bundle_with(ws, "codebook_bytes", value=10**4200)]),
        "field codebook_bytes is an integer of 4,201 digits (100000000000...000000)",
    ),
]


@pytest.mark.parametrize("name,setup,fragment", CASES, ids=[c[0] for c in CASES])
def test_a_hostile_input_exits_2_at_once_in_one_line_and_changes_nothing(ws, capsys, name, setup, fragment):
    main, argv = setup(ws)
    capsys.readouterr()
    before = snapshot(ws.root)
    with unblocked_after(list(ws.root.rglob("*")), seconds=10):  # a reader waiting on a FIFO sees its end then
        start = time.monotonic()
        status = main(argv)
        seconds = time.monotonic() - start
    err = capsys.readouterr().err
    assert status == 2 and seconds < 10, (status, seconds, err[:MAX_MESSAGE])
    assert fragment.format(ws.root, ws.root) in err, err[:MAX_MESSAGE]
    assert "Traceback" not in err and err.count("\n") == 1, err[:MAX_MESSAGE]
    assert len(err) < SHORT + 2 * len(str(ws.root)), err[:MAX_MESSAGE]  # at most two paths and a short line
    assert snapshot(ws.root) == before  # nothing written through a link, nothing replaced, nothing deleted


def test_load_bundle_refuses_a_number_past_a_float_with_a_bundle_error(ws):
    with pytest.raises(BundleError, match=r"field rope\.theta is an integer of 401 digits"):
        load_bundle(bundle_with(ws, "rope", "theta", value=HUGE))


@pytest.mark.slow  # a child process (about 6 s on the 2-core machine): these would hang or fill memory in this one
def test_sizes_that_would_run_away_and_endless_files_are_refused_in_a_child_within_the_bounds(ws):
    """D4 (10**9 layers), D5 (2*10**9 loop steps, from --set or config.json) and /dev/zero where a corpus, a model
    folder's file or a report is read (D8, D9, D10): each exit 2 at once, the child under 1 GB resident."""
    ws.file("corp/a.jsonl", JSONL)
    zero = zero_link(ws.root / "corp" / "z.jsonl")
    cases = [
        (
            model_at(ws, "layers", config_field("num_hidden_layers", 10**9)),
            "field num_hidden_layers is 1,000,000,000, more than this toolkit takes (1,024",
        ),
        (
            ws.run_with("--set", "model.loop_steps=2000000000"),
            "model.loop_steps: 2,000,000,000 is more loop steps than this toolkit takes (at most 1,024)",
        ),
        (
            model_at(ws, "steps", config_field("total_ut_steps", 1e9)),
            f"{ws.root}/steps/config.json: field total_ut_steps (loop steps) must be a positive integer, got "
            "1000000000.0",
        ),
        (ws.run_with("--set", f"data.dataset={zero.parent}"), f"data.dataset: {zero} is a character device"),
        (
            model_at(ws, "notes", lambda f: zero_link(f / "notes.txt")),
            f"{ws.root}/notes/notes.txt is a character device",
        ),
        (
            report_through(ws, zero_link),
            f"--eval-report: cannot read an evaluation report: {ws.root}/report.json is a character device",
        ),
    ]
    results = run_in_child([(MAINS[main], argv) for (main, argv), _ in cases], timeout=DEADLINE_S * 2)
    for (_, fragment), result in zip(cases, results):
        assert result["status"] == 2 and fragment in result["err"], (fragment, result)
        assert result["err"].count("\n") == 1 and "Traceback" not in result["err"], result
        assert result["seconds"] < DEADLINE_S and result["max_rss"] < 1 << 30, result


# -- D12: the model card --------------------------------------------------------------------------------------------
def test_a_model_name_that_is_python_stays_a_string_in_the_cards_load_snippet(ws):
    meta = load_bundle(ws.bundle()).meta
    name = '");import os;os.system("touch pwned") #\n```\n# Injected'
    card = model_card({**meta, "model": {**meta["model"], "name": name}})
    code = card.split("```python\n", 1)[1].split("\n```", 1)[0]
    nodes = list(ast.walk(ast.parse(code)))
    calls = [n for n in nodes if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "load_bundle"]
    assert [k.value.value for k in calls[0].keywords if k.arg == "model"] == [name]  # one argument: the name, whole
    assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) and "os" in ast.unparse(n) for n in nodes)
    assert "\n# Injected" not in card


def test_markup_in_a_report_stays_text_in_the_card(ws):
    """HTML and markdown in the report's model, dataset and task names render as text: no tag, no heading, no
    extra table cell (rendered by markdown-it, a CommonMark parser with GFM tables)."""
    markdown_it = pytest.importorskip("markdown_it")
    hostile = {
        "model": '<img src=x onerror="alert(1)">',
        "data": {"dataset": "x\n## Fake section\n| a | b | c | d | e |"},
    }

    def edit(report: dict) -> None:
        report.update(hostile)
        report["served"]["tasks"]["scores"][report["bundles"][0]["name"]].update({"<b>t</b>|x": {"m`1": 0.5}})

    _, argv = report_push(ws, edit)
    card = prepare_eval_report(argv[0], argv[-1]).card.decode()
    html = markdown_it.MarkdownIt("commonmark").enable("table").render(card.split("---\n", 2)[2])
    assert "<img" not in html and "<b>" not in html and "Fake section</h2>" not in html
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in html  # shown, as text
    table = html.split("<h2>Evaluation</h2>")[1]
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)
    assert rows and all(len(re.findall(r"<t[dh]", row)) == 4 for row in rows), rows


# -- one line each: offline hub, an unreachable hub, a GPU-sized config on the CPU, --device ---------------------
def test_a_hub_model_missing_offline_says_how_to_give_a_local_folder(ws, capsys):
    assert calibrate_main(ws.run_with("--set", "model.name_or_path=someorg/not-cached")[1]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: model.name_or_path: could not get the model 'someorg/not-cached' from the Hugging Face Hub "
        "(offline mode: HF_HUB_OFFLINE is set and 'someorg/not-cached' is not in the local hub cache); "
        "--set model.name_or_path=<local folder>, or unset HF_HUB_OFFLINE to download it\n"
    )


def test_a_hub_dataset_that_cannot_be_reached_is_one_line_at_once(ws, capsys, monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens, refused at once
    start = time.monotonic()
    assert calibrate_main(ws.run_with("--set", "data.dataset=someorg/somedata", "--stages", "data")[1]) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - start < 10 and err.count("\n") == 1, err
    assert err.startswith(
        "error: data.dataset: cannot load 'someorg/somedata' from the hub, which cannot be reached "
        "(http://127.0.0.1:9: Connection refused); give a local file or folder (--set "
        "data.dataset=<file>), or set HF_DATASETS_OFFLINE=1"
    ), err


def test_a_gpu_sized_config_on_the_cpu_warns_once_at_the_start(ws, capsys):
    """Windows of 1,024 tokens (a copy of the tiny model given a 2,048-token window) on the CPU: one warning line."""
    main, argv = model_copy(ws, config_field("max_position_embeddings", 2048))
    assert (
        main(
            [
                *argv,
                "--set",
                "data.sequence_length=1024",
                "--set",
                "data.num_sequences=3",
                "--set",
                "data.heldout_sequences=1",
                "--set",
                "model.device=cpu",
                "--stages",
                "data",
            ]
        )
        == 0
    )
    warnings = [line for line in capsys.readouterr().err.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and warnings[0].endswith(
        "this config's 1,024-token windows (data.sequence_length) are sized for a GPU and this run is on the CPU: "
        "expect a long run (the progress bars estimate it); for a first try on the CPU use configs/tiny-ouro.yaml, "
        "or --set data.sequence_length=256"
    ), warnings


def test_a_bad_eval_device_names_the_flag(ws, capsys):
    assert eval_main(["--bundle", ws.bundle(), "--device", "cuda:abc"]) == 2
    assert capsys.readouterr().err == "error: --device 'cuda:abc' is not allowed; use auto, cpu, cuda or cuda:N\n"
