"""A checked run: :class:`RunPlan` (what :func:`~loopvq_calib.calibration.preflight.plan_run` found, before anything
is written), the model as the checks described it (:class:`ModelFacts`, no weight read) and the run's model
itself (:class:`RunModel`, loaded once, when a stage first needs it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config.schema import Config
from ..data.corpus import CalibrationSet
from ..models.loading import ModelIdentity, load_model, load_tokenizer
from ..models.sites import KVLayout
from ..runtime.processes import DistContext
from .capture.store import StoreChoice
from .rundir import RunDir


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """The model as the checks found it, built on the meta device: its files, its KV sites at the run's loop count,
    its weights' bytes in the run's dtype and what the bundle records of it."""

    folder: Path  # the model's files (a local folder or its hub cache snapshot)
    config: Any  # config.json as a transformers config
    kv: KVLayout
    weight_bytes: int
    identity: ModelIdentity


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """A checked run: what the stages need to know before the first one starts."""

    cfg: Config  # resolved and validated (a copy: the caller's config is left as it was)
    dist: DistContext  # this process among the run's processes
    wanted: tuple[str, ...]  # the stages of its stage table to run or reuse, in order
    model: ModelFacts
    device: torch.device  # the model's
    kmeans_device: torch.device  # TaSQ's and k-means'
    run: RunDir  # the run directory, checked (not opened: nothing is written yet)
    store: StoreChoice | None  # where the capture goes (None: no capture stage is wanted)
    fingerprints: dict[str, str | None]  # stage -> fingerprint (None for a stage the config has not)
    calibration: CalibrationSet | None  # built by the main process, unless the data stage is reused
    tokenizer: Any  # the tokenizer the calibration set was built with (None when none was built)
    timings: dict[str, float]  # seconds of each check, for the manifest's ``startup``


class RunModel:
    """The run's model and tokenizer, each loaded once, on first use: a run whose stages are all reused loads
    no weights."""

    def __init__(self, plan: RunPlan) -> None:
        """Loads from ``plan.model.folder`` in ``model.dtype`` onto ``plan.device``; the tokenizer the checks
        loaded (``plan.tokenizer``) is kept."""
        self.plan = plan
        self._model: torch.nn.Module | None = None
        self._tokenizer = plan.tokenizer

    def get(self) -> torch.nn.Module:
        """The model (with its tokenizer), loaded on the first call."""
        if self._model is None:
            model_cfg = self.plan.cfg.model
            self._model, self._tokenizer = load_model(
                self.plan.model.folder, model_cfg.dtype, self.plan.device, loop_steps=model_cfg.loop_steps
            )
        return self._model

    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded on the first call unless the checks or the model's loading did."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.plan.model.folder)
        return self._tokenizer
