"""Stage fingerprints: what each stage's result depends on, hashed, so that a change invalidates that stage and
every later one. A stage's fingerprint hashes its name, the toolkit version, the fingerprints of the stages its
row comes ``after`` and the values its row ``covers`` (stage_table.py): config sections and settings, and the run
facts (:class:`RunFacts`) that are not in the config."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from ..config.schema import Config
from ..data.corpus import source_fingerprint
from ..models.files import keyed
from ..runtime.input_files import chunks_capped
from ..version import __version__
from .plan import ModelFacts
from .stage_table import STAGES, Stage


@dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What the fingerprints cover besides the config."""

    model_identity: dict[str, Any]  # ModelIdentity.to_dict(): config and weight files
    loop_steps: int  # the model's loop count in this run
    tokenizer_files: str  # tokenizer_hash of the model folder
    data_sources: Any  # source_fingerprint of data.dataset: an edited corpus invalidates the data stage


def run_facts(cfg: Config, model: ModelFacts) -> RunFacts:
    """The run facts of ``cfg``'s run of ``model`` (reads the tokenizer and data files)."""
    return RunFacts(
        model_identity=model.identity.to_dict(),
        loop_steps=model.kv.loop_steps,
        tokenizer_files=tokenizer_hash(model.folder),
        data_sources=source_fingerprint(cfg.data),
    )


def _tasq_settings(cfg: Config) -> dict[str, Any]:
    settings = asdict(cfg.tasq)
    if settings["grouping"] == "free":  # the grouping of runs made before the option: their stages stay reusable
        del settings["grouping"]
    return settings


# covered names hashed otherwise than as the config holds them
VIEWS: dict[str, Callable[[Config], Any]] = {
    # what the capture holds, not where: the later stages are reused whichever store held it (the capture stage's
    # record adds the store, pipeline.py)
    "capture": lambda cfg: {k: v for k, v in asdict(cfg.capture).items() if k != "store"},
    "tasq": _tasq_settings,
    # TaSQ keys' Fisher is stored weighted; other methods' captures do not depend on it
    "tasq.weight_floor": lambda cfg: cfg.tasq.weight_floor if cfg.quant.uses_tasq else None,
}
RUN_FACT_NAMES = frozenset(f.name for f in fields(RunFacts))


def covered(name: str, cfg: Config, facts: RunFacts) -> Any:
    """The value a fingerprint hashes for a covered ``name``: a run fact (a field of :class:`RunFacts`), a view
    (:data:`VIEWS`), else the config's section or setting at that dotted path (a section as a dict)."""
    if name in RUN_FACT_NAMES:
        return getattr(facts, name)
    if name in VIEWS:
        return VIEWS[name](cfg)
    value: Any = cfg
    for part in name.split("."):
        value = getattr(value, part)
    return asdict(value) if is_dataclass(value) else value


def stage_fingerprints(cfg: Config, facts: RunFacts, table: Sequence[Stage] = STAGES) -> dict[str, str | None]:
    """Every stage's fingerprint (module docstring), in table order; None for a stage ``cfg`` has not."""
    fingerprints: dict[str, str | None] = {}
    for stage in table:
        if not stage.applies(cfg):
            fingerprints[stage.name] = None
            continue
        parts = [fingerprints[name] for name in stage.after] + [covered(name, cfg, facts) for name in stage.covers]
        fingerprints[stage.name] = fingerprint(stage.name, __version__, *parts)
    return fingerprints


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
