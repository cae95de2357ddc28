"""The stage table: every calibration stage as one row (:class:`Stage`) of :data:`STAGES`, in run order. The
pipeline iterates it; preflight and ``--stages`` take the names and the configs that have each stage from it;
the fingerprints hash what each row covers (``fingerprints.py``). A row's function takes a :class:`StageRun` and
the outputs of the stages it names, by name, and calls the plain functions of ``stages.py``; adding a stage is
adding a row (docs/architecture.md, "Adding a stage")."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from tqdm.auto import tqdm

from ..codes.layouts import plan_layouts
from ..codes.quantizer import KVQuantizer
from ..config.methods import methods
from ..config.schema import Config
from ..data.corpus import CalibrationSet, build_calibration_set
from ..runtime.warmup import Warmup
from ..version import __version__
from .capture.reader import CaptureData, CaptureReader, MemoryReader
from .capture.store import StoreChoice
from .finetune.schedule import training_steps
from .finetune.train import FinetuneResult
from .plan import RunModel, RunPlan
from .stages import (
    as_saved_finetune,
    as_saved_quantizer,
    load_calibration,
    load_finetune,
    load_quantizer,
    run_bundle,
    run_capture,
    run_finetune,
    run_kmeans,
    run_tasq,
    save_calibration,
)
from .tasq.grouping import TasqResult

Output = TypeVar("Output")


@dataclass(frozen=True)
class Condition:
    """The configs that have a stage: those for which ``holds(cfg)``; ``only_for(cfg)`` names them, for
    ``--stages`` asking for the stage elsewhere."""

    holds: Callable[[Config], bool]
    only_for: Callable[[Config], str]


def _tasq_methods(cfg: Config) -> str:
    """``--stages``' words for the configs with a TaSQ stage: the registered methods that have one."""
    names = [m.name for m in methods() if m.uses_tasq]
    return f"quant.method {' or '.join(names)}, not {cfg.quant.method}"


WITH_TASQ = Condition(lambda cfg: cfg.quant.uses_tasq, _tasq_methods)


@dataclass(frozen=True, kw_only=True)
class StageRun:
    """What a stage function gets besides its inputs."""

    plan: RunPlan
    folder: Path  # where it writes: the stage's temporary folder, published (renamed) when the stage is done
    model: RunModel  # the run's model and tokenizer, loaded on first use
    warmup: Warmup  # the background warm-up: a stage waits for its job before it uses what the job prepares

    def progress(self, total: int, desc: str) -> tqdm:
        """A progress bar, shown by the main process only."""
        return tqdm(total=total, desc=desc, disable=not self.plan.dist.is_main, dynamic_ncols=True)


@dataclass(frozen=True)
class StageDone(Generic[Output]):
    """What a stage function returns: its record's details (the manifest's) and its output when the stage keeps
    it in memory (as saved, or a capture held in memory); None: the output is read back from the stage's folder."""

    details: dict[str, Any]
    output: Output | None = None


@dataclass(frozen=True)
class Stage:
    """One row of the stage table: a stage's name (its folder in the run directory and its ``--stages`` name), its
    function, what it takes and gives, what its fingerprint covers and where it runs."""

    name: str
    function: Callable[..., StageDone]  # function(StageRun, **inputs): writes into StageRun.folder
    output: type  # what later stages get from it (checked when the stage is run or reused)
    _: KW_ONLY
    load: Callable[[Path], Any]  # its output read back from its published folder (a reused stage, other processes)
    inputs: tuple[str, ...] = ()  # earlier stages whose outputs it takes, as keyword arguments of those names
    after: tuple[str, ...] = ()  # earlier stages whose fingerprints its own covers, in this order
    covers: tuple[str, ...] = ()  # config sections and run facts its fingerprint covers (fingerprints.covered)
    every_process: bool = True  # False: the main process runs it, the others read its folder
    exists: Condition | None = None  # the configs that have this stage (None: all; its fingerprint is None elsewhere)
    resumable: bool = False  # an interrupted run's temporary folder is kept for the rerun
    # where its output is held when that may be memory: such an output is never reused nor resumed, is made only
    # when a stage reading it runs, and its record's fingerprint adds the place
    held: Callable[[RunPlan], StoreChoice] | None = None
    release: Callable[[Any], None] | None = None  # let go of its output once the last stage reading it is done
    manifest: Callable[[Any], dict[str, Any]] | None = None  # manifest entries of its output (None: not wanted)

    def applies(self, cfg: Config) -> bool:
        """Whether ``cfg``'s runs have this stage."""
        return self.exists is None or self.exists.holds(cfg)


# -- the stage functions ---------------------------------------------------------------------------
def stage_data(run: StageRun) -> StageDone[CalibrationSet]:
    """The calibration set: the plan's (built by the checks), else built now; later read back from its files."""
    calib = run.plan.calibration or build_calibration_set(run.plan.cfg.data, run.model.tokenizer())
    return StageDone(save_calibration(calib, run.folder))


def stage_capture(run: StageRun, *, data: CalibrationSet) -> StageDone[CaptureData]:
    """K/V and Fisher of every sequence, in the plan's store; a capture held in memory is the output itself."""
    plan, loading = run.plan, time.time()
    model = run.model.get()  # loaded here, on first use: its time is reported apart
    loading = time.time() - loading
    bar = run.progress(data.input_ids.shape[0], "capture")
    reader = run_capture(
        model,
        data,
        plan.model.kv,
        cfg=plan.cfg,
        store=plan.store,
        folder=run.folder,
        dist=plan.dist,
        progress=lambda n: bar.update(n * plan.dist.world),
    )
    bar.close()
    details = {
        "sequences": int(data.input_ids.shape[0]),
        "sites": plan.model.kv.num_sites,
        "store": plan.store.store,
        "store_reason": plan.store.reason,
        "model_load_s": round(loading, 2),
    }
    return StageDone(details, reader if isinstance(reader, MemoryReader) else None)


