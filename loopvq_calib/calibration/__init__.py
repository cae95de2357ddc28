"""Calibration: the stages (data, capture, TaSQ, k-means, fine-tuning, bundle) as plain functions, the
pipeline that wires, fingerprints and reuses them, and the run directory they write into.
"""
