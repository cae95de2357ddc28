"""The order of the stages (data -> capture -> tasq (TaSQ methods) -> kmeans -> finetune -> bundle), their
reuse and the run directory; the checks before any work are :func:`~loopvq_calib.calibration.preflight.plan_run`,
the stages themselves plain functions (``stages.py``).

Each stage's fingerprint covers its own config, the toolkit version and its inputs' fingerprints, so a
change invalidates that stage and every later one; an unchanged stage is reused from the run directory.
Under ``accelerate launch`` capture, TaSQ, k-means and fine-tuning are shared across processes (one
:class:`~loopvq_calib.runtime.processes.DistContext` per run); data and bundle run on the main process.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..codes.layouts import plan_layouts
from ..codes.quantizer import KVQuantizer
from ..config.load import dump_config, load_config
from ..config.schema import Config
from ..data.corpus import CalibrationSet, build_calibration_set
from ..models.loading import load_model, load_tokenizer
from ..runtime.clock import seconds_since_process_start
from ..runtime.files import write_bytes_atomic
from ..runtime.processes import DistContext
from ..runtime.warmup import Warmup
from ..version import __version__
from .capture.kv import CaptureData, CaptureReader, MemoryReader
from .finetune.train import FinetuneResult, training_steps
from .fingerprints import fingerprint
from .preflight import gpu_sized, plan_run
from .rundir import CONFIG_FILE, LOG_FILE
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
    selection_metrics,
)
from .tasq.grouping import TasqResult

log = logging.getLogger("loopvq_calib")
StageMethod = Callable[..., Any]


def _names_failure(stage: str) -> Callable[[StageMethod], StageMethod]:
    """A stage method that sets :attr:`Pipeline.failed_stage` to ``stage`` when it raises (unless a stage it ran
    already named itself), whatever the manifest's older records say."""
    def wrap(method: StageMethod) -> StageMethod:
        @functools.wraps(method)
        def run(self: Pipeline, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except BaseException:
                self.failed_stage = self.failed_stage or stage
                raise

        return run

    return wrap


@dataclass
class RunResult:
    """What a run produced: its folder, the bundle (None when the bundle stage was not asked for), each stage's
    record and the fine-tuning's selection metrics."""

    run_dir: Path
    bundle: Path | None
    stages: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    is_main: bool = True  # the run's main process (under accelerate launch every process gets a result)


class Pipeline:
    """One calibration run; :meth:`run_all` executes (or reuses) the stages up to the last one asked for.
    :attr:`failed_stage`: the stage (data, capture, tasq, kmeans, finetune, bundle) that raised in the last
    :meth:`run_all`, None when none did (the run failed elsewhere, or did not fail)."""

    failed_stage: str | None = None

    def __init__(self, cfg: Config, output: str | Path | None = None, stages: list[str] | None = None,
                 *, dist: DistContext | None = None, warmup: Warmup | None = None) -> None:
        """Check the run (:func:`~loopvq_calib.calibration.preflight.plan_run`: every check that can fail on bad
        input, before anything is written) and wire its stages. ``dist``: the run's processes (default: this
        process under ``accelerate launch``). ``warmup``: the background warm-up to add the stages' jobs to
        (``loopvq-calibrate`` starts one before its imports; default: a new one). :attr:`startup` holds the
        seconds of each check and those from the process's start to here."""
        entered = time.perf_counter()
        startup = {"entered_at": time.time(), "process_start_s": seconds_since_process_start()}
        self.warmup = warmup or Warmup()  # first-use costs of the device, in the background; stages wait for theirs
        self.plan = plan_run(cfg, output, stages, dist=dist, warmup=self.warmup)
        cfg = self.cfg = self.plan.cfg
        self.dist, self.run = self.plan.dist, self.plan.run
        self.wanted, self.device = self.plan.wanted, self.plan.device
        self._model, self._tokenizer = None, self.plan.tokenizer
        self.startup = {**startup, **self.plan.timings, "pipeline_init_s": round(time.perf_counter() - entered, 3)}

    # -- helpers -------------------------------------------------------------------------------------
    def model(self) -> torch.nn.Module:
        """The model, loaded on first use (with its tokenizer)."""
        if self._model is None:
            self._model, self._tokenizer = load_model(self.plan.model_folder, self.cfg.model.dtype, self.device,
                                                      loop_steps=self.cfg.model.loop_steps)
        return self._model

    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded on first use."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.plan.model_folder)
        return self._tokenizer

    def _progress(self, total: int, desc: str) -> tqdm:
        return tqdm(total=total, desc=desc, disable=not self.dist.is_main, dynamic_ncols=True)

    def _stage(self, name: str, body: Callable[[Path], dict | None], distributed: bool = True,
               *, reusable: bool = True, resumable: bool = False, fp: str | None = None) -> Path:
        """Reuse stage ``name`` when its fingerprint matches the run directory's, else run ``body(folder)``
        (on every process when ``distributed``, else on the main one) and record what it returns; returns
        the stage's folder."""
        fp = fp or self.plan.fingerprints[name]
        if reusable and self.run.reusable(name, fp):
            self.run.mark_reused(name, fp)
        else:
            with self.run.stage(name, fp, resumable) as (tmp, rec):
                if distributed or self.dist.is_main:
                    rec.details = body(tmp) or {}
        return self.run.path(name)

    # -- stages --------------------------------------------------------------------------------------
    @_names_failure("data")
    def stage_data(self) -> CalibrationSet:
        """The calibration set: the plan's (built by the checks), else built now, unless the stage is reused."""
        def body(tmp: Path) -> dict:
            calib = self.plan.calibration or build_calibration_set(self.cfg.data, self.tokenizer())
            return save_calibration(calib, tmp)

        return load_calibration(self._stage("data", body, distributed=False))

    @_names_failure("capture")
    def stage_capture(self, calib: CalibrationSet) -> CaptureData:
        """An in-memory capture is never kept; a disk capture resumes after the sequences an interrupted run wrote."""
        store, kv = self.plan.store, self.plan.kv
        if self.dist.is_main:
            log.info(store.reason)
        in_memory, reader = store.store != "disk", None

        def body(tmp: Path) -> dict:
            nonlocal reader
            loading = time.time()
            model = self.model()  # loaded here, on first use: its time is reported apart
            loading = time.time() - loading
            bar = self._progress(calib.input_ids.shape[0], "capture")
            reader = run_capture(model, calib, kv, cfg=self.cfg, store=store, folder=tmp, dist=self.dist,
                                 progress=lambda n: bar.update(n * self.dist.world))
            bar.close()
            return {"sequences": int(calib.input_ids.shape[0]), "sites": kv.num_sites, "store": store.store,
                    "store_reason": store.reason, "model_load_s": round(loading, 2)}

        folder = self._stage("capture", body, reusable=not in_memory, resumable=not in_memory,
                             fp=fingerprint(self.plan.fingerprints["capture"], store.store))
        return reader if in_memory else CaptureReader(folder)

    @_names_failure("tasq")
    def stage_tasq(self, reader: CaptureData | None) -> TasqResult | None:
        """TaSQ's transforms and groups (the stage's files read back; None on processes without them)."""
        def body(tmp: Path) -> dict:
            self.warmup.wait("linalg")
            result = run_tasq(reader, self.plan.kv, self.cfg, folder=tmp, dist=self.dist,
                              device=self.plan.kmeans_device)
            return {"blocks": len(result.transforms), "processes": self.dist.world} if result is not None else {}

        return TasqResult.load(self._stage("tasq", body))

    @_names_failure("kmeans")
    def stage_kmeans(self, reader: CaptureData | None, tasq: TasqResult | None) -> KVQuantizer:
        """The codebooks: the main process keeps those it saved when the stage ran (as the files read them
        back); a reused stage, and the other processes, read the files."""
        fitted = None

        def body(tmp: Path) -> dict:
            nonlocal fitted
            layouts = len(tasq.layouts if tasq is not None else plan_layouts(self.plan.kv, self.cfg.quant))
            self.warmup.wait("kmeans_backend")
            bar = self._progress(layouts, "kmeans")
            report = run_kmeans(reader, tasq, self.plan.kv, cfg=self.cfg, folder=tmp, dist=self.dist,
                                device=self.plan.kmeans_device, progress=lambda n: bar.update(n * self.dist.world))
            bar.close()
            fitted = as_saved_quantizer(report.quantizer) if report is not None else None  # main process only
            return {"codebooks": layouts, "processes": self.dist.world}

        folder = self._stage("kmeans", body)
        return fitted if fitted is not None else load_quantizer(folder)

    @_names_failure("finetune")
    def stage_finetune(self, calib: CalibrationSet, init: KVQuantizer) -> FinetuneResult:
        """The kept codebooks: as :meth:`stage_kmeans`, the main process keeps what it saved."""
        tuned = None

        def body(tmp: Path) -> dict:
            nonlocal tuned
            self.warmup.wait("codec_kernels")
            bar = self._progress(training_steps(self.cfg.finetune, len(calib.train)), "finetune")
            result = run_finetune(self.model(), calib, init, cfg=self.cfg, folder=tmp, dist=self.dist,
                                  device=self.device, progress=bar.update)
            bar.close()
            tuned = as_saved_finetune(result) if self.dist.is_main else None  # the process that saved it
            return {"best_epoch": result.best_epoch, "best_step": result.best_step}

        folder = self._stage("finetune", body, resumable=True)
        return tuned if tuned is not None else load_finetune(folder)

    @_names_failure("bundle")
    def stage_bundle(self, calib: CalibrationSet, tuned: FinetuneResult) -> Path:
        """The bundle's folder (written by the main process)."""
        def body(tmp: Path) -> dict:
            return run_bundle(tmp, tuned, calib, identity=self.plan.identity, cfg=self.cfg, version=__version__)

        return self._stage("bundle", body, distributed=False)

    # -- driver --------------------------------------------------------------------------------------
    def codebooks(self, calib: CalibrationSet) -> KVQuantizer | None:
        """capture -> [tasq] -> [kmeans]; an in-memory capture is released before this returns (its host
        memory in a background thread, :meth:`~loopvq_calib.calibration.capture.kv.MemoryCapture.release`)."""
        in_memory = self.plan.store.store != "disk"  # an in-memory capture is never kept: skip it when nothing reads it
        if in_memory and "kmeans" in self.wanted and self._codebooks_reusable():
            log.info("stage capture: not needed (the stages after it are reused)")
            reader = None
        else:
            reader = self.stage_capture(calib)
        tasq = self.stage_tasq(reader) if "tasq" in self.wanted else None
        quantizer = self.stage_kmeans(reader, tasq) if "kmeans" in self.wanted else None
        if isinstance(reader, MemoryReader):  # host memory in the background, while fine-tuning starts
            reader.capture.release()
        return quantizer

    def _codebooks_reusable(self) -> bool:
        """Whether tasq (TaSQ methods) and kmeans would both be reused from the run directory."""
        fingerprints = self.plan.fingerprints
        if "tasq" in self.wanted and not self.run.reusable("tasq", fingerprints["tasq"]):
            return False
        return self.run.reusable("kmeans", fingerprints["kmeans"])

    def run_all(self) -> RunResult:
        """Open the run directory (lock held until this returns) and run or reuse the wanted stages."""
        self.failed_stage = None
        self.run.open()
        try:
            return self._run_stages()
        finally:
            self.warmup.close()
            self.run.close()

    def _run_stages(self) -> RunResult:
        if self.dist.is_main:
            setup_logging(self.run.root)
            if self.run.lock is not None and self.run.lock.previous:
                log.warning("%s: took over the lock of a run that is no longer running (%s)", self.run.root,
                            self.run.lock.previous)
            if (sized := gpu_sized(self.cfg, self.plan.device)) is not None:
                log.warning(sized)
            write_bytes_atomic(self.run.root / CONFIG_FILE, dump_config(self.cfg).encode())
            self.run.update(toolkit_version=__version__, config=self.cfg.to_dict(),
                            model_identity=self.plan.identity.to_dict(), processes=self.dist.world,
                            startup=self.startup)
        result = RunResult(self.run.root, None, is_main=self.dist.is_main)
        calib = self.stage_data()
        self.run.update(data_sha256=calib.content_hash, calibration=calib.description)
        quantizer = self.codebooks(calib) if "capture" in self.wanted else None
        tuned = None
        if "finetune" in self.wanted:
            tuned = self.stage_finetune(calib, quantizer)
            result.metrics = selection_metrics(tuned)
        if "bundle" in self.wanted:
            result.bundle = self.stage_bundle(calib, tuned)
        result.stages = [asdict(r) for r in self.run.records]
        if self.dist.is_main:
            self.run.update(finetune_curve=tuned.curve if tuned else None, stages_done_at=time.time(),
                            warmup=self.warmup.report())
            log.info("stage summary\n%s", self.run.summary_table())
        return result


def setup_logging(root: Path, verbose: bool = True) -> None:
    """Log to ``run.log`` in the run directory and to stderr."""
    log.setLevel(logging.INFO)
    for h in list(log.handlers):
        log.removeHandler(h)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    fh = logging.FileHandler(root / LOG_FILE)
    fh.setFormatter(fmt)
    log.addHandler(fh)
    if verbose:
        sh = logging.StreamHandler()
        sh.setFormatter(fmt)
        log.addHandler(sh)
    log.propagate = False


def calibrate(config: Config | str | Path | dict, output: str | Path | None = None,
              stages: list[str] | None = None, *, overrides: list[str] | None = None) -> RunResult:
    """Python API of ``loopvq-calibrate``: run (or resume) a calibration and return the run's result; bad input
    raises before anything is written (:func:`~loopvq_calib.calibration.preflight.plan_run`)."""
    cfg = config if isinstance(config, Config) else load_config(config, overrides)  # Pipeline resolves and checks it
    return Pipeline(cfg, output, stages).run_all()