def stage_tasq(run: StageRun, *, capture: CaptureData) -> StageDone[TasqResult]:
    """TaSQ's transforms and groups (read back from the stage's files)."""
    run.warmup.wait("linalg")
    plan = run.plan
    result = run_tasq(capture, plan.model.kv, plan.cfg, folder=run.folder, dist=plan.dist, device=plan.kmeans_device)
    return StageDone({"blocks": len(result.transforms), "processes": plan.dist.world} if result is not None else {})


def stage_kmeans(run: StageRun, *, capture: CaptureData, tasq: TasqResult | None) -> StageDone[KVQuantizer]:
    """The codebooks: the main process keeps those it saved (as the files read them back), the others read them."""
    plan = run.plan
    layouts = len(tasq.layouts if tasq is not None else plan_layouts(plan.model.kv, plan.cfg.quant))
    run.warmup.wait("kmeans_backend")
    bar = run.progress(layouts, "kmeans")
    report = run_kmeans(
        capture,
        tasq,
        plan.model.kv,
        cfg=plan.cfg,
        folder=run.folder,
        dist=plan.dist,
        device=plan.kmeans_device,
        progress=lambda n: bar.update(n * plan.dist.world),
    )
    bar.close()
    kept = as_saved_quantizer(report.quantizer) if report is not None else None  # main process only
    return StageDone({"codebooks": layouts, "processes": plan.dist.world}, kept)


def stage_finetune(run: StageRun, *, data: CalibrationSet, kmeans: KVQuantizer) -> StageDone[FinetuneResult]:
    """The kept codebooks: as :func:`stage_kmeans`, the main process keeps what it saved."""
    plan = run.plan
    run.warmup.wait("codec_kernels")
    bar = run.progress(training_steps(plan.cfg.finetune, len(data.train)), "finetune")
    result = run_finetune(
        run.model.get(),
        data,
        kmeans,
        cfg=plan.cfg,
        folder=run.folder,
        dist=plan.dist,
        device=plan.device,
        progress=bar.update,
    )
    bar.close()
    kept = as_saved_finetune(result) if plan.dist.is_main else None  # the process that saved it
    return StageDone({"best_epoch": result.best_epoch, "best_step": result.best_step}, kept)


def stage_bundle(run: StageRun, *, data: CalibrationSet, finetune: FinetuneResult) -> StageDone[Path]:
    """The bundle (its folder is the output)."""
    plan = run.plan
    return StageDone(
        run_bundle(run.folder, finetune, data, identity=plan.model.identity, cfg=plan.cfg, version=__version__)
    )


# -- what the rows say besides their functions -----------------------------------------------------
def capture_store(plan: RunPlan) -> StoreChoice:
    """Where the capture is held (the checks chose it)."""
    return plan.store


def release_capture(reader: CaptureData) -> None:
    """Let go of a capture held in memory (its host memory in a background thread); a disk capture holds none."""
    if isinstance(reader, MemoryReader):
        reader.capture.release()


def calibration_entries(calib: CalibrationSet) -> dict[str, Any]:
    """The manifest's record of the calibration data."""
    return {"data_sha256": calib.content_hash, "calibration": calib.description}


def finetune_entries(tuned: FinetuneResult | None) -> dict[str, Any]:
    """The manifest's selection curve (None when fine-tuning was not asked for)."""
    return {"finetune_curve": tuned.curve if tuned else None}


STAGES: tuple[Stage, ...] = (
    Stage(
        "data",
        stage_data,
        CalibrationSet,
        load=load_calibration,
        covers=("data", "tokenizer_files", "data_sources"),
        every_process=False,
        manifest=calibration_entries,
    ),
    Stage(
        "capture",
        stage_capture,
        CaptureData,
        load=CaptureReader,
        inputs=("data",),
        after=("data",),
        covers=("model_identity", "model.dtype", "loop_steps", "capture", "tasq.weight_floor"),
        resumable=True,
        held=capture_store,
        release=release_capture,
    ),
    Stage(
        "tasq",
        stage_tasq,
        TasqResult,
        load=TasqResult.load,
        inputs=("capture",),
        after=("capture",),
        covers=("quant", "tasq"),
        exists=WITH_TASQ,
    ),
    Stage(
        "kmeans",
        stage_kmeans,
        KVQuantizer,
        load=load_quantizer,
        inputs=("capture", "tasq"),
        after=("capture", "tasq"),
        covers=("quant", "kmeans"),
    ),
    Stage(
        "finetune",
        stage_finetune,
        FinetuneResult,
        load=load_finetune,
        inputs=("data", "kmeans"),
        after=("kmeans", "data"),
        covers=("model_identity", "model.dtype", "finetune"),
        resumable=True,
        manifest=finetune_entries,
    ),
    Stage(
        "bundle",
        stage_bundle,
        Path,
        load=Path,
        inputs=("data", "finetune"),
        after=("finetune",),
        covers=("output",),
        every_process=False,
    ),
)
STAGE_NAMES: tuple[str, ...] = tuple(stage.name for stage in STAGES)  # in run order; ``--stages`` takes these
