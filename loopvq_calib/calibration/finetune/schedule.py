"""The order of a fine-tuning run, the same on every process: the training batches of each epoch, the optimizer
steps, where the selection points fall, and the teacher outputs a process asks for in that order (the
:class:`~loopvq_calib.calibration.finetune.teacher_cache.TeacherCache`'s plan)."""

from __future__ import annotations

import torch

from ...config.schema import FinetuneConfig
from ...data.corpus import CalibrationSet
from ...runtime.processes import SINGLE, DistContext
from .teacher_cache import Plan


def epoch_batches(calib: CalibrationSet, cfg: FinetuneConfig, epoch: int) -> list[list[int]]:
    """The training batches of epoch ``epoch`` (from 1), in the order it visits them (the same on every
    process; each process takes its :meth:`~loopvq_calib.runtime.processes.DistContext.share` of a batch)."""
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + epoch)
    order = [calib.train[i] for i in torch.randperm(len(calib.train), generator=gen).tolist()]
    return [order[start : start + cfg.batch_size] for start in range(0, len(order), cfg.batch_size)]


def teacher_plan(
    calib: CalibrationSet, cfg: FinetuneConfig, dist: DistContext = SINGLE, *, first_epoch: int = 1
) -> Plan:
    """The sequences whose teacher outputs this process of ``dist`` asks for in a run from epoch ``first_epoch``,
    in order, in the groups it asks for together: its share of the selection sequences in batches of
    ``selection_batch`` at every selection point (the first, step 0, only in a fresh run), of the usage count
    (``min_usage``, one at a time) and of every training batch (one at a time; each batch is split by position,
    and the order changes every epoch, so with ``batch_size`` > 1 a process sees most training sequences)."""
    held = dist.share(calib.heldout)
    selection = [held[i : i + cfg.selection_batch] for i in range(0, len(held), cfg.selection_batch)]
    plan = list(selection) if first_epoch == 1 else []
    total = training_steps(cfg, len(calib.train))
    if total == 0:
        return plan
    if cfg.min_usage > 0:
        plan += [[i] for i in dist.share(calib.train)]
    steps = (first_epoch - 1) * -(-len(calib.train) // cfg.batch_size)
    for epoch in range(first_epoch, cfg.epochs + 1):
        batches = epoch_batches(calib, cfg, epoch)
        for b, batch in enumerate(batches):
            plan += [[i] for i in dist.share(batch)]
            steps += 1
            if selects(cfg, steps, total, last_of_epoch=b == len(batches) - 1):
                plan += selection
    return plan


def selects(cfg: FinetuneConfig, steps: int, total: int, *, last_of_epoch: bool) -> bool:
    """Whether a selection point follows optimizer step ``steps`` of ``total``: every ``select_every`` steps
    and at the last step, else at every epoch's end."""
    return bool(cfg.select_every and steps % cfg.select_every == 0) or (
        last_of_epoch and (not cfg.select_every or steps == total)
    )


def training_steps(cfg: FinetuneConfig, train_sequences: int) -> int:
    """Optimizer steps of a fine-tuning run (0 when it is off)."""
    return cfg.epochs * -(-train_sequences // cfg.batch_size) if cfg.enabled else 0
