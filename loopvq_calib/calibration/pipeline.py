"""The order of the stages (data -> capture -> tasq (TaSQ methods) -> kmeans -> finetune -> bundle), their
fingerprints, their reuse and the run directory; the stages themselves are plain functions (``stages.py``).

Each stage's fingerprint covers its own config, the toolkit version and its inputs' fingerprints, so a
change invalidates that stage and every later one; an unchanged stage is reused from the run directory.
Under ``accelerate launch`` capture, TaSQ, k-means and fine-tuning are shared across processes (one
:class:`~loopvq_calib.runtime.processes.DistContext` per run); data and bundle run on the main process.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tqdm.auto import tqdm

from ..version import __version__
from ..codes.layouts import plan_layouts
from ..codes.quantizer import KVQuantizer
from ..config.load import dump_config, resolve_derived
from ..config.schema import Config
from ..config.validate import validate, validate_for_model
from ..data.corpus import CalibrationSet, build_calibration_set, source_fingerprint
from ..kernels import lookup as lookup_triton, nearest as nearest_triton
from ..models.loading import (
    TORCH_DTYPES,
    load_model,
    model_identity,
    pick_device,
    read_model_config,
    resolve_model_dir,
    set_loop_steps,
)
from ..models.sites import KVLayout
from ..runtime.clock import seconds_since_process_start
from ..runtime.processes import DistContext, start_processes
from ..runtime.warmup import Warmup, warm_linalg
from .capture.kv import CaptureData, CaptureReader, MemoryReader
from .capture.store import capture_step_bytes, choose_store
from .finetune.train import FinetuneResult, training_steps
from .fingerprints import fingerprint, stage_fingerprints
from .kmeans.fit import run_points_per_codebook
from .kmeans.select import resolve_backend
from .rundir import RunDir, setup_logging
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

log = logging.getLogger("loopvq_calib")
STAGES = ("data", "capture", "tasq", "kmeans", "finetune", "bundle")


@dataclass
class RunResult:
    run_dir: Path
    bundle: Path | None
    stages: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    is_main: bool = True  # the run's main process (under accelerate launch every process gets a result)


def model_shape(model_config: Any, loop_steps: int | None, dtype: str) -> tuple[KVLayout, int]:
    """The KV sites and the weights' bytes in ``dtype`` of a model built on the meta device (no weights read)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    set_loop_steps(model, loop_steps)
    return model.kv_layout(), sum(p.numel() for p in model.parameters()) * TORCH_DTYPES[dtype].itemsize


