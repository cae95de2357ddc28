"""Wires the stages: data -> capture -> tasq (TaSQ methods) -> kmeans -> finetune -> bundle.

Each stage's fingerprint covers its own config, the toolkit version and its inputs' fingerprints, so a
change invalidates that stage and every later one; an unchanged stage is reused from the run directory.
Under ``accelerate launch`` capture and fine-tuning are shared across processes; the other stages run on
the main process while the rest wait.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from . import __version__
from .capture import (
    CaptureData, CaptureReader, MemoryCapture, MemoryReader, capture_kv, capture_meta, share_sequences, write_meta,
)
from .capture_store import capture_step_bytes, choose_store
from .config import Config, dump_config, validate, validate_for_model
from .data import CalibrationSet, build_calibration_set, source_fingerprint
from .finetune import finetune_codebooks, training_steps
from .kmeans import fit_codebooks, shard_tensor_names
from .kmeans_backends import resolve_backend
from .layouts import plan_layouts
from .models.loading import DTYPES, load_model, model_identity, pick_device, read_model_config, resolve_model_dir, set_loop_steps
from .models.sites import KVLayout
from .quantizer import KVQuantizer, load_quantizer, merge_quantizers, save_quantizer
from .rundir import RunDir, fingerprint, setup_logging

log = logging.getLogger("loopvq_calib")
STAGES = ("data", "capture", "tasq", "kmeans", "finetune", "bundle")


@dataclass
class RunResult:
    run_dir: Path
    bundle: Path | None
    stages: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)


def _distributed_state(device: str):
    """accelerate's process state; CPU processes (no CUDA, or model.device cpu) talk over gloo."""
    from accelerate import PartialState

    return PartialState(cpu=device == "cpu" or not torch.cuda.is_available())


def capture_for_processes(
    model: torch.nn.Module, calib: CalibrationSet, kv: KVLayout, cfg: Config, out: MemoryCapture | Path, rank: int,
    world: int, barrier: Callable[[], Any], progress: Callable[[int], Any] | None = None,
    device_sequences: int | None = None,
) -> None:
    """Capture process ``rank``'s sequences into ``out``; an in-memory capture under several processes then
    gives each process its TaSQ and k-means layouts of every sequence (``share_sequences``) and its meta
    (the main process sets it in ``write_meta``)."""
    capture_kv(model, calib, kv, cfg.capture, out, rank, world, progress,
               tasq_floor=cfg.tasq.weight_floor if cfg.quant.uses_tasq else None, device_sequences=device_sequences)
    barrier()
    if isinstance(out, MemoryCapture) and world > 1:
        names = shard_tensor_names(plan_layouts(kv, cfg.quant), world, cfg.quant.uses_tasq)
        share_sequences(out, names, rank, world, calib.input_ids.shape[0])
        if rank != 0:
            capture_meta(calib, kv, cfg.capture, out, cfg.quant.uses_tasq)


