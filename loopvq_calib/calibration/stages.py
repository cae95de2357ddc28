"""The calibration stages' work as plain functions: typed inputs -> typed results, each writing its outputs into
the folder it is given. The rows of the stage table (``stage_table.py``) call them with what the run's plan holds;
anything else (a benchmark, a test) can call them the same way.

Stages shared by several processes (capture, TaSQ, k-means, fine-tuning) take the run's
:class:`~loopvq_calib.runtime.processes.DistContext`; TaSQ and k-means join the processes' parts on the main
process, which alone returns the joined result.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..bundle.writer import write_bundle
from ..codes.layouts import plan_layouts
from ..codes.quantizer import KVQuantizer, merge_quantizers
from ..config.schema import Config
from ..data.corpus import CalibrationSet
from ..models.loading import ModelIdentity
from ..models.sites import KVLayout
from ..runtime.files import write_bytes_atomic, write_tensors_atomic
from ..runtime.processes import DistContext
from .capture.kv import MemoryCapture, capture_kv, capture_meta, share_sequences, write_meta
from .capture.reader import CaptureData, CaptureReader, MemoryReader
from .capture.store import StoreChoice
from .finetune.train import FinetuneResult, finetune_codebooks
from .kmeans.fit import fit_codebooks, shard_tensor_names
from .rundir import discard
from .tasq.grouping import TasqResult, fit_tasq, merge_tasq

Progress = Callable[[int], Any]


# -- codebooks on disk -------------------------------------------------------------------------
def save_quantizer(q: KVQuantizer, folder: Path, extra: dict[str, Any] | None = None) -> None:
    """A stage's codebooks on disk: ``quantizer.safetensors`` (fp32 codebooks) + ``quantizer.json``."""
    write_tensors_atomic(folder / "quantizer.safetensors", q.tensors(torch.float32))
    write_bytes_atomic(folder / "quantizer.json", json.dumps({**q.meta(), **(extra or {})}, indent=1).encode())


def load_quantizer(folder: Path) -> KVQuantizer:
    """The codebooks :func:`save_quantizer` wrote into ``folder``."""
    meta = json.loads((folder / "quantizer.json").read_text())
    return KVQuantizer.from_tensors(meta, load_file(str(folder / "quantizer.safetensors")))


# -- data ------------------------------------------------------------------------------------------
def save_calibration(calib: CalibrationSet, folder: Path) -> dict[str, Any]:
    """``sequences.safetensors`` (token ids) and ``split.json`` (train / selection split, description,
    content hash); returns the stage's record details."""
    write_tensors_atomic(folder / "sequences.safetensors", {"input_ids": calib.input_ids})
    split = {
        "train": calib.train,
        "heldout": calib.heldout,
        "sink_tokens": calib.sink_tokens,
        "description": calib.description,
        "content_sha256": calib.content_hash,
    }
    write_bytes_atomic(folder / "split.json", json.dumps(split, indent=1).encode())
    return {"content_sha256": calib.content_hash, "tokens": calib.input_ids.numel()}


def load_calibration(folder: Path) -> CalibrationSet:
    """The calibration set a data stage saved."""
    split = json.loads((folder / "split.json").read_text())
    ids = load_file(str(folder / "sequences.safetensors"))["input_ids"]
    return CalibrationSet(ids, split["train"], split["heldout"], split["sink_tokens"], split["description"])


# -- capture ---------------------------------------------------------------------------------------
def run_capture(
    model: torch.nn.Module,
    calib: CalibrationSet,
    kv: KVLayout,
    *,
    cfg: Config,
    store: StoreChoice,
    folder: Path,
    dist: DistContext,
    progress: Progress | None = None,
) -> CaptureData:
    """Capture every sequence (each process its own, ``dist.owns``) into ``store``: files under ``folder``
    (``disk``) or memory; returns the reader later stages use. An in-memory capture under several processes
    then gives each process its TaSQ and k-means layouts of every sequence (``share_sequences``)."""
    memory = MemoryCapture() if store.store != "disk" else None
    tasq = cfg.quant.uses_tasq
    capture = replace(cfg.capture, store=store.store)
    capture_kv(
        model,
        calib,
        kv,
        cfg=capture,
        out=memory or folder,
        dist=dist,
        progress=progress,
        tasq_floor=cfg.tasq.weight_floor if tasq else None,
        device_sequences=store.device_sequences,
        query_stats=tasq,
    )
    dist.barrier()
    if memory is not None and dist.world > 1:
        names = shard_tensor_names(plan_layouts(kv, cfg.quant), dist.world, tasq)
        share_sequences(memory, names, dist, num_sequences=calib.input_ids.shape[0])
    if dist.is_main:  # meta.json describes the files (or sequences) of all processes
        write_meta(folder, calib, kv, cfg=capture, memory=memory, tasq_keys=tasq)
    elif memory is not None:
        capture_meta(calib, kv, capture, memory=memory, tasq_keys=tasq)
    dist.barrier()
    return MemoryReader(memory) if memory is not None else CaptureReader(folder)


