"""The bundle's model card (README.md): hub front matter, a human summary and, when an evaluation report is
attached (``loopvq-push --eval-report``), its results as model-index metadata (huggingface_hub's
``ModelCardData`` / ``EvalResult``) and a table. A report attaches only to the bundle it measured; the new card
and loopvq.json are prepared without writing (:class:`EvalAttachment`) and written by the push once the hub
has them, or by ``loopvq-push --write-card-only``."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from ..config.source import cut, shown
from ..runtime.files import temp_sibling, write_temp
from .eval_report import EvalReportError, bundle_row, check_report, kl_key, read_eval_report, report_file
from .format import CARD_FILE, META_FILE, TENSOR_FILE, meta_bytes, read_bundle_file
from .reader import load_bundle

_MARKUP = re.compile(r"([\\`<>\[\]|&!])")  # characters markdown text escapes (links, images, HTML, code, cells)
__all__ = [
    "EvalAttachment",
    "EvalReportError",
    "attach_eval_report",
    "evaluation_for",
    "model_card",
    "prepare_eval_report",
    "write_eval_report",
]


def model_card(meta: dict[str, Any], evaluation: dict[str, Any] | None = None) -> str:
    """README.md of a bundle: hub front matter and a human summary; with ``evaluation`` (from
    :func:`evaluation_for`) its results as model-index metadata and a table."""
    ident, bits, serving, metrics = meta["model"], meta["bits"], meta["serving"], meta["metrics"]
    cfg = meta.get("config") or {}
    license_ = cfg.get("license") or (cfg.get("output") or {}).get("license")
    data = ModelCardData(
        base_model=ident["name"] if is_hub_id(ident["name"]) else None,  # a local model: no base_model
        library_name="loopvq-calib",
        license=license_ or None,
        tags=["loopvq", "kv-cache", "quantization", "vector-quantization", "looped-transformer", ident["model_type"]],
        model_name=meta["name"] if evaluation else None,
        eval_results=evaluation["results"] if evaluation else None,
    )
    kv = meta["kv_layout"]
    n_key = sum(b["kind"] == "key" for b in meta["blocks"])
    lines = [
        "---",
        data.to_yaml().rstrip(),
        "---",
        "",
        f"# {_text(meta['name'])}",
        "",
        f"LoopVQ KV-cache codebooks for {_code(ident['name'])}"
        + (f" (revision {_code(ident['revision'])})" if ident.get("revision") else "")
        + f", model type {_code(ident['model_type'])}, produced by loopvq-calib {_text(meta['producer']['version'])} "
        f"(bundle format {_text(meta['format_version'])}). The codes replace the pre-RoPE keys and values of the KV "
        "cache; the model weights are unchanged.",
        "",
        "| | |",
        "|---|---|",
        f"| method | {meta['method']} |",
        f"| bits per element | key {bits['key']:.4f}, value {bits['value']:.4f} |",
        f"| codebook size K / group size G / loop steps per block T_c | {meta['codebook_size']} / "
        f"{meta['group_size']} / {meta['steps_per_block']} |",
        f"| codebook sharing | {meta['codebook_sharing']} |",
        f"| blocks | {n_key} key + {len(meta['blocks']) - n_key} value |",
        f"| KV sites | {len(kv['sites'])} ({kv['loop_steps']} loop steps, {kv['kv_heads']} KV heads, head dim "
        f"{kv['head_dim']}) |",
        f"| codebook memory | {meta['codebook_bytes']:,} bytes ({meta['codebook_dtype']}) |",
        f"| RoPE | {meta['rope']['style']}, theta {meta['rope']['theta']:g} (applied after decoding) |",
    ]
    selection = metrics.get("selection_kl", metrics.get("heldout_kl"))
    if selection is not None:
        init = metrics.get("selection_kl_init", metrics.get("heldout_kl_init"))
        init_text = f" (after k-means: {_num(init)})" if init is not None else ""
        lines.append(
            f"| selection KL to full precision (calibration selection sequences) | {_num(selection)}{init_text} |"
        )
    lines += [
        "",
        "## Load",
        "",
        "```python",
        "from huggingface_hub import snapshot_download",
        "from loopvq_calib import load_bundle",
        "",
        'path = snapshot_download("<this repo id>")  # or a local bundle folder',
        f"bundle = load_bundle(path, model={_python(ident['name'])})  # checks checksums and the model identity",
        f"codec = bundle.quantizer.codecs[{_python(meta['blocks'][0]['key'])}]  # one (kind, block)",
        "codes = codec.encode(x)        # x [N, block steps, H, D] pre-RoPE, fp32",
        "x_hat = codec.decode(codes)    # apply RoPE afterwards for keys",
        "```",
        "",
        "## Serving defaults",
        "",
        f"- sink tokens kept in full precision: {serving['sink_tokens']}",
        f"- recent window kept in full precision: {serving['recent_window']} tokens",
        f"- page size (tokens encoded together once they leave the window): {serving['page_size']}",
        "",
        "The file format (tensor names, group layout, encoder/decoder rules) is specified in loopvq-calib's "
        "docs/bundle-format.md.",
        "",
    ]
    if evaluation:
        lines += evaluation["markdown"]
    content = "\n".join(lines)
    ModelCard(content)  # parses the front matter and model-index (raises on a malformed card)
    return content


def is_hub_id(name: str) -> bool:
    """Whether a bundle's model name is a hub id ``org/name`` (the card's ``base_model`` holds nothing else;
    a local model is recorded by its absolute path)."""
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def _num(value: Any) -> str:
    return f"{value:.5g}" if isinstance(value, float) else _text(value)


def _plain(value: Any, limit: int) -> str:
    """``value`` as one line of at most ``limit`` characters (control characters as spaces)."""
    return cut("".join(" " if ord(c) < 32 or c == "\x7f" else c for c in str(value)), limit)


def _text(value: Any, limit: int = 200) -> str:
    """``value`` as markdown text that stays text: one line, the characters that open HTML, links, images, code
    or table cells backslash-escaped."""
    return _MARKUP.sub(r"\\\1", _plain(value, limit))


def _code(value: Any, *, cell: bool = False, limit: int = 200) -> str:
    """``value`` as an inline code span nothing inside can end (HTML and markdown in it stay literal): one line,
    fenced by more backticks than it holds in a row; in a table ``cell``, ``|`` escaped (GFM splits cells on it
    even inside code)."""
    text = _plain(value, limit)
    text = text.replace("|", "\\|") if cell else text
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _python(value: str) -> str:
    """``value`` as a Python string literal (JSON's escaping, which Python reads: quotes, backslashes, control and
    non-ASCII characters escaped), so a name can never end the literal in the card's snippet."""
    return json.dumps(value)