class Pipeline:
    """One calibration run; :meth:`run_all` executes (or reuses) the stages up to the last one asked for."""

    def __init__(self, cfg: Config, output: str | Path | None = None, stages: list[str] | None = None,
                 *, dist: DistContext | None = None, warmup: Warmup | None = None) -> None:
        """Every check that can fail on bad input runs here, before anything is written: the config against
        the model's config.json, ``stages``, devices, the k-means backend, the store, the output folder and
        (unless the run directory holds a reusable data stage) the calibration data itself, built once, by
        the main process. ``dist``: the run's processes (default: this process under ``accelerate launch``).
        ``warmup``: the background warm-up to add the stages' jobs to (``loopvq-calibrate`` starts one before its
        imports; default: a new one). ``startup`` records the seconds of each step (and those from the process's
        start to here)."""
        entered = time.perf_counter()
        self.startup: dict[str, float] = {"entered_at": time.time(), "process_start_s": seconds_since_process_start()}
        # on a copy (the caller's cfg never changes): a Config built in code gets its derived values and checks
        cfg = self.cfg = validate(resolve_derived(copy.deepcopy(cfg)))
        with timed(self.startup, "processes_s"):  # CUDA and, under accelerate launch, the process group
            self.dist = dist or start_processes(cfg.model.device)
        self.wanted = _wanted_stages(cfg, stages)
        with timed(self.startup, "model_shape_s"):  # config.json and the model built on the meta device
            self.folder = resolve_model_dir(cfg.model.name_or_path, cfg.model.revision)
            model_config = read_model_config(self.folder)
            self.kv, model_bytes = model_shape(model_config, cfg.model.loop_steps, cfg.model.dtype)
        validate_for_model(cfg, self.kv.head_dim, self.kv.kv_heads, loop_steps=self.kv.loop_steps,
                           has_prelude=any(not s.looped for s in self.kv.sites))
        local = Path(cfg.model.name_or_path).expanduser().is_dir()  # else a hub id
        name = os.path.abspath(Path(cfg.model.name_or_path).expanduser()) if local else cfg.model.name_or_path
        with timed(self.startup, "model_identity_s"):
            self.identity = model_identity(self.folder, name, cfg.model.revision)
        self.device = pick_device(cfg.model.device) if cfg.model.device != "auto" else self.dist.device
        self.kmeans_device = pick_device(cfg.kmeans.device, "kmeans.device") if cfg.kmeans.device != "auto" else self.device
        self.warmup = warmup or Warmup()  # first-use costs of the device, in the background; stages wait for theirs
        if "tasq" in self.wanted and cfg.quant.uses_tasq and self.kmeans_device.type == "cuda":  # jobs in stage order
            self.warmup.submit("linalg", self.kmeans_device, warm_linalg, self.kmeans_device)
        with timed(self.startup, "kmeans_backend_s"):  # an unusable kmeans.backend fails here, before any work;
            if "kmeans" in self.wanted:  # auto's probe compiles the kernels for the run's problems (kept for the stage)
                points = run_points_per_codebook(plan_layouts(self.kv, cfg.quant), cfg.data.num_sequences,
                                                 cfg.data.sequence_length, sink_tokens=cfg.data.sink_tokens,
                                                 sharing=cfg.quant.codebook_sharing)
                backend = (cfg.kmeans.backend, self.kmeans_device, (cfg.quant.codebook_size, cfg.quant.group_size))
                if cfg.kmeans.backend == "auto" and self.kmeans_device.type == "cuda":  # a failed probe falls back
                    self.warmup.submit("kmeans_backend", self.kmeans_device, resolve_backend, *backend, points=points)
                else:
                    resolve_backend(*backend, points=points)
        if "finetune" in self.wanted and self.device.type == "cuda":
            self.warmup.submit("codec_kernels", self.device, warm_codec_kernels, self.device, cfg.quant.codebook_size,
                               cfg.quant.group_size)
        self.run = RunDir(Path(output or cfg.output.dir), self.dist.is_main, self.dist.barrier, stage_names=STAGES)
        self.store = None  # where the capture goes: decided (or refused, ConfigError) before any work
        if "capture" in self.wanted:
            step = capture_step_bytes(self.kv, model_config.hidden_size, cfg.data.sequence_length, batch_size=cfg.capture.batch_size)
            self.store = choose_store(cfg.capture, self.kv, cfg.data.num_sequences, sequence_length=cfg.data.sequence_length,
                                      device=self.device, model_bytes=model_bytes, step_bytes=step, capture_dir=self.run.root, processes=self.dist.world,
                                      tasq_keys=cfg.quant.uses_tasq)
        self._model = self._tokenizer = None
        with timed(self.startup, "data_fingerprint_s"):
            data_fp = fingerprint("data", __version__, asdict(cfg.data), _tokenizer_hash(self.folder),
                                  source_fingerprint(cfg.data))
        self.fingerprints = stage_fingerprints(cfg, data_fp, self.identity.to_dict(), loop_steps=self.kv.loop_steps)
        building = self.dist.is_main and not self.run.reusable("data", data_fp)
        with timed(self.startup, "calibration_set_s"):  # tokenizer, text, tokens: checked before any work
            self._calib = build_calibration_set(cfg.data, self.tokenizer()) if building else None
        self.startup["pipeline_init_s"] = round(time.perf_counter() - entered, 3)

    # -- helpers -------------------------------------------------------------------------------------
    def model(self):
        if self._model is None:
            self._model, self._tokenizer = load_model(self.folder, self.cfg.model.dtype, self.device, loop_steps=self.cfg.model.loop_steps)
        return self._model

    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.folder)
        return self._tokenizer

    def _progress(self, total: int, desc: str) -> tqdm:
        return tqdm(total=total, desc=desc, disable=not self.dist.is_main, dynamic_ncols=True)

    def _stage(self, name: str, body: Callable[[Path], dict | None], distributed: bool = True,
               *, reusable: bool = True, resumable: bool = False, fp: str | None = None) -> Path:
        """Reuse stage ``name`` when its fingerprint matches the run directory's, else run ``body(folder)``
        (on every process when ``distributed``, else on the main one) and record what it returns; returns
        the stage's folder."""
        fp = fp or self.fingerprints[name]
        if reusable and self.run.reusable(name, fp):
            self.run.mark_reused(name, fp)
        else:
            with self.run.stage(name, fp, resumable) as (tmp, rec):
                if distributed or self.dist.is_main:
                    rec.details = body(tmp) or {}
        return self.run.path(name)

    # -- stages --------------------------------------------------------------------------------------
    def stage_data(self) -> CalibrationSet:
        def body(tmp: Path) -> dict:
            return save_calibration(self._calib or build_calibration_set(self.cfg.data, self.tokenizer()), tmp)

        return load_calibration(self._stage("data", body, distributed=False))

    def stage_capture(self, calib: CalibrationSet) -> CaptureData:
        """An in-memory capture is never kept; a disk capture resumes after the sequences an interrupted run wrote."""
        if self.dist.is_main:
            log.info(self.store.reason)
        in_memory, reader = self.store.store != "disk", None

        def body(tmp: Path) -> dict:
            nonlocal reader
            loading = time.time()
            model = self.model()  # loaded here, on first use: its time is reported apart
            loading = time.time() - loading
            bar = self._progress(calib.input_ids.shape[0], "capture")
            reader = run_capture(model, calib, self.kv, cfg=self.cfg, store=self.store, folder=tmp, dist=self.dist,
                                 progress=lambda n: bar.update(n * self.dist.world))
            bar.close()
            return {"sequences": int(calib.input_ids.shape[0]), "sites": self.kv.num_sites, "store": self.store.store,
                    "store_reason": self.store.reason, "model_load_s": round(loading, 2)}

        folder = self._stage("capture", body, reusable=not in_memory, resumable=not in_memory,
                             fp=fingerprint(self.fingerprints["capture"], self.store.store))
        return reader if in_memory else CaptureReader(folder)

    def stage_tasq(self, reader: CaptureData | None):
        from .tasq.grouping import TasqResult

        def body(tmp: Path) -> dict:
            self.warmup.wait("linalg")
            result = run_tasq(reader, self.kv, self.cfg, folder=tmp, dist=self.dist, device=self.kmeans_device)
            return {"blocks": len(result.transforms), "processes": self.dist.world} if result is not None else {}

        return TasqResult.load(self._stage("tasq", body))

    def stage_kmeans(self, reader: CaptureData | None, tasq: Any) -> KVQuantizer:
        """The codebooks: the main process keeps those it saved when the stage ran (as the files read them
        back); a reused stage, and the other processes, read the files."""
        fitted = None

        def body(tmp: Path) -> dict:
            nonlocal fitted
            layouts = len(tasq.layouts if tasq is not None else plan_layouts(self.kv, self.cfg.quant))
            self.warmup.wait("kmeans_backend")
            bar = self._progress(layouts, "kmeans")
            report = run_kmeans(reader, tasq, self.kv, cfg=self.cfg, folder=tmp, dist=self.dist, device=self.kmeans_device,
                                progress=lambda n: bar.update(n * self.dist.world))
            bar.close()
            fitted = as_saved_quantizer(report.quantizer) if report is not None else None  # main process only
            return {"codebooks": layouts, "processes": self.dist.world}

        folder = self._stage("kmeans", body)
        return fitted if fitted is not None else load_quantizer(folder)

    def stage_finetune(self, calib: CalibrationSet, init: KVQuantizer) -> FinetuneResult:
        """The kept codebooks: as :meth:`stage_kmeans`, the main process keeps what it saved."""
        tuned = None

        def body(tmp: Path) -> dict:
            nonlocal tuned
            self.warmup.wait("codec_kernels")
            bar = self._progress(training_steps(self.cfg.finetune, len(calib.train)), "finetune")
            result = run_finetune(self.model(), calib, init, cfg=self.cfg, folder=tmp, dist=self.dist, device=self.device, progress=bar.update)
            bar.close()
            tuned = as_saved_finetune(result) if self.dist.is_main else None  # the process that saved it
            return {"best_epoch": result.best_epoch, "best_step": result.best_step}

        folder = self._stage("finetune", body, resumable=True)
        return tuned if tuned is not None else load_finetune(folder)

    def stage_bundle(self, calib: CalibrationSet, tuned: FinetuneResult) -> Path:
        return self._stage("bundle", lambda tmp: run_bundle(tmp, tuned, calib, identity=self.identity, cfg=self.cfg, version=__version__),
                           distributed=False)

    # -- driver --------------------------------------------------------------------------------------
    def codebooks(self, calib: CalibrationSet) -> KVQuantizer | None:
        """capture -> [tasq] -> [kmeans]; an in-memory capture is released before this returns (its host
        memory in a background thread, :meth:`~loopvq_calib.calibration.capture.kv.MemoryCapture.release`)."""
        in_memory = self.store.store != "disk"  # an in-memory capture is never kept: skip it when nothing reads it
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
        tasq = self.fingerprints["tasq"]
        if "tasq" in self.wanted and not self.run.reusable("tasq", tasq):
            return False
        return self.run.reusable("kmeans", self.fingerprints["kmeans"])

    def run_all(self) -> RunResult:
        """Open the run directory (lock held until this returns) and run or reuse the wanted stages."""
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
            (self.run.root / "config.yaml").write_text(dump_config(self.cfg))
            self.run.update(toolkit_version=__version__, config=self.cfg.to_dict(), model_identity=self.identity.to_dict(),
                            processes=self.dist.world, startup=self.startup)
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


