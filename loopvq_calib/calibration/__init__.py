"""Calibration: the stage table (data, capture, TaSQ, k-means, fine-tuning, bundle: one row each), the stages'
work as plain functions, the checks before a run, the pipeline that runs the table's rows, fingerprinting and
reusing them, and the run directory they write into.
"""