# -- evaluation results --------------------------------------------------------------------------------
def evaluation_for(report: dict[str, Any], name: str, *, source: str = "the evaluation report") -> dict[str, Any]:
    """EvalResults and markdown lines of the bundle called ``name`` in a ``loopvq-eval`` report.json (its shape
    checked: :func:`eval_report.check_report`; its one row: :func:`eval_report.bundle_row`)."""
    check_report(report, source)
    return _evaluation(report, bundle_row(report, name, source), name)


def _evaluation(report: dict[str, Any], row: dict[str, Any], name: str) -> dict[str, Any]:
    """:func:`evaluation_for` of a checked report and its row of the bundle ``name``."""
    kl = row[kl_key(row)]
    data = (report.get("data") or {}).get("dataset") or "held-out text"
    served = report.get("served") or {}
    entry = next((e for e in served.get("entries") or [] if e["name"] == name), None)
    serving = (entry or {}).get("serving")
    where = "" if serving is None else " (sinks {sink_tokens}, recent window {recent_window})".format(**serving)
    results = [
        EvalResult(
            task_type="text-generation",
            dataset_type="loopvq-eval",
            dataset_name=str(data),
            metric_type="kl",
            metric_name="evaluation KL to full precision",
            metric_value=round(float(kl), 6),
        ),
        EvalResult(
            task_type="text-generation",
            dataset_type="loopvq-eval",
            dataset_name=str(data),
            metric_type="perplexity",
            metric_name="perplexity (quantized cache)",
            metric_value=round(float(row["ppl_quantized"]), 4),
        ),
    ]
    table = [
        ("evaluation KL", str(data), _num(float(kl)), "0"),
        ("perplexity", str(data), _num(float(row["ppl_quantized"])), _num(float(row["ppl_fp"]))),
    ]
    ref = served.get("reference")
    scores = (served.get("tasks") or {}).get("scores") or {}
    for task, metrics in sorted((scores.get(name) or {}).items()):
        for metric, value in metrics.items():
            results.append(
                EvalResult(
                    task_type="text-generation",
                    dataset_type=task,
                    dataset_name=task,
                    metric_type=metric.split(",")[0],
                    metric_name=f"{metric}{where}",
                    metric_value=round(value, 6),
                )
            )
            fp = (scores.get(ref) or {}).get(task, {}).get(metric)
            table.append((metric, task, _num(value), _num(fp) if fp is not None else "n/a"))
    accuracy = (served.get("passkey") or {}).get("accuracy") or {}
    for n, acc in (accuracy.get(name) or {}).items():
        results.append(
            EvalResult(
                task_type="text-generation",
                dataset_type="passkey",
                dataset_name=f"passkey {n} tokens",
                metric_type="accuracy",
                metric_name=f"passkey retrieval{where}",
                metric_value=acc,
            )
        )
        fp = (accuracy.get(ref) or {}).get(n)
        table.append(("passkey accuracy", f"{n} tokens", _num(acc), _num(fp) if fp is not None else "n/a"))
    lines = [
        "## Evaluation",
        "",
        f"Measured by `loopvq-eval` on {_code(report.get('model'))} ({_code(report.get('dtype'))}){where}; the "
        f"evaluation KL is on text the calibration never saw.",
        "",
        f"| metric | data / task | this bundle | {_code(ref, cell=True) if ref else 'full precision'} |",
        "|---|---|---|---|",
    ]
    lines += [f"| {_text(m)} | {_code(d, cell=True)} | {v} | {f} |" for m, d, v, f in table] + [""]
    return {"results": results, "markdown": lines}


