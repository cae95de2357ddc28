"""Quality on the trained reference models (reference_models.py, one table): every method served through the cache
(eval_reference.py; from its results docs/quality-models.md: quality_table.py, and docs/tasq-grouping.md:
grouping_table.py), the fine-tuning study and gain (study_finetune.py and measure_finetune_gain.py over the grids of
finetune_grids.py; docs/finetune.md's tables: finetune_report.py)."""