# -- joining the processes' parts ------------------------------------------------------------------
def join_parts(
    dist: DistContext, folder: Path, save: Callable[[Path], Any], *, load: Callable[[Path], Any]
) -> list | None:
    """Each process saves its share of a stage under ``folder/part{rank}``; the main process gets every
    part, in rank order (their folders are then removed), the others None."""
    mine = folder / f"part{dist.rank}"
    mine.mkdir(parents=True, exist_ok=True)
    save(mine)
    dist.barrier()
    if not dist.is_main:
        return None
    parts = [load(folder / f"part{r}") for r in range(dist.world)]
    for r in range(dist.world):
        shutil.rmtree(folder / f"part{r}")
    return parts


# -- TaSQ ------------------------------------------------------------------------------------------
def run_tasq(
    reader: CaptureData, kv: KVLayout, cfg: Config, *, folder: Path, dist: DistContext, device: torch.device
) -> TasqResult | None:
    """TaSQ transforms and groups of every key layout (processes share the layouts as k-means does), saved
    in ``folder``; the main process returns the joined :class:`~loopvq_calib.calibration.tasq.grouping.TasqResult`."""
    part = fit_tasq(reader, plan_layouts(kv, cfg.quant), kv, quant=cfg.quant, cfg=cfg.tasq, dist=dist, device=device)
    parts = join_parts(dist, folder, part.save, load=TasqResult.load)
    if parts is None:
        return None
    result = merge_tasq(parts)
    result.save(folder)
    return result


# -- k-means ---------------------------------------------------------------------------------------
@dataclass
class KMeansReport:
    """The k-means stage's result: the codebooks and, per layout, the objectives, Lloyd updates and seconds;
    ``totals`` holds one summary per process."""

    quantizer: KVQuantizer
    layouts: dict[str, dict[str, Any]] = field(default_factory=dict)
    totals: list[dict[str, Any]] = field(default_factory=list)

    def save(self, folder: Path) -> None:
        """The codebooks (:func:`save_quantizer`) and ``report.json``."""
        save_quantizer(self.quantizer, folder)
        report = {"layouts": self.layouts, "totals": self.totals}
        write_bytes_atomic(folder / "report.json", json.dumps(report, indent=1, default=float).encode())

    @classmethod
    def load(cls, folder: Path) -> KMeansReport:
        """The report :meth:`save` wrote."""
        report = json.loads((folder / "report.json").read_text())
        return cls(load_quantizer(folder), report["layouts"], report["totals"])


def run_kmeans(
    reader: CaptureData,
    tasq: Any,
    kv: KVLayout,
    *,
    cfg: Config,
    folder: Path,
    dist: DistContext,
    device: torch.device,
    progress: Progress | None = None,
) -> KMeansReport | None:
    """Codebooks of every layout (TaSQ's layouts and transforms when ``tasq`` is given), processes sharing the
    layouts (disk capture: every process reads every sequence; in-memory: each holds its layouts of every
    sequence); the main process joins the parts, saves them in ``folder`` and returns the report."""
    layouts = tasq.layouts if tasq is not None else plan_layouts(kv, cfg.quant)
    transforms = tasq.transforms if tasq is not None else {}
    part, report = fit_codebooks(
        reader, layouts, transforms, quant=cfg.quant, cfg=cfg.kmeans, kv=kv, device=device, progress=progress, dist=dist
    )
    parts = join_parts(
        dist,
        folder,
        lambda d: save_quantizer(part, d, {"report": report}),
        load=lambda d: (load_quantizer(d), json.loads((d / "quantizer.json").read_text())["report"]),
    )
    if parts is None:
        return None
    merged = KMeansReport(
        merge_quantizers([q for q, _ in parts], [lay.key for lay in layouts]),
        {k: v for _, r in parts for k, v in r["layouts"].items()},
        [r["totals"] for _, r in parts],
    )
    merged.save(folder)
    return merged


