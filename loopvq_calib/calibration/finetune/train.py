"""Loop-aware codebook fine-tuning against the full-precision output (docs/finetune.md).

Objective: mean over positions after the sinks of KL(p_j || q_j), q_j the frozen model's output when
every site's keys/values after the sinks are replaced by decode(encode(.)) of that sequence's
full-precision cache with the current codebooks, plus an optional proximal penalty toward the k-means
codebooks. Assignments are recomputed each step without gradient; the free parameters
(:mod:`~loopvq_calib.calibration.finetune.recipe`) get exact gradients through the lookup. Model weights never
change. The k-means initialisation is step 0; the selection point (epoch end or every ``select_every`` steps)
with the lowest selection KL (KL on the calibration set's selection sequences) is kept.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...codes.objective import Teacher, mean_kl, quantized_logits, teacher
from ...codes.quantizer import KVQuantizer
from ...config.schema import FinetuneConfig
from ...data.corpus import CalibrationSet
from ...runtime.processes import SINGLE, DistContext
from .epoch_state import EpochWriter
from .loop_policy import LoopPolicy, release_cached_memory
from .recipe import CodebookParams, add_usage, lr_factor
from .schedule import epoch_batches, selects, teacher_plan, training_steps
from .teacher_cache import TeacherCache, autocast

log = logging.getLogger("loopvq_calib")


@dataclass
class FinetuneResult:
    quantizer: KVQuantizer  # codebooks of the best selection point
    best_epoch: int  # the epoch of that point (0: the k-means codebooks)
    # per selection point: epoch, step, train_kl, selection_kl
    curve: list[dict[str, Any]] = field(default_factory=list)
    teacher_kept: int = 0  # sequences whose teacher outputs this process kept across epochs
    best_step: int = 0  # optimizer steps taken at that point


def sequence_kl(
    model: torch.nn.Module,
    ids: torch.Tensor,
    quantizer: KVQuantizer,
    *,
    sink_tokens: int,
    cfg: FinetuneConfig,
    device: torch.device,
    fp: Teacher | None = None,
) -> torch.Tensor:
    """KL objective of sequences [B, S] of one length, the mean over their positions after the sinks
    (differentiable w.r.t. the codebooks); ``fp`` their cached teacher outputs."""
    with autocast(cfg, device):
        fp = fp if fp is not None else teacher(model, ids)
        q = quantized_logits(model, ids, quantizer, fp=fp, sink_tokens=sink_tokens)
    return mean_kl(fp.logits, q, sink_tokens, chunk=cfg.kl_chunk)


@torch.no_grad()
def selection_kl(
    model: torch.nn.Module,
    calib: CalibrationSet,
    quantizer: KVQuantizer,
    *,
    cfg: FinetuneConfig,
    device: torch.device,
    cache: TeacherCache | None = None,
    dist: DistContext = SINGLE,
) -> float:
    """Selection KL: mean KL over the selection sequences of the calibration set (``calib.heldout``; each
    process of ``dist`` takes a share, summed across processes), ``cfg.selection_batch`` sequences per
    forward: their kept teacher outputs joined along the batch, or one teacher forward of the batch when
    ``cache`` keeps none of them."""
    total = torch.zeros(2, device=device)
    owned = dist.share(calib.heldout)
    for start in range(0, len(owned), cfg.selection_batch):
        rows = owned[start : start + cfg.selection_batch]
        ids = calib.input_ids[rows].to(device)
        fp = None
        if cache is not None and any(cache.keeps(i) for i in rows):
            fp = batch_teachers([cache.get(i, ids[j : j + 1], device) for j, i in enumerate(rows)])
        kl = sequence_kl(model, ids, quantizer, sink_tokens=calib.sink_tokens, cfg=cfg, device=device, fp=fp)
        total[0] += kl.float() * len(rows)
        total[1] += len(rows)
    total = dist.all_reduce_sum(total)
    return (total[0] / total[1]).item()


def selection_extra(cache: TeacherCache, cfg: FinetuneConfig, selection_sequences: int) -> int:
    """Bytes a joined selection batch of this process's ``selection_sequences`` may add on top of the peak of
    training steps: the joined teacher outputs and the batch's quantized keys/values, estimated (not measured)
    as twice its sequences' outputs; 0 for one sequence at a time."""
    batch = min(cfg.selection_batch, selection_sequences)
    return 2 * batch * (cache.per_sequence or 0) if batch > 1 else 0