def model_shape(model_config: Any, loop_steps: int | None, dtype: str) -> tuple[KVLayout, int]:
    """The KV sites and the weights' bytes in ``dtype`` of a model built on the meta device (no weights read)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    set_loop_steps(model, loop_steps)
    return model.kv_layout(), sum(p.numel() for p in model.parameters()) * DTYPES[dtype].itemsize


class Pipeline:
    """One calibration run; :meth:`run` executes (or reuses) the stages up to the last one asked for."""

    def __init__(self, cfg: Config, output: str | Path | None = None, stages: list[str] | None = None) -> None:
        """Every check that can fail on bad input runs here, before anything is written: the config against
        the model's config.json, ``stages``, devices, the k-means backend, the output folder and (unless the
        run directory holds a reusable data stage) the calibration data itself."""
        self.cfg = validate(cfg)  # pure (never changes cfg); a Config built in code gets the same checks
        self.state = _distributed_state(cfg.model.device)
        self.wanted = _wanted_stages(cfg, stages)
        self.folder = resolve_model_dir(cfg.model.name_or_path, cfg.model.revision)
        model_config = read_model_config(self.folder)
        self.kv, self.model_bytes = model_shape(model_config, cfg.model.loop_steps, cfg.model.dtype)
        validate_for_model(cfg, self.kv.head_dim, self.kv.kv_heads, self.kv.loop_steps,
                           any(not s.looped for s in self.kv.sites))
        local = Path(cfg.model.name_or_path).expanduser().is_dir()  # else a hub id
        name = os.path.abspath(Path(cfg.model.name_or_path).expanduser()) if local else cfg.model.name_or_path
        self.identity = model_identity(self.folder, name, cfg.model.revision)
        self.device = pick_device(cfg.model.device) if cfg.model.device != "auto" else self.state.device
        self.kmeans_device = pick_device(cfg.kmeans.device, "kmeans.device") if cfg.kmeans.device != "auto" else self.device
        if "kmeans" in self.wanted:  # an unusable kmeans.backend fails here, before any work
            resolve_backend(cfg.kmeans.backend, self.kmeans_device, (cfg.quant.codebook_size, cfg.quant.group_size))
        self.run = RunDir(Path(output or cfg.output.dir), self.state.is_main_process, self.state.wait_for_everyone,
                          stage_names=STAGES)
        self.store = None  # where the capture goes: decided (or refused, ConfigError) before any work
        if "capture" in self.wanted:
            step = capture_step_bytes(self.kv, model_config.hidden_size, cfg.data.sequence_length, cfg.capture.batch_size)
            self.store = choose_store(cfg.capture, self.kv, cfg.data.num_sequences, cfg.data.sequence_length,
                                      self.device, self.model_bytes, step, self.run.root, self.state.num_processes,
                                      cfg.quant.uses_tasq)
        self._model = self._tokenizer = None
        self.fp: dict[str, str] = {}
        self.data_fp = fingerprint("data", __version__, asdict(cfg.data), _tokenizer_hash(self.folder),
                                   source_fingerprint(cfg.data))
        self._calib = None if self.run.reusable("data", self.data_fp) else build_calibration_set(cfg.data, self.tokenizer())

    # -- helpers -------------------------------------------------------------------------------------
    def model(self):
        if self._model is None:
            self._model, self._tokenizer = load_model(self.folder, self.cfg.model.dtype, self.device, self.cfg.model.loop_steps)
        return self._model

    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.folder)
        return self._tokenizer

    def _progress(self, total: int, desc: str):
        return tqdm(total=total, desc=desc, disable=not self.state.is_main_process, dynamic_ncols=True)

    def _reuse_or_run(self, name: str, fp: str, body, distributed: bool = False, reusable: bool = True,
                      resumable: bool = False) -> None:
        self.fp[name] = fp
        if reusable and self.run.reusable(name, fp):
            self.run.mark_reused(name, fp)
            return
        with self.run.stage(name, fp, resumable) as (tmp, rec):
            if distributed or self.state.is_main_process:
                rec.details = body(tmp) or {}

    def _join_parts(self, tmp: Path, save: Callable[[Path], Any], load: Callable[[Path], Any]) -> list | None:
        """Each process saves its share of a stage under ``tmp/part{rank}``; the main process gets every
        part, in rank order (their folders are then removed), the others None."""
        rank, world = self.state.process_index, self.state.num_processes
        save(_mkdir(tmp / f"part{rank}"))
        self.state.wait_for_everyone()
        if not self.state.is_main_process:
            return None
        parts = [load(tmp / f"part{r}") for r in range(world)]
        for r in range(world):
            shutil.rmtree(tmp / f"part{r}")
        return parts

    # -- stages --------------------------------------------------------------------------------------
    def stage_data(self) -> CalibrationSet:
        fp = self.data_fp

        def body(tmp: Path) -> dict:
            calib = self._calib or build_calibration_set(self.cfg.data, self.tokenizer())
            save_file({"input_ids": calib.input_ids}, str(tmp / "sequences.safetensors"))
            split = {"train": calib.train, "heldout": calib.heldout, "sink_tokens": calib.sink_tokens,
                     "description": calib.description, "content_sha256": calib.content_hash}
            (tmp / "split.json").write_text(json.dumps(split, indent=1))
            return {"content_sha256": calib.content_hash, "tokens": calib.input_ids.numel()}

        self._reuse_or_run("data", fp, body)
        split = json.loads((self.run.path("data") / "split.json").read_text())
        ids = load_file(str(self.run.path("data") / "sequences.safetensors"))["input_ids"]
        self.data_hash = split["content_sha256"]
        return CalibrationSet(ids, split["train"], split["heldout"], split["sink_tokens"], split["description"])

    def capture_fingerprint(self) -> str:
        """What the capture holds (not where: the store is left out), which the later stages' fingerprints
        build on, so that they are reused whichever store held the capture."""
        c = self.cfg
        content = {k: v for k, v in asdict(c.capture).items() if k != "store"}
        return fingerprint("capture", __version__, self.fp["data"], self.identity.to_dict(), c.model.dtype,
                           self.kv.loop_steps, content,
                           c.tasq.weight_floor if c.quant.uses_tasq else None)  # TaSQ keys' Fisher is stored weighted

    def stage_capture(self, calib: CalibrationSet) -> CaptureData:
        c = replace(self.cfg, capture=replace(self.cfg.capture, store=self.store.store))
        if self.state.is_main_process:
            log.info(self.store.reason)
        memory = MemoryCapture() if c.capture.store in ("memory", "device", "split") else None
        rank, world = self.state.process_index, self.state.num_processes
        content = self.fp["capture"]  # set by codebooks()
        fp = fingerprint(content, c.capture.store)

        def body(tmp: Path) -> dict:
            loading = time.time()
            model = self.model()  # loaded here, on first use: its time is reported apart
            loading = time.time() - loading
            bar = self._progress(calib.input_ids.shape[0], "capture")
            capture_for_processes(model, calib, self.kv, c, memory or tmp, rank, world,
                                  self.state.wait_for_everyone, lambda n: bar.update(n * world),
                                  self.store.device_sequences)
            bar.close()
            if self.state.is_main_process:
                write_meta(tmp, calib, self.kv, c.capture, memory, c.quant.uses_tasq)
            return {"sequences": int(calib.input_ids.shape[0]), "sites": self.kv.num_sites, "store": c.capture.store,
                    "store_reason": self.store.reason, "model_load_s": round(loading, 2)}

        # an in-memory capture is never kept; a disk capture resumes after the sequences an interrupted run wrote
        self._reuse_or_run("capture", fp, body, distributed=True, reusable=memory is None, resumable=memory is None)
        self.fp["capture"] = content
        return MemoryReader(memory) if memory is not None else CaptureReader(self.run.path("capture"))

    def stage_tasq(self, reader: CaptureData):
        """Processes share the key layouts as k-means does (each fits the ones it will cluster); main joins."""
        from .tasq import TasqResult, fit_tasq, merge_tasq

        c = self.cfg
        fp = self._tasq_fingerprint()
        rank, world = self.state.process_index, self.state.num_processes

        def body(tmp: Path) -> dict:
            part = fit_tasq(reader, plan_layouts(self.kv, c.quant), self.kv, c.quant, c.tasq, shard=(rank, world),
                            device=self.kmeans_device)
            parts = self._join_parts(tmp, part.save, TasqResult.load)
            if parts is not None:
                result = merge_tasq(parts)
                result.save(tmp)
                return {"blocks": len(result.transforms), "processes": world}
            return {}

        self._reuse_or_run("tasq", fp, body, distributed=True)
        return TasqResult.load(self.run.path("tasq"))

    def stage_kmeans(self, reader: CaptureData, tasq: Any) -> KVQuantizer:
        """Processes share the layouts (disk capture: every process reads every sequence; in-memory capture:
        each process holds its layouts of every sequence, see ``share_sequences``); main merges."""
        c = self.cfg
        fp = self._kmeans_fingerprint(self.fp.get("tasq"))
        rank, world = self.state.process_index, self.state.num_processes

        def body(tmp: Path) -> dict:
            layouts = tasq.layouts if tasq is not None else plan_layouts(self.kv, c.quant)
            transforms = tasq.transforms if tasq is not None else {}
            bar = self._progress(len(layouts), "kmeans")
            part, report = fit_codebooks(reader, layouts, transforms, c.quant, c.kmeans, self.kv, self.kmeans_device,
                                         lambda n: bar.update(n * world), shard=(rank, world))
            bar.close()
            parts = self._join_parts(
                tmp, lambda d: save_quantizer(part, d, {"report": report}),
                lambda d: (load_quantizer(d), json.loads((d / "quantizer.json").read_text())["report"]),
            )
            if parts is not None:
                save_quantizer(merge_quantizers([q for q, _ in parts], [lay.key for lay in layouts]), tmp)
                merged = {"layouts": {k: v for _, r in parts for k, v in r["layouts"].items()},
                          "totals": [r["totals"] for _, r in parts]}
                (tmp / "report.json").write_text(json.dumps(merged, indent=1, default=float))
            return {"codebooks": len(layouts), "processes": world}

        self._reuse_or_run("kmeans", fp, body, distributed=True)
        return load_quantizer(self.run.path("kmeans"))

    def stage_finetune(self, calib: CalibrationSet, init: KVQuantizer) -> tuple[KVQuantizer, dict]:
        c = self.cfg
        fp = fingerprint("finetune", __version__, self.fp["kmeans"], self.fp["data"], self.identity.to_dict(),
                         c.model.dtype, asdict(c.finetune))

        def body(tmp: Path) -> dict:
            bar = self._progress(training_steps(c.finetune, len(calib.train)), "finetune")
            resume = tmp / "resume.pt"  # the state after each epoch: an interrupted run resumes from it
            result = finetune_codebooks(self.model(), calib, init, c.finetune, self.device, bar.update,
                                        checkpoint=resume)
            bar.close()
            if self.state.is_main_process:
                resume.unlink(missing_ok=True)
                save_quantizer(result.quantizer, tmp)
                best = {"best_epoch": result.best_epoch, "best_step": result.best_step, "curve": result.curve}
                (tmp / "curve.json").write_text(json.dumps(best, indent=1))
            return {"best_epoch": result.best_epoch, "best_step": result.best_step}

        self._reuse_or_run("finetune", fp, body, distributed=True, resumable=True)
        curve = json.loads((self.run.path("finetune") / "curve.json").read_text())
        return load_quantizer(self.run.path("finetune")), curve

    def stage_bundle(self, calib: CalibrationSet, quantizer: KVQuantizer, curve: dict) -> Path:
        from .bundle import write_bundle

        c = self.cfg
        fp = fingerprint("bundle", __version__, self.fp["finetune"], asdict(c.output))
        metrics = {**selection_metrics(curve), "finetune_curve": curve["curve"],
                   "selection_sequences": len(calib.heldout), "bits": quantizer.bits()}
        name = c.output.bundle_name or f"{Path(c.model.name_or_path).name}-{c.quant.method}-{c.quant.bits:g}bit"

        def body(tmp: Path) -> dict:
            write_bundle(tmp, quantizer, name=name, identity=self.identity, calibration=calib.description,
                         metrics=metrics, serving=c.output.serving, codebook_dtype=c.output.codebook_dtype,
                         config=c.to_dict(), producer_version=__version__)
            return {"name": name}

        self._reuse_or_run("bundle", fp, body)
        return self.run.path("bundle")

    # -- driver --------------------------------------------------------------------------------------
    def codebooks(self, calib: CalibrationSet) -> KVQuantizer | None:
        """capture -> [tasq] -> [kmeans]; the capture (which may hold host or accelerator memory) is
        released when this returns, before fine-tuning."""
        self.fp["capture"] = self.capture_fingerprint()  # what the later stages' fingerprints build on
        in_memory = self.store.store != "disk"  # an in-memory capture is never kept: skip it when nothing reads it
        if in_memory and "kmeans" in self.wanted and self._codebooks_reusable():
            log.info("stage capture: not needed (the stages after it are reused)")
            reader = None
        else:
            reader = self.stage_capture(calib)
        tasq = self.stage_tasq(reader) if "tasq" in self.wanted else None
        return self.stage_kmeans(reader, tasq) if "kmeans" in self.wanted else None

    def _codebooks_reusable(self) -> bool:
        """Whether tasq (TaSQ methods) and kmeans would both be reused: their fingerprints, computed as the
        stages compute them, match finished stages of the run directory."""
        tasq = self._tasq_fingerprint() if "tasq" in self.wanted else None
        if tasq is not None and not self.run.reusable("tasq", tasq):
            return False
        return self.run.reusable("kmeans", self._kmeans_fingerprint(tasq))

    def _tasq_fingerprint(self) -> str:
        return fingerprint("tasq", __version__, self.fp["capture"], asdict(self.cfg.quant), asdict(self.cfg.tasq))

    def _kmeans_fingerprint(self, tasq_fp: str | None) -> str:
        c = self.cfg
        return fingerprint("kmeans", __version__, self.fp["capture"], tasq_fp, asdict(c.quant), asdict(c.kmeans))

    def run_all(self) -> RunResult:
        """Open the run directory (lock held until this returns) and run or reuse the wanted stages."""
        self.run.open()
        try:
            return self._run_stages()
        finally:
            self.run.close()

    def _run_stages(self) -> RunResult:
        if self.state.is_main_process:
            setup_logging(self.run.root)
            if self.run.lock is not None and self.run.lock.previous:
                log.warning("%s: took over the lock of a run that is no longer running (%s)", self.run.root,
                            self.run.lock.previous)
            (self.run.root / "config.yaml").write_text(dump_config(self.cfg))
            self.run.update(toolkit_version=__version__, config=self.cfg.to_dict(), model_identity=self.identity.to_dict(),
                            processes=self.state.num_processes)
        result = RunResult(self.run.root, None)
        calib = self.stage_data()
        self.run.update(data_sha256=self.data_hash, calibration=calib.description)
        quantizer = self.codebooks(calib) if "capture" in self.wanted else None
        curve = None
        if "finetune" in self.wanted:
            quantizer, curve = self.stage_finetune(calib, quantizer)
            result.metrics = selection_metrics(curve)
        if "bundle" in self.wanted:
            result.bundle = self.stage_bundle(calib, quantizer, curve)
        result.stages = [asdict(r) for r in self.run.records]
        if self.state.is_main_process:
            self.run.update(finetune_curve=curve["curve"] if curve else None)
            log.info("stage summary\n%s", self.run.summary_table())
        return result


def selection_metrics(curve: dict) -> dict[str, Any]:
    """The selection KL (KL on the calibration set's selection sequences, which pick the fine-tuning step;
    not the evaluation KL of ``loopvq-eval``) of the kept codebooks and of the k-means codebooks."""
    best = next(e for e in curve["curve"] if e["step"] == curve["best_step"])
    return {"selection_kl": best["selection_kl"], "selection_kl_init": curve["curve"][0]["selection_kl"],
            "best_epoch": curve["best_epoch"], "best_step": curve["best_step"]}


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


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _tokenizer_hash(folder: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for name in sorted(p.name for p in folder.glob("tokenizer*")) + sorted(p.name for p in folder.glob("*.txt")):
        h.update(name.encode() + (folder / name).read_bytes())
    return h.hexdigest()


def calibrate(config: Config | str | Path | dict, output: str | Path | None = None,
              stages: list[str] | None = None, overrides: list[str] | None = None) -> RunResult:
    """Python API of ``loopvq-calibrate``: run (or resume) a calibration and return the run's result."""
    from .config import load_config, resolve_derived

    if isinstance(config, Config):  # checked like a loaded one (on a copy: the derived values get filled)
        cfg = validate(resolve_derived(copy.deepcopy(config)))
    else:
        cfg = load_config(config, overrides)
    return Pipeline(cfg, output, stages).run_all()
