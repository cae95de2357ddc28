"""benchmarks/common/markdown.py: a fine-tuning recipe in the words of the results pages' setup lines."""

from __future__ import annotations

from benchmarks.common.markdown import recipe


def test_a_recipe_reads_keys_its_commits_config_lacked_as_that_commits_behaviour():
    assert recipe({"epochs": 2, "lr": 1e-3}) == "2 epochs, Adam lr 0.001, constant schedule, selection after each epoch"
    assert recipe(
        {"epochs": 4, "lr": 0.01, "lr_schedule": "cosine", "warmup_steps": 4, "select_every": 4, "proximal": 1.0}
    ) == ("4 epochs, Adam lr 0.01, cosine schedule, 4 warm-up steps, selection every 4 steps, proximal 1")