def batch_teachers(parts: list[Teacher]) -> Teacher:
    """The teacher outputs of several sequences of one length as one batch (a part itself when alone)."""
    if len(parts) == 1:
        return parts[0]
    return Teacher(
        torch.cat([p.logits for p in parts]),
        {s: torch.cat([p.keys[s] for p in parts]) for s in parts[0].keys},
        {s: torch.cat([p.values[s] for p in parts]) for s in parts[0].values},
    )


def usage_counts(
    model: torch.nn.Module,
    calib: CalibrationSet,
    quantizer: KVQuantizer,
    *,
    cache: TeacherCache,
    device: torch.device,
    dist: DistContext = SINGLE,
) -> dict[str, torch.Tensor]:
    """Per codebook [Hc, nc, K]: training vectors (this process's share, summed across processes)
    assigned to each codeword."""
    counts: dict[str, torch.Tensor] = {
        key: torch.zeros(c.codebook.shape[:3], dtype=torch.long) for key, c in quantizer.codecs.items()
    }  # every process reduces every key
    for i in dist.share(calib.train):
        ids = calib.input_ids[i : i + 1].to(device)
        add_usage(quantizer, cache.get(i, ids, device), calib.sink_tokens, counts=counts)
    return {k: dist.all_reduce_sum(v.to(device)).cpu() for k, v in counts.items()}


def train_step(
    model: torch.nn.Module,
    calib: CalibrationSet,
    quantizer: KVQuantizer,
    *,
    free: CodebookParams,
    cfg: FinetuneConfig,
    device: torch.device,
    cache: TeacherCache,
    dist: DistContext,
    batch: list[int],
    train_sum: torch.Tensor,
) -> None:
    """This process's share of one optimizer step's forward and backward passes: fresh zero gradients, the
    codebooks from the free parameters, the proximal penalty (main process) and each sequence's KL / batch
    size; adds (KL sum, sequences) to ``train_sum``. It leaves the parameters and the optimizer alone."""
    for p in free.params:
        p.grad = torch.zeros_like(p)
    free.apply()
    if cfg.proximal > 0 and dist.is_main:
        free.penalty(cfg.proximal).backward(retain_graph=True)
    for i in dist.share(batch):
        ids = calib.input_ids[i : i + 1].to(device)
        kl = sequence_kl(
            model, ids, quantizer, sink_tokens=calib.sink_tokens, cfg=cfg, device=device, fp=cache.get(i, ids, device)
        )
        (kl / len(batch)).backward(retain_graph=cfg.parameterization == "affine")
        train_sum += torch.stack([kl.detach().float(), torch.ones((), device=device)])


def finetune_codebooks(
    model: torch.nn.Module,
    calib: CalibrationSet,
    quantizer: KVQuantizer,
    *,
    cfg: FinetuneConfig,
    device: torch.device,
    progress: Callable[[int], Any] | None = None,
    on_select: Callable[[dict[str, Any], KVQuantizer], Any] | None = None,
    checkpoint: Path | None = None,
    dist: DistContext = SINGLE,
) -> FinetuneResult:
    """Adam on the codebooks' free parameters (``cfg.parameterization``), ``cfg.batch_size`` training
    sequences per step (split across processes, gradients averaged), the selection KL after every epoch
    (or every ``cfg.select_every`` steps); returns the codebooks of the best selection point.
    ``on_select(entry, quantizer)`` sees every curve entry with the codebooks it measured. On CUDA it
    returns the allocator's unused cached blocks to the device and resets its peak-memory statistics (the
    teacher cache is sized from the first steps' peak).
    ``checkpoint``: a file where the main process saves the state after every epoch but the last (free
    parameters, Adam's state, the curve, the best point; written in the background, :class:`EpochWriter`)
    and from which a rerun resumes after the last saved epoch.
    ``dist``: the processes sharing each batch (gradients summed across them). ``cfg.loop_checkpointing``
    ``auto`` may turn checkpointing on during the run (:class:`~.loop_policy.LoopPolicy`;
    a step that ran out of memory is redone), which does not change the result."""
    quantizer = copy.deepcopy(quantizer).to(device, torch.float32)
    resume = torch.load(checkpoint, weights_only=False) if checkpoint is not None and checkpoint.is_file() else None
    first_epoch = 1 if resume is None else resume["epoch"] + 1
    cache = TeacherCache(model, cfg, teacher_plan(calib, cfg, dist, first_epoch=first_epoch))
    if device.type == "cuda":  # the first steps' peak decides how many teacher outputs fit (cache_teacher auto)
        release_cached_memory(device)
    run = _Run(
        model, calib, quantizer, cfg=cfg, device=device, cache=cache, dist=dist, progress=progress, on_select=on_select
    )
    if resume is None:
        run.select(0, 0, None)
    if run.total == 0:
        return FinetuneResult(quantizer, 0, run.curve, cache.kept)
    run.start(resume)
    if resume is not None:
        log.info("fine-tune: resuming after epoch %d (step %d) from %s", resume["epoch"], run.steps, checkpoint)
    saving = checkpoint is not None and dist.is_main
    with (
        EpochWriter(checkpoint) if saving else nullcontext() as writer,
        LoopPolicy(model, cfg.loop_checkpointing, device) as loop,
    ):
        for epoch in range(first_epoch, cfg.epochs + 1):
            run.epoch(epoch, loop, writer=writer, first_epoch=first_epoch)
    return run.finish()


