"""Quality on the trained reference models (reference_models.py, one table): every method served through the cache
(eval_reference.py, and docs/quality-models.md from its results: quality_table.py), the fine-tuning study and gain
(study_finetune.py and measure_finetune_gain.py over the grids of finetune_grids.py; docs/finetune.md's tables:
finetune_report.py)."""
