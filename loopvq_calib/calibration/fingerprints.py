"""Stage fingerprints: what each stage's result depends on (its config, the toolkit version, its inputs'
fingerprints), hashed, so that a change invalidates that stage and every later one."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..config.schema import Config
from ..data.corpus import source_fingerprint
from ..models.files import keyed
from ..runtime.input_files import chunks_capped
from ..version import __version__


def fingerprint(*parts: Any) -> str:
    """sha256 of the JSON form of ``parts`` (keys sorted)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def tokenizer_hash(folder: Path) -> str:
    """sha256 over the names and bytes of the model folder's tokenizer files (``tokenizer*``, ``*.txt``), each a
    regular file read in chunks within the tokenizer-file bound (runtime/input_files.py; else a ModelLoadError)."""
    h = hashlib.sha256()
    for name in sorted(p.name for p in folder.glob("tokenizer*")) + sorted(p.name for p in folder.glob("*.txt")):
        h.update(name.encode())
        for chunk in chunks_capped(folder / name, "tokenizer file", error=keyed("model.name_or_path")):
            h.update(chunk)
    return h.hexdigest()


def data_fingerprint(cfg: Config, model_folder: Path) -> str:
    """The data stage's fingerprint: ``data`` settings, the tokenizer's files and the source files' identities."""
    return fingerprint("data", __version__, asdict(cfg.data), tokenizer_hash(model_folder),
                       source_fingerprint(cfg.data))


def stage_fingerprints(cfg: Config, data_fp: str, identity: dict[str, Any], *,
                       loop_steps: int) -> dict[str, str | None]:
    """Every stage's fingerprint, from the config and the data's and model's identities (``tasq``: None for
    methods without it). ``capture`` is what the capture holds, not where (the store is left out), so the
    later stages are reused whichever store held it; the capture stage itself adds the store."""
    q = asdict(cfg.quant)
    content = {k: v for k, v in asdict(cfg.capture).items() if k != "store"}
    capture = fingerprint("capture", __version__, data_fp, identity, cfg.model.dtype, loop_steps, content,
                          cfg.tasq.weight_floor if cfg.quant.uses_tasq else None)  # TaSQ keys' Fisher: stored weighted
    tasq_settings = asdict(cfg.tasq)
    if tasq_settings["grouping"] == "free":  # the grouping of runs made before the option: their stages stay reusable
        del tasq_settings["grouping"]
    tasq = fingerprint("tasq", __version__, capture, q, tasq_settings) if cfg.quant.uses_tasq else None
    kmeans = fingerprint("kmeans", __version__, capture, tasq, q, asdict(cfg.kmeans))
    finetune = fingerprint("finetune", __version__, kmeans, data_fp, identity, cfg.model.dtype, asdict(cfg.finetune))
    bundle = fingerprint("bundle", __version__, finetune, asdict(cfg.output))
    return {"data": data_fp, "capture": capture, "tasq": tasq, "kmeans": kmeans, "finetune": finetune, "bundle": bundle}