def warm_codec_kernels(device: torch.device, k: int, g: int) -> None:
    """Compile and check the fused nearest-codeword (codebooks of ``k`` x ``g``) and codeword-lookup kernels on
    ``device`` where they apply: their once-per-process probes, kept under the device's name as a tensor on it
    reports it (``cuda:0``), which is what the fine-tuning's first encode and decode then find."""
    if not nearest_triton.available(device):
        return
    name = str(torch.empty(0, device=device).device)
    if nearest_triton.supports(k, g):
        nearest_triton.works(name, k, g)
    lookup_triton.works(name)


@contextmanager
def timed(into: dict[str, float], key: str) -> Iterator[None]:
    """Record the seconds the block takes as ``into[key]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        into[key] = round(time.perf_counter() - start, 3)


def _wanted_stages(cfg: Config, stages: list[str] | None) -> list[str]:
    """The stages to run or reuse: all, or up to the last one of ``stages`` (``--stages``)."""
    wanted = [s for s in STAGES if s != "tasq" or cfg.quant.uses_tasq]
    if not stages:
        return wanted
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        raise ValueError(f"--stages: unknown stage(s) {', '.join(map(repr, unknown))}; stages are {', '.join(STAGES)}")
    if "tasq" in stages and not cfg.quant.uses_tasq:
        raise ValueError(f"--stages: the tasq stage exists only for quant.method tasq or tasq+loopvq, "
                         f"not {cfg.quant.method}")
    return wanted[: max(wanted.index(s) for s in stages if s in wanted) + 1]


def _tokenizer_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for name in sorted(p.name for p in folder.glob("tokenizer*")) + sorted(p.name for p in folder.glob("*.txt")):
        h.update(name.encode() + (folder / name).read_bytes())
    return h.hexdigest()


def calibrate(config: Config | str | Path | dict, output: str | Path | None = None,
              stages: list[str] | None = None, *, overrides: list[str] | None = None) -> RunResult:
    """Python API of ``loopvq-calibrate``: run (or resume) a calibration and return the run's result."""
    from ..config.load import load_config

    cfg = config if isinstance(config, Config) else load_config(config, overrides)  # Pipeline resolves and checks it
    return Pipeline(cfg, output, stages).run_all()
