"""The inputs of an evaluation, checked before any work: the served-cache options, the gates, the device, the
held-out text, the bundles and the model they were calibrated for. Errors name the ``loopvq-eval`` option."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..bundle.reader import Bundle, BundleError, load_bundle, resolve_bundle_dir
from ..codes.baselines import BASELINES
from ..config.schema import DataConfig
from ..config.source import LOCAL_TYPES, shown
from ..config.validate import DEVICE_NAME
from ..data.corpus import build_calibration_set, load_documents, local_files
from ..models.loading import (
    ModelLoadError,
    check_model_folder,
    load_model,
    model_window,
    pick_device,
    resolve_model_dir,
)
from .harness import lm_eval_available, task_manager
from .options import Gates, ServedOptions
from .passkey import NEW_TOKENS

DEFAULT_DATA = Path("artifacts/data/shakespeare-heldout.jsonl")  # relative to the working folder or the checkout
EVAL_DATA_NAMES = {
    "dataset": "--data",
    "num_sequences": "--num-sequences",
    "sequence_length": "--sequence-length",
    "type": None,
    "text_field": None,
}  # how the data errors name the setting


class EvalInputError(ValueError):
    """Bad input to an evaluation (missing bundle, model or data, a bad option); ``loopvq-eval`` exits 2."""


@dataclass(frozen=True)
class EvalInputs:
    """The bundles (checked against the model), the model in eval mode, its tokenizer and the name it was given by."""

    bundles: list[Bundle]
    model: torch.nn.Module
    tokenizer: Any
    model_name: str


def check_served_options(served: ServedOptions | None) -> None:
    """Baseline names, task names (lm-eval's registry plus the shipped tasks), passkey lengths and the
    serving overrides, checked before any model is loaded."""
    if served is None:
        return
    unknown = [b for b in served.baselines if b not in BASELINES]
    if unknown:
        raise EvalInputError(f"--baseline {','.join(unknown)}: unknown; expected some of {','.join(BASELINES)}")
    for flag, value in (("--sink-tokens", served.sink_tokens), ("--recent-window", served.recent_window)):
        if value is not None and value < 0:
            raise EvalInputError(f"{flag} must be >= 0, got {value}")
    if served.limit is not None and not served.limit > 0:
        raise EvalInputError(f"--limit must be > 0, got {served.limit:g}")
    if served.batch_size < 1 or served.passkey_trials < 1:
        raise EvalInputError(
            f"--batch-size and --passkey-trials must be >= 1, got {served.batch_size}, {served.passkey_trials}"
        )
    if any(n < 16 for n in served.passkey_lengths):
        raise EvalInputError(f"--passkey-lengths {served.passkey_lengths}: each length must be >= 16 tokens")
    for path in served.include_path:
        if not Path(path).is_dir():
            raise EvalInputError(f"--include-path {path}: no such folder")
    if (served.tasks or served.passkey_lengths) and not lm_eval_available():
        raise EvalInputError("--tasks / --passkey-lengths need lm-evaluation-harness: pip install 'loopvq-calib[eval]'")
    if served.tasks:
        known = set(task_manager(served.include_path, served.tasks).all_tasks)
        missing = [t for t in served.tasks if t not in known]
        if missing:
            raise EvalInputError(
                f"--tasks {','.join(missing)}: not an lm-eval task or group here (the shipped "
                "local task is loopvq_recall; add task folders with --include-path)"
            )


def check_gate_thresholds(gates: Gates) -> None:
    """The KL and perplexity thresholds: finite and >= 0."""
    for flag, value in (("--max-kl", gates.max_kl), ("--max-ppl-increase", gates.max_ppl_increase)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise EvalInputError(f"{flag} must be a finite number >= 0, got {value}")


def check_device(device: str) -> None:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    if not DEVICE_NAME.fullmatch(device):
        raise EvalInputError(f"--device {shown(device)} is not allowed; use auto, cpu, cuda or cuda:N")


def data_source(data: str | None, num_sequences: int, sequence_length: int) -> str:
    """The held-out data argument, checked (a local file read through) before anything is loaded; ``None`` ->
    the shipped default file."""
    if num_sequences < 1 or sequence_length < 2:
        raise EvalInputError(
            f"need --num-sequences >= 1 and --sequence-length >= 2, got {num_sequences}, {sequence_length}"
        )
    if data is None:
        candidates = [DEFAULT_DATA, Path(__file__).resolve().parents[2] / DEFAULT_DATA]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise EvalInputError(f"no --data given and the default {DEFAULT_DATA} does not exist here")
        return str(found)
    looks_local = Path(data).suffix in LOCAL_TYPES or data.startswith((".", "/", "~"))  # else maybe a hub name
    if looks_local and not any(ch in data for ch in "*?[") and not Path(data).expanduser().exists():
        raise EvalInputError(f"--data {data}: no such file or folder")
    data = str(Path(data).expanduser()) if looks_local else data
    # a local source is read now (UTF-8, parseable, some text)
    empty = (
        local_files(data, EVAL_DATA_NAMES["dataset"])
        and next(load_documents(DataConfig(dataset=data), EVAL_DATA_NAMES), None) is None
    )
    if empty:
        raise EvalInputError(f"--data {data}: holds no text (no non-empty 'text' field or line)")
    return data


def load_inputs(
    paths: Sequence[str | Path],
    model: str | None,
    device: str,
    *,
    dtype: str,
    sequence_length: int | None = None,
    passkey_lengths: Sequence[int] = (),
) -> EvalInputs:
    """Bundles (each checked against the model's identity), the model (default: the bundles') and its tokenizer.
    The model folder's files, and ``sequence_length`` and ``passkey_lengths`` against the model's window, are
    checked before any weight is read."""
    if not paths:
        raise EvalInputError("no bundle given (--bundle PATH, repeatable)")
    dirs = []
    for p in paths:
        try:
            dirs.append(resolve_bundle_dir(p, key="--bundle"))
        except BundleError as err:
            raise EvalInputError(f"--bundle {err}" if not str(err).startswith("--bundle") else str(err)) from err
    idents = [load_bundle(d).meta["model"] for d in dirs]
    key = "--model"
    if model is None:
        names = {i["name"] for i in idents}
        if len(names) > 1:
            raise EvalInputError(
                f"the bundles were calibrated for different models ({', '.join(sorted(names))}); "
                "evaluate them separately or name one with --model"
            )
        model, revision, key = idents[0]["name"], idents[0].get("revision"), f"{dirs[0]}: the bundle's model"
        try:
            folder = resolve_model_dir(model, revision, key=key)
        except ModelLoadError as err:
            raise EvalInputError(f"{err}; pass the model with --model FOLDER_OR_HUB_ID") from err
    else:
        folder = resolve_model_dir(model, None, key=key)
    check_window(check_model_folder(folder, key), folder, sequence_length, passkey_lengths)
    loaded = [load_bundle(d, model=folder) for d in dirs]
    if len({json.dumps(b.meta["kv_layout"], sort_keys=True) for b in loaded}) > 1:
        raise EvalInputError("the bundles have different KV layouts (loop counts); evaluate them separately")
    steps = loaded[0].quantizer.kv.loop_steps
    model_obj, tokenizer = load_model(folder, dtype, pick_device(device, "--device"), loop_steps=steps, key=key)
    if model_obj.kv_layout() != loaded[0].quantizer.kv:
        raise EvalInputError(f"{loaded[0].path}: its KV layout does not match model {model} at {steps} loop steps")
    return EvalInputs(loaded, model_obj, tokenizer, model)


def check_window(
    model_config: Any, folder: Path, sequence_length: int | None, passkey_lengths: Sequence[int] = ()
) -> None:
    """``--sequence-length`` and each passkey prompt with its answer fit the model's window (config.json's
    ``max_position_embeddings``, Huginn ``block_size``)."""
    window, field = model_window(model_config)
    source = f"{field} in {folder / 'config.json'}"
    if sequence_length is not None and sequence_length > window:
        raise EvalInputError(
            f"--sequence-length {sequence_length:,} exceeds the model's window of {window:,} tokens ({source})"
        )
    too_long = [n for n in passkey_lengths if n + NEW_TOKENS > window]
    if too_long:
        raise EvalInputError(
            f"--passkey-lengths {too_long}: prompts plus {NEW_TOKENS} new tokens exceed the model's "
            f"window of {window:,} tokens ({source})"
        )


def check_sink_room(bundles: list[Bundle], sequence_length: int) -> None:
    """Every bundle's sink tokens leave positions to measure in a sequence."""
    for b in bundles:
        if sequence_length <= max(b.serving["sink_tokens"], 1):
            raise EvalInputError(
                f"--sequence-length {sequence_length} leaves no position after the "
                f"{b.serving['sink_tokens']} sink tokens of {b.path}"
            )


def heldout_sequences(
    data: str, tokenizer: Any, num_sequences: int, *, sequence_length: int
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Held-out token windows [n, L] of ``data`` (local file/folder/glob or hub dataset) and their description."""
    cfg = DataConfig(dataset=data, num_sequences=num_sequences, sequence_length=sequence_length, heldout_sequences=0)
    calib = build_calibration_set(cfg, tokenizer, EVAL_DATA_NAMES)
    return calib.input_ids, calib.description
