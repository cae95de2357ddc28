"""The fine-tuning study's design, read by its driver (study_finetune.py), by the gain measurement
(measure_finetune_gain.py: the cells) and by the report (finetune_report.py): the cells, the recipes varied, the grids
and the name of each grid's results file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CELLS = (("loopvq", 0.5), ("loopvq", 0.25), ("tasq+loopvq", 0.5), ("tasq+loopvq", 0.25))
RECIPE_KEYS = (
    "epochs",
    "lr",
    "lr_schedule",
    "warmup_steps",
    "batch_size",
    "select_every",
    "proximal",
    "parameterization",
    "min_usage",
    "seed",
)
SHIPPED = {
    "epochs": 4,
    "lr": 1e-2,
    "lr_schedule": "cosine",
    "warmup_steps": 4,
    "batch_size": 1,
    "select_every": 4,
    "proximal": 1.0,
    "parameterization": "codewords",
    "min_usage": 0,
    "seed": 0,
}  # FinetuneConfig's defaults
PAPER = {**SHIPPED, "lr": 1e-3, "lr_schedule": "constant", "warmup_steps": 0, "select_every": 0, "proximal": 0.0}
VARIANTS = {  # every key of RECIPE_KEYS; select_every at 12 training sequences (scaled to keep the points per epoch)
    "shipped": SHIPPED,
    "shipped-seed1": {**SHIPPED, "seed": 1},  # another sequence order: the noise between two runs of one recipe
    "paper": PAPER,
    "lr3e-3": {**SHIPPED, "lr": 3e-3},
    "lr3e-2": {**SHIPPED, "lr": 3e-2},
    "proximal0": {**SHIPPED, "proximal": 0.0},
    "proximal10": {**SHIPPED, "proximal": 10.0},
    "epochs8": {**SHIPPED, "epochs": 8},
    "proximal1-batch2-lr2e-2": {**SHIPPED, "lr": 2e-2, "batch_size": 2, "warmup_steps": 2, "select_every": 2},
    "batch4-lr2e-2": {**SHIPPED, "lr": 2e-2, "batch_size": 4, "warmup_steps": 1, "select_every": 1},
    "affine": {**SHIPPED, "parameterization": "affine"},
    "min-usage32": {**SHIPPED, "min_usage": 32},
    "sharing-heads": SHIPPED,
}
QUANT = {"sharing-heads": {"codebook_sharing": "heads"}}  # variants that start from other k-means codebooks
SMOKE_SHAPES = {"sequence_length": 64, "kmeans_iterations": 3, "epochs": 1, "eval": (2, 64)}


@dataclass(frozen=True)
class Grid:
    """Calibration sequences, the variants run on each cell, the cells; ``smoke``: toy shapes."""

    sequences: int
    variants: tuple[str, ...]
    cells: tuple[tuple[str, float], ...] = CELLS
    smoke: bool = False


GRIDS = {
    "levers": Grid(16, tuple(VARIANTS)),
    "data": Grid(64, ("shipped", "paper", "proximal10", "affine")),
    "smoke": Grid(8, ("shipped", "sharing-heads"), CELLS[2:3], smoke=True),
}


def results_name(model: str, grid: str) -> str:
    """The study file of ``model`` and ``grid`` (the levers grid has no suffix)."""
    return f"finetune-study-{model}{'' if grid == 'levers' else '-' + grid}.json"


def scaled(recipe: dict[str, Any], train: int) -> dict[str, Any]:
    """``recipe`` for ``train`` training sequences: ``select_every`` scaled from 12 so that the selection points
    per epoch stay (0, after each epoch, stays)."""
    every = recipe["select_every"]
    return {**recipe, "select_every": max(1, round(every * train / 12)) if every else 0}


def sharing_of(variant: str) -> str:
    """The codebook sharing of the k-means codebooks ``variant`` starts from."""
    return QUANT.get(variant, {}).get("codebook_sharing", "none")
