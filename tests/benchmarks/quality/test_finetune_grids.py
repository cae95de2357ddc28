"""benchmarks/quality/finetune_grids.py, the fine-tuning study's design: the shipped variant is the default recipe and
every variant a whole recipe, scaled recipes keep their selection points per epoch, one results file per model and
grid."""

from __future__ import annotations

import pytest

from benchmarks.quality import finetune_grids as grids
from loopvq_calib.config.schema import FinetuneConfig


def test_the_shipped_variant_is_the_default_recipe_and_every_variant_is_a_whole_recipe():
    default = FinetuneConfig()
    assert grids.SHIPPED == {k: getattr(default, k) for k in grids.RECIPE_KEYS}
    for name, recipe in grids.VARIANTS.items():
        assert set(recipe) == set(grids.RECIPE_KEYS), name
        FinetuneConfig(**recipe)
    assert grids.PAPER == {
        **grids.SHIPPED,
        "lr": 1e-3,
        "lr_schedule": "constant",
        "warmup_steps": 0,
        "select_every": 0,
        "proximal": 0.0,
    }
    for grid in grids.GRIDS.values():
        assert set(grid.variants) <= set(grids.VARIANTS) and set(grids.QUANT) <= set(grids.VARIANTS)
    assert grids.results_name("huginn", "levers") == "finetune-study-huginn.json"
    assert grids.results_name("ouro", "data") == "finetune-study-ouro-data.json"


def test_scaled_recipes_keep_their_selection_points_per_epoch():
    for train in (12, 48, 172):
        for name, recipe in grids.VARIANTS.items():
            got = grids.scaled(recipe, train)
            assert {k: v for k, v in got.items() if k != "select_every"} == {
                k: v for k, v in recipe.items() if k != "select_every"
            }
            if recipe["select_every"] == 0:
                assert got["select_every"] == 0
            else:  # optimizer steps per epoch / steps between points, as at 12 training sequences (within rounding)
                at_12 = 12 / recipe["batch_size"] / recipe["select_every"]
                assert train / recipe["batch_size"] / got["select_every"] == pytest.approx(at_12, rel=0.1), name