@dataclass(frozen=True)
class EvalAttachment:
    """An evaluation report's results for one bundle, not yet written: the new README.md and loopvq.json
    bytes, and the loopvq.json bytes they replace (a bundle changed since is refused)."""

    results: list[EvalResult]
    card: bytes
    meta: bytes
    replaces: bytes


def report_identity(meta: dict[str, Any]) -> dict[str, Any]:
    """What a ``loopvq-eval`` report row records of the bundle it measured, as this bundle's ``loopvq.json``
    says: the sha256 of its codebooks, its settings, serving defaults and calibration metrics."""
    metrics = meta["metrics"]
    return {
        "codebooks_sha256": meta["files"][TENSOR_FILE]["sha256"],
        "method": meta["method"],
        "codebook_size": meta["codebook_size"],
        "group_size": meta["group_size"],
        "steps_per_block": meta["steps_per_block"],
        "bits": meta["bits"],
        "serving": meta["serving"],
        "sink_tokens": meta["serving"]["sink_tokens"],
        "selection_kl": metrics.get("selection_kl", metrics.get("heldout_kl")),
        "finetune_curve": metrics.get("finetune_curve"),
    }


def check_report_row(row: dict[str, Any], meta: dict[str, Any], source: str) -> None:
    """Refuse a report row that is not this bundle's: every field of :func:`report_identity` must be in the
    row and equal this bundle's (``source`` names the report in messages)."""
    aliases = {"selection_kl": ("selection_kl", "calibration_heldout_kl")}
    for field, want in report_identity(meta).items():
        names = [n for n in aliases.get(field, (field,)) if n in row]
        if not names:
            raise EvalReportError(
                f"{source}: the row of bundle {shown(meta['name'])} records no {field}, so it "
                "cannot be matched to this bundle; run loopvq-eval on it again"
            )
        got = row[names[0]]
        if not _same(got, want):
            raise EvalReportError(
                f"{source}: the report measured another bundle named {shown(meta['name'])}: its "
                f"{names[0]} is {_short(got)}, this bundle's is {_short(want)}"
            )


