"""A disk capture of a tiny model, shared by the capture tests (tests/calibration/capture/)."""

from __future__ import annotations

from pathlib import Path

import torch

from loopvq_calib.calibration.capture.kv import capture_kv, write_meta
from loopvq_calib.calibration.capture.reader import CaptureReader
from loopvq_calib.config.schema import CaptureConfig
from loopvq_calib.data.corpus import CalibrationSet


def run_capture(model: torch.nn.Module, calib: CalibrationSet, folder: Path, **cfg) -> CaptureReader:
    """Capture ``calib`` through ``model`` into ``folder`` (CaptureConfig fields in ``cfg``), write its meta and
    return its reader."""
    config = CaptureConfig(**cfg)
    capture_kv(model, calib, model.kv_layout(), cfg=config, out=folder)
    write_meta(folder, calib, model.kv_layout(), cfg=config)
    return CaptureReader(folder)
