"""Calibration speed: the real command timed end to end (measure_real_command.sh, bench_pipeline.py), two trees
compared on one machine (compare_trees.sh), the k-means and TaSQ stages alone (bench_kmeans*.py, tune_kmeans_kernels.py,
bench_tasq_grouping.py), the identity of the code measured (code_identity.py) and docs/performance.md from the stored
results (performance_table.py, reading them with performance_runs.py)."""