# -- fine-tuning -----------------------------------------------------------------------------------
def run_finetune(
    model: torch.nn.Module,
    calib: CalibrationSet,
    init: KVQuantizer,
    *,
    cfg: Config,
    folder: Path,
    dist: DistContext,
    device: torch.device,
    progress: Progress | None = None,
) -> FinetuneResult:
    """KL fine-tuning of the k-means codebooks (processes share each batch); the state after every epoch but the
    last is kept in ``folder/resume.pt`` so an interrupted run resumes; the main process saves the kept codebooks
    and the selection curve (``curve.json``) in ``folder`` and returns the result with its quantizer as saved
    (:func:`as_saved_quantizer`: on the CPU, copied from the device once), the other processes as fine-tuned."""
    resume = folder / "resume.pt"
    result = finetune_codebooks(
        model, calib, init, cfg=cfg.finetune, device=device, progress=progress, checkpoint=resume, dist=dist
    )
    if dist.is_main:
        discard(resume, folder.parent)
        result = replace(result, quantizer=as_saved_quantizer(result.quantizer))  # one copy from the device
        save_finetune(result, folder)
    return result


def save_finetune(result: FinetuneResult, folder: Path) -> None:
    """The kept codebooks (:func:`save_quantizer`) and ``curve.json`` (the selection curve, the best point)."""
    save_quantizer(result.quantizer, folder)
    best = {"best_epoch": result.best_epoch, "best_step": result.best_step, "curve": result.curve}
    write_bytes_atomic(folder / "curve.json", json.dumps(best, indent=1).encode())


def load_finetune(folder: Path) -> FinetuneResult:
    """A saved fine-tuning result (``teacher_kept`` is not saved: 0)."""
    curve = json.loads((folder / "curve.json").read_text())
    return FinetuneResult(load_quantizer(folder), curve["best_epoch"], curve["curve"], best_step=curve["best_step"])


def as_saved_quantizer(q: KVQuantizer) -> KVQuantizer:
    """``q`` as :func:`load_quantizer` reads it back after :func:`save_quantizer` (fp32 codebooks on the CPU,
    the metadata through JSON; safetensors stores them bit for bit), without the disk; shares no tensor with ``q``."""
    tensors = {k: v.clone() for k, v in q.tensors(torch.float32).items()}
    return KVQuantizer.from_tensors(json.loads(json.dumps(q.meta())), tensors)


def as_saved_finetune(result: FinetuneResult) -> FinetuneResult:
    """``result`` as :func:`load_finetune` reads it back after :func:`save_finetune`, without the disk."""
    return FinetuneResult(
        as_saved_quantizer(result.quantizer),
        result.best_epoch,
        json.loads(json.dumps(result.curve)),
        best_step=result.best_step,
    )


def selection_metrics(result: FinetuneResult) -> dict[str, Any]:
    """The selection KL (KL on the calibration set's selection sequences, which pick the fine-tuning step;
    not the evaluation KL of ``loopvq-eval``) of the kept codebooks and of the k-means codebooks."""
    best = next(e for e in result.curve if e["step"] == result.best_step)
    return {
        "selection_kl": best["selection_kl"],
        "selection_kl_init": result.curve[0]["selection_kl"],
        "best_epoch": result.best_epoch,
        "best_step": result.best_step,
    }


# -- bundle ----------------------------------------------------------------------------------------
def bundle_name(cfg: Config) -> str:
    """``output.bundle_name`` or ``<model>-<method>-<bits>bit``."""
    return cfg.output.bundle_name or f"{Path(cfg.model.name_or_path).name}-{cfg.quant.method}-{cfg.quant.bits:g}bit"


def run_bundle(
    folder: Path, tuned: FinetuneResult, calib: CalibrationSet, *, identity: ModelIdentity, cfg: Config, version: str
) -> dict[str, Any]:
    """Write the versioned bundle of the kept codebooks into ``folder``; returns the stage's record details."""
    metrics = {
        **selection_metrics(tuned),
        "finetune_curve": tuned.curve,
        "selection_sequences": len(calib.heldout),
        "bits": tuned.quantizer.bits(),
    }
    name = bundle_name(cfg)
    write_bundle(
        folder,
        tuned.quantizer,
        name=name,
        identity=identity,
        calibration=calib.description,
        metrics=metrics,
        serving=cfg.output.serving,
        codebook_dtype=cfg.output.codebook_dtype,
        config=cfg.to_dict(),
        producer_version=version,
    )
    return {"name": name}