class _Run:
    """One fine-tuning run: its curve, free parameters, Adam, the best point, the steps taken and the train KL
    summed since the last selection point; the steps of an epoch, the selection points, the teacher cache's
    sizing and the epoch state."""

    def __init__(
        self,
        model: torch.nn.Module,
        calib: CalibrationSet,
        quantizer: KVQuantizer,
        *,
        cfg: FinetuneConfig,
        device: torch.device,
        cache: TeacherCache,
        dist: DistContext,
        progress: Callable[[int], Any] | None,
        on_select: Callable[[dict[str, Any], KVQuantizer], Any] | None,
    ) -> None:
        self.model, self.calib, self.quantizer, self.cfg = model, calib, quantizer, cfg
        self.device, self.cache, self.dist = device, cache, dist
        self.progress, self.on_select = progress, on_select
        self.total = training_steps(cfg, len(calib.train))
        self.curve: list[dict[str, Any]] = []
        self.resumed = False
        self.saved_best: int | None = None  # the best point at the last epoch-state save

    def select(self, epoch: int, step: int, train: torch.Tensor | None) -> dict[str, Any]:
        """A selection point: the selection KL of the current codebooks and the mean train KL of ``train``
        (KL sum, sequences) across processes; appended to the curve."""
        calib, dist = self.calib, self.dist
        sel = (
            selection_kl(
                self.model, calib, self.quantizer, cfg=self.cfg, device=self.device, cache=self.cache, dist=dist
            )
            if calib.heldout
            else float("nan")
        )
        mean = None if train is None else (dist.all_reduce_sum(train)[0] / train[1].clamp_min(1)).item()
        entry = {"epoch": epoch, "step": step, "train_kl": mean, "selection_kl": sel}
        self.curve.append(entry)
        if self.on_select is not None:
            self.on_select(entry, self.quantizer)
        return entry

    def start(self, resume: dict[str, Any] | None) -> None:
        """The free parameters (``min_usage``: from the k-means codebooks' usage), Adam and the best point so
        far, as saved in the epoch state ``resume`` when given."""
        cfg, device = self.cfg, self.device
        usage = (
            usage_counts(self.model, self.calib, self.quantizer, cache=self.cache, device=device, dist=self.dist)
            if cfg.min_usage > 0
            else None
        )
        self.free = CodebookParams(self.quantizer, cfg.parameterization, usage, min_usage=cfg.min_usage)
        self.opt = torch.optim.Adam(self.free.params, lr=cfg.lr)
        self.best, self.best_state = 0, self.free.snapshot()
        self.steps, self.settle_after = 0, min(2, self.total)
        self.train_sum = torch.zeros(2, device=device)
        if resume is not None:
            with torch.no_grad():
                for p, saved in zip(self.free.params, resume["params"]):
                    p.copy_(saved)
            self.opt.load_state_dict(resume["opt"])
            self.curve[:], self.best, self.steps = resume["curve"], resume["best"], resume["steps"]
            self.best_state = {k: t.to(device) for k, t in resume["best_state"].items()}
            self.train_sum = resume["train_sum"].to(device)
            self.settle_after = self.steps + min(2, self.total - self.steps)  # sized after two steps of this run
            self.resumed = True
        # step 0's peak
        self.floor = torch.cuda.max_memory_reserved(device) if device.type == "cuda" and not self.resumed else 0

    def state(self, epoch: int) -> dict[str, Any]:
        """The epoch state after ``epoch``, from which a rerun resumes."""
        return {
            "epoch": epoch,
            "steps": self.steps,
            "curve": self.curve,
            "best": self.best,
            "best_state": self.best_state,
            "params": [p.detach() for p in self.free.params],
            "opt": self.opt.state_dict(),
            "train_sum": self.train_sum,
        }

    def epoch(self, epoch: int, loop: LoopPolicy, *, writer: EpochWriter | None, first_epoch: int) -> None:
        """The optimizer steps of ``epoch`` with their selection points, then (``writer``, every epoch but the
        last) the epoch state."""
        batches = epoch_batches(self.calib, self.cfg, epoch)
        for b, batch in enumerate(batches):
            switched = self.step(batch, loop)
            if writer is not None and b == 0 and epoch == first_epoch < self.cfg.epochs:  # Adam's state exists now
                writer.prepare(self.state(epoch))
            if switched and self.cache.capacity is None:  # the peak statistics restarted before the redone step
                self.settle_after = max(self.settle_after, min(self.steps + 1, self.total))
            if self.steps == self.settle_after:
                self.settle_cache(loop)
            if self.progress:
                self.progress(1)
            if selects(self.cfg, self.steps, self.total, last_of_epoch=b == len(batches) - 1):
                self.select_after_step(epoch)
        if writer is not None and epoch < self.cfg.epochs:  # after the last epoch the stage's result follows
            writer.save(self.state(epoch), unchanged=("best_state",) if self.best == self.saved_best else ())
            self.saved_best = self.best

    def step(self, batch: list[int], loop: LoopPolicy) -> bool:
        """One optimizer step on ``batch``; returns whether ``loop`` turned checkpointing on and redid it."""
        cache, free, train_sum = self.cache, self.free, self.train_sum
        mark, before = (cache.mark(), train_sum.clone()) if loop.trying_off else (None, None)

        def undo() -> None:  # what a step that ran out of memory changed
            cache.rewind(mark)
            train_sum.copy_(before)
            for p in free.params:
                p.grad = None

        switched = loop.run_step(
            lambda: train_step(
                self.model,
                self.calib,
                self.quantizer,
                free=free,
                cfg=self.cfg,
                device=self.device,
                cache=cache,
                dist=self.dist,
                batch=batch,
                train_sum=train_sum,
            ),
            undo,
        )
        for p in free.params:  # a no-op for one process
            self.dist.all_reduce_sum(p.grad)
        for group in self.opt.param_groups:
            group["lr"] = self.cfg.lr * lr_factor(
                self.steps, self.total, self.cfg.warmup_steps, schedule=self.cfg.lr_schedule
            )
        self.opt.step()
        self.steps += 1
        return switched

    def settle_cache(self, loop: LoopPolicy) -> None:
        """Size the teacher cache from the peak so far; or, when ``auto`` checkpointing turns on because the cache
        would not keep every sequence still asked for, size it after the next two steps."""
        cache, device = self.cache, self.device
        # a fresh run's peak already holds the first selection (``floor`` after a reset); a resumed one has not
        # selected yet
        joined = selection_extra(cache, self.cfg, -(-len(self.calib.heldout) // self.dist.world)) if self.resumed else 0
        to_come = sum(c.numel() * c.element_size() for c in self.free.init.values()) + joined
        tiers = cache.tiers_now(device, to_come, self.floor) if loop.trying_off else None
        if tiers is not None and not loop.keep_off(
            len(tiers[0]) + len(tiers[1]), cache.still_asked(), torch.cuda.max_memory_reserved(device)
        ):
            if device.type == "cuda":  # the cache is sized from the next steps, with checkpointing
                release_cached_memory(device)
            self.settle_after = self.steps + min(2, self.total - self.steps)
        else:
            cache.settle(device, to_come, self.floor)

    def select_after_step(self, epoch: int) -> None:
        """The selection point after the current step; the best point moves there when its selection KL is lower."""
        with torch.no_grad():
            self.free.apply()
        entry = self.select(epoch, self.steps, self.train_sum)
        self.train_sum = torch.zeros(2, device=self.device)
        log.info(
            "fine-tune epoch %d step %d: train KL %.5f, selection KL %.5f",
            epoch,
            self.steps,
            entry["train_kl"],
            entry["selection_kl"],
        )
        if entry["selection_kl"] < self.curve[self.best]["selection_kl"]:
            self.best, self.best_state = len(self.curve) - 1, self.free.snapshot()

    def finish(self) -> FinetuneResult:
        """The codebooks of the best point; the teacher cache is let go."""
        self.free.restore(self.best_state)
        kept = self.cache.kept
        self.cache.release()
        best = self.curve[self.best]
        return FinetuneResult(self.quantizer, best["epoch"], self.curve, kept, best["step"])
