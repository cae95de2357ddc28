"""The served-cache table of docs/quality.md, from `benchmarks/quality/eval_reference.py`'s
stored reports (benchmarks/results/eval-reference*/: report.json and setup.json), and the words for a setup that
benchmarks/reproduction/reproduce_report.py shares.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.common.markdown import md_table, recipe, wrap
from benchmarks.common.paths import RESULTS

SERVED = RESULTS / "eval-reference"  # one loopvq-eval run over the bundles and baselines (64-token window)
SERVED_WINDOW0 = RESULTS / "eval-reference-window0"  # the same bundles with no bf16 window


def read_served(folder: Path = SERVED, window0: Path = SERVED_WINDOW0) -> dict[str, Any]:
    """The two stored loopvq-eval reports of eval_reference.py and their setup.json."""

    def load(path: Path) -> Any:
        return json.loads(path.read_text())

    return {
        "report": load(folder / "report.json"),
        "window0": load(window0 / "report.json"),
        "setup": load(folder / "setup.json"),
        "window0_setup": load(window0 / "setup.json"),
    }


def served_rows(served: dict[str, Any]) -> list[list[str]]:
    """One row per entry of the served-cache table: bits, bytes per token at both windows, KL, task, passkey."""
    report, window0 = served["report"], served["window0"]
    quality = {b["name"]: b for b in report["bundles"]}
    bytes0 = {e["name"]: e["bytes"] for e in window0["served"]["entries"]}
    tasks, tasks0 = report["served"]["tasks"], window0["served"]["tasks"]
    task = tasks["tasks"][0]
    passkey = report["served"].get("passkey") or {"lengths": [], "accuracy": {}}
    rows = []
    for entry in report["served"]["entries"]:
        name, size = entry["name"], entry["bytes"]
        bits = entry["bits"]
        q = quality.get(name)
        score, score0 = (next(iter(t["scores"][name][task].values())) for t in (tasks, tasks0))
        keys = " / ".join(f"{passkey['accuracy'][name][str(n)]:.0f}" for n in passkey["lengths"])
        rows.append(
            [
                name,
                "16 / 16 (bf16)" if bits is None else f"{bits['key']:.3g} / {bits['value']:.3g}",
                "n/a" if size["encoded_bytes_per_token"] is None else f"{size['encoded_bytes_per_token']:.0f}",
                f"{size['bytes_per_token']:.0f}",
                f"{bytes0[name]['bytes_per_token']:.0f}",
                "0" if q is None else f"{q['eval_kl']:.5f}",
                "0" if q is None else f"{100 * q['ppl_increase']:+.2f}%",
                f"{score:.3f}",
                f"{score0:.3f}",
                keys,
            ]
        )
    return rows


def served_section(served: dict[str, Any], study: dict) -> str:
    """The served-cache table with its setup, and why it can rank methods unlike the tables above."""
    report, setup = served["report"], served["setup"]
    cal = setup["calibration"]
    serving, data = cal["serving"], report["data"]
    lengths = report["served"].get("passkey", {}).get("lengths", [])
    limit = report["served"]["tasks"]["limit"]
    head = [
        "entry",
        "bits K / V",
        "encoded bytes per token",
        f"bytes per token ({data['sequence_length']} tokens, window {serving['recent_window']})",
        "(window 0)",
        "evaluation KL",
        "ppl increase",
        f"local task, window {serving['recent_window']}",
        "local task, window 0",
        "passkey " + " / ".join(str(n) for n in lengths),
    ]
    widths = ", ".join(f"G {g} at {b} bit" for b, g in cal["group_size"].items())
    about = wrap(
        f"*Setup: calibration {cal['sequences']} x {cal['sequence_length']} tokens of Hamlet + Macbeth (K "
        f"{cal['codebook_size']}, {widths}, T_c {cal['steps_per_block']}), k-means {cal['kmeans_iterations']} "
        f"iterations, fine-tuning {recipe(cal['finetune'])}; served with {cal['sink_tokens']} sinks, a "
        f"{serving['recent_window']}-token bf16 window and pages of {serving['page_size']}; one `loopvq-eval` "
        "over the 8 bundles, the baselines and the bf16 model (bfloat16, CPU): evaluation KL on "
        f"{data['num_sequences']} x {data['sequence_length']} tokens of the held-out plays, the first "
        f"{limit:g} items of the local task `{report['served']['tasks']['tasks'][0]}`, passkey retrieval, and "
        f"bytes per token after a {data['sequence_length']}-token prefill; the window-0 columns read every "
        f"token after the sinks from codes. At commit `{setup['commit']}` on {setup['cpu_count']} CPU cores:*"
    )
    commands = "\n".join(["```bash", setup["command"], served["window0_setup"]["command"], "```"])
    return "\n\n".join([about, commands, md_table(head, served_rows(served)), ranking(served, study)])


def ranking(served: dict[str, Any], study: dict) -> str:
    """Where this table and the Methods table order TaSQ+LoopVQ and LoopVQ at 0.5 bit, and what differs."""
    here = {b["name"]: b["eval_kl"] for b in served["report"]["bundles"]}
    served_kl = [here[f"tiny-ouro-{m}-0.5bit"] for m in ("tasq+loopvq", "loopvq")]
    study_kl = [study["metrics"][f"{m}-0.5/finetune"]["eval_kl"] for m in ("tasq+loopvq", "loopvq")]

    def order(kl: list[float]) -> str:
        return "ahead of" if kl[0] < kl[1] else "behind"

    cal, s = served["setup"]["calibration"], study["settings"]
    return wrap(
        f"At 0.5 bit TaSQ+LoopVQ is {order(served_kl)} LoopVQ here ({served_kl[0]:.4f} against "
        f"{served_kl[1]:.4f}) and {order(study_kl)} it in the Methods table ({study_kl[0]:.4f} against "
        f"{study_kl[1]:.4f}). The setups differ: here fine-tuning ran {recipe(cal['finetune'])} and the "
        f"evaluation {served['report']['data']['num_sequences']} windows; there fine-tuning ran "
        f"{recipe(s['finetune'])} and the evaluation {study['heldout']['num_sequences']} windows. On "
        "this model the order of these two methods at 0.5 bit follows the setup and the evaluation sample, so "
        "neither table alone ranks them."
    )
