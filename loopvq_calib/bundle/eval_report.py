"""A ``loopvq-eval`` report.json as ``loopvq-push --eval-report`` reads it: strict JSON (:func:`format.strict_json`),
the shape of every part the model card uses (:func:`check_report`) and the one row of a bundle
(:func:`bundle_row`); each refusal is an :class:`EvalReportError` naming the file and the field."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NoReturn

from ..config.source import cut, shown
from ..runtime.input_files import read_capped
from .format import FIELD_CHARS, BundleError, strict_json

REPORT_FILE = "report.json"
_KINDS = {str: "a string", dict: "an object", list: "a list", bool: "true or false", type(None): "null"}
_NONE = type(None)


class EvalReportError(ValueError):
    """The evaluation report cannot be attached to the bundle (unreadable, malformed, of another bundle)."""


def read_eval_report(report_path: str | Path) -> dict[str, Any]:
    """A ``loopvq-eval`` report.json (or its folder) as a dict, parsed strictly and its shape checked."""
    file = report_file(report_path)
    data = read_capped(
        file,
        "evaluation report",
        error=lambda problem: EvalReportError(f"--eval-report: cannot read an evaluation report: {cut(problem, 300)}"),
    )
    try:
        report = strict_json(data, file)
    except BundleError as err:
        raise EvalReportError(f"--eval-report: cannot read an evaluation report: {err}") from None
    check_report(report, f"--eval-report {file}")
    return report


def report_file(report_path: str | Path) -> Path:
    """The report.json ``report_path`` names: the file itself, or the one in that folder."""
    path = Path(report_path)
    try:
        return path / REPORT_FILE if path.is_dir() else path
    except OSError:  # a name the file system refuses: reading it says why
        return path


def check_report(report: Any, source: str) -> None:
    """The parts of a report the card reads: every row an object with a name, the model, dtype and data
    strings, and ``served``'s entries, task scores and passkey accuracies (:func:`_check_served`)."""
    if not isinstance(report, dict) or not isinstance(report.get("bundles"), list):
        raise EvalReportError(f"{source}: not a loopvq-eval report (no list of bundles)")
    _get(report, "model", (str, _NONE), "model", source)
    _get(report, "dtype", (str, _NONE), "dtype", source)
    data = _get(report, "data", (dict, _NONE), "data", source)
    if data is not None:
        _get(data, "dataset", (str, _NONE), "data.dataset", source)
    for i, row in enumerate(report["bundles"]):
        if not isinstance(row, dict):
            _refuse(source, f"bundles[{i}]", f"is {shown(row)}, not an object")
        _get(row, "name", (str,), f"bundles[{i}].name", source, required=True)
        _get(row, "baseline", (bool, _NONE), f"bundles[{i}].baseline", source)
    served = _get(report, "served", (dict, _NONE), "served", source)
    if served is not None:
        _check_served(served, source)


def _check_served(served: dict[str, Any], source: str) -> None:
    """``served``: a reference name, entries of distinct names whose serving (or null) has integer sinks and
    window, task scores {entry: {task: {metric: number}}} and passkey accuracies {entry: {length: number}}."""
    _get(served, "reference", (str, _NONE), "served.reference", source)
    seen: set[str] = set()
    for i, entry in enumerate(_get(served, "entries", (list, _NONE), "served.entries", source) or []):
        where = f"served.entries[{i}]"
        if not isinstance(entry, dict):
            _refuse(source, where, f"is {shown(entry)}, not an object")
        name = _get(entry, "name", (str,), f"{where}.name", source, required=True)
        if name in seen:
            _refuse(source, f"{where}.name", f"repeats the entry {shown(name)}")
        seen.add(name)
        serving = _get(entry, "serving", (dict, _NONE), f"{where}.serving", source)
        for key in ("sink_tokens", "recent_window") if serving is not None else ():
            value = serving.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                _refuse(source, f"{where}.serving.{key}", f"is {shown(value)}, not a non-negative integer")
    tasks = _get(served, "tasks", (dict, _NONE), "served.tasks", source) or {}
    _numbers(
        _get(tasks, "scores", (dict, _NONE), "served.tasks.scores", source) or {},
        "served.tasks.scores",
        source,
        levels=3,
    )
    passkey = _get(served, "passkey", (dict, _NONE), "served.passkey", source) or {}
    _numbers(
        _get(passkey, "accuracy", (dict, _NONE), "served.passkey.accuracy", source) or {},
        "served.passkey.accuracy",
        source,
        levels=2,
    )


def kl_key(row: dict[str, Any]) -> str:
    """The evaluation KL's key in a report row: ``eval_kl``, or ``heldout_kl`` in reports written before the rename."""
    return "eval_kl" if "eval_kl" in row or "heldout_kl" not in row else "heldout_kl"


def bundle_row(report: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    """The one non-baseline row named ``name`` in a checked report, its evaluation KL and
    perplexities finite numbers; no such row, or more than one, is an EvalReportError."""
    found = [(i, r) for i, r in enumerate(report["bundles"]) if not r.get("baseline") and r["name"] == name]
    if not found:
        names = ", ".join(sorted({r["name"] for r in report["bundles"] if not r.get("baseline")}))
        raise EvalReportError(f"{source}: no bundle named {shown(name)} (the report has: {cut(names, 200) or 'none'})")
    if len(found) > 1:
        raise EvalReportError(
            f"{source}: {len(found)} rows (bundles[{found[0][0]}], bundles[{found[1][0]}]) measured "
            f"a bundle named {shown(name)}, so which one measured this bundle is unknown; evaluate "
            "the bundle on its own and attach that report"
        )
    index, row = found[0]
    for key in (kl_key(row), "ppl_quantized", "ppl_fp"):
        if key not in row:
            _refuse(source, f"bundles[{index}].{key}", "is missing")
        _finite(row[key], f"bundles[{index}].{key}", source)
    return row


def _get(
    obj: dict[str, Any], key: str, kinds: tuple[type, ...], field: str, source: str, *, required: bool = False
) -> Any:
    """``obj[key]`` when it is one of ``kinds`` (absent: None, or refused when ``required``)."""
    if key not in obj:
        if required:
            _refuse(source, field, "is missing")
        return None
    value = obj[key]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        _refuse(source, field, f"is {shown(value)}, not {' or '.join(_KINDS[k] for k in kinds)}")
    return value


def _numbers(table: Any, field: str, source: str, *, levels: int) -> None:
    """``table`` is ``levels`` nested objects whose leaves are finite numbers."""
    if levels == 0:
        _finite(table, field, source)
        return
    if not isinstance(table, dict):
        _refuse(source, field, f"is {shown(table)}, not an object")
    for key, value in table.items():
        _numbers(value, f"{field}.{key}", source, levels=levels - 1)


def _finite(value: Any, field: str, source: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        _refuse(source, field, f"is {shown(value)}, not a finite number")


def _refuse(source: str, field: str, problem: str) -> NoReturn:
    raise EvalReportError(
        f"{source}: field {cut(field, FIELD_CHARS)} {problem}; a report loopvq-eval wrote has "
        "it (run loopvq-eval again)"
    )