def _same(a: Any, b: Any) -> bool:
    """Equal JSON values, numbers up to float rounding."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    if numbers:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0) or a == b
    return type(a) is type(b) and a == b


def _short(value: Any) -> str:
    """``value`` as JSON for a message, at most 80 characters (a long value is never serialised whole)."""
    short = shown(value)
    text = json.dumps(value) if len(short) < 80 else short
    return text if len(text) <= 80 else text[:77] + "..."


def prepare_eval_report(bundle_path: str | Path, report_path: str | Path) -> EvalAttachment:
    """The bundle's new README.md (with the results of the report at ``report_path``) and loopvq.json (its new
    checksum), computed and checked, nothing written. Raises EvalReportError for an unreadable or malformed
    report, one without exactly one row of this bundle's name, or one of another bundle (:func:`check_report_row`),
    BundleError for an invalid bundle."""
    report = read_eval_report(report_path)
    source = f"--eval-report {report_file(report_path)}"
    bundle = load_bundle(Path(bundle_path))
    name = bundle.meta["name"]
    row = bundle_row(report, name, source)
    check_report_row(row, bundle.meta, source)
    evaluation = _evaluation(report, row, name)
    card = model_card(bundle.meta, evaluation).encode("utf-8")
    meta = {**bundle.meta, "files": {**bundle.meta["files"], CARD_FILE: _entry(card)}}
    replaces = read_bundle_file(bundle.path, META_FILE)
    return EvalAttachment(evaluation["results"], card, meta_bytes(meta), replaces)


def _entry(data: bytes) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def write_eval_report(bundle_path: str | Path, attachment: EvalAttachment) -> None:
    """Replace the bundle's README.md and loopvq.json by the attachment's: both written to flushed temporary
    siblings and renamed into place (:func:`_replace_pair`), so a failure leaves the old pair; refused when
    loopvq.json changed since the attachment was prepared."""
    path = Path(bundle_path)
    if read_bundle_file(path, META_FILE) != attachment.replaces:
        raise EvalReportError(f"{path / META_FILE}: changed since the evaluation report was prepared; attach it again")
    card = write_temp(path / CARD_FILE, attachment.card, durable=True)
    try:
        new_meta = write_temp(path / META_FILE, attachment.meta, durable=True)
    except BaseException:
        card.unlink(missing_ok=True)
        raise
    _replace_pair(path / CARD_FILE, card, path / META_FILE, meta_tmp=new_meta)
    load_bundle(path)


def attach_eval_report(bundle_path: str | Path, report_path: str | Path, write: bool = True) -> list[EvalResult]:
    """:func:`prepare_eval_report`, then (``write``) :func:`write_eval_report`; returns the results. A push
    should instead pass the prepared attachment to ``push_bundle``, which writes it only once the hub has it."""
    attachment = prepare_eval_report(bundle_path, report_path)
    if write:
        write_eval_report(bundle_path, attachment)
    return attachment.results


def _replace_pair(card: Path, card_tmp: Path, meta: Path, *, meta_tmp: Path) -> None:
    """Rename both finished files into place, the card first, the old card moved aside (renamed, not reread);
    if a rename fails, the old card is renamed back, so an error leaves README.md and loopvq.json (whose
    checksum covers it) matching. A kill between the renames leaves the new card, or none, beside the old
    metadata, which ``load_bundle`` refuses."""
    aside = temp_sibling(card.with_name(f"{card.name}.old"))
    moved = False  # a file already at ``aside`` (left by a killed attempt) is never put back
    try:
        os.replace(card, aside)
        moved = True
        os.replace(card_tmp, card)
        os.replace(meta_tmp, meta)
    except BaseException:
        card_tmp.unlink(missing_ok=True)
        meta_tmp.unlink(missing_ok=True)
        if moved:
            os.replace(aside, card)
        raise
    aside.unlink()
