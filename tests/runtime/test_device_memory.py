"""Per-stage peaks of accelerator memory (PeakMeter) on fake counters that behave as CUDA's: a reset restarts the
peak from what is held; a reset inside a stage must not lower the stage's peak, and each stage's peak is its own.
The device names of indexed_device."""

from __future__ import annotations

import pytest
import torch
from support.peak_counters import CUDA0, CUDA1, FakeCounters

from loopvq_calib.runtime.device_memory import PeakMeter
from loopvq_calib.runtime.devices import indexed_device


def test_a_reset_inside_a_stage_keeps_the_stage_peak_and_restarts_the_reading():
    counters = FakeCounters()
    meter = PeakMeter(counters)
    counters.allocate(10)  # held before the stage (the weights)
    with meter.stage() as peak:
        counters.allocate(100)
        counters.allocate(-100)
        meter.reset(CUDA0)  # fine-tuning's start: its own "peak since now" reading
        assert counters.peak_allocated(CUDA0) == 10  # the reading restarted
        counters.allocate(30)
        assert counters.peak_allocated(CUDA0) == 40
        meter.reset(CUDA0)  # a second reset (a step that ran out of memory): still the stage's peak
    assert peak.device == CUDA0 and peak.bytes == 110


def test_each_stage_peak_is_its_own():
    counters = FakeCounters()
    meter = PeakMeter(counters)
    with meter.stage() as first:
        counters.allocate(500)
        counters.allocate(-500)
    with meter.stage() as second:
        counters.allocate(40)
    assert (first.bytes, second.bytes) == (500, 40)
    meter.reset(CUDA0)
    assert second.bytes == 40  # a stage that ended is not changed by later resets


def test_a_reset_of_another_device_leaves_this_stages_counters_alone():
    counters = FakeCounters()
    meter = PeakMeter(counters)
    with meter.stage() as peak:
        counters.allocate(70)
        counters.allocate(-60)
        counters.allocate(5, CUDA1)
        meter.reset(CUDA1)
        assert counters.peak_allocated(CUDA0) == 70 and counters.peak_allocated(CUDA1) == 5
    assert peak.bytes == 70


def test_a_failing_stage_still_gets_its_peak_and_without_counters_there_is_none():
    counters = FakeCounters()
    meter = PeakMeter(counters)
    with pytest.raises(RuntimeError, match="stage failed"):
        with meter.stage() as peak:
            counters.allocate(25)
            raise RuntimeError("stage failed")
    assert peak.bytes == 25
    with PeakMeter(FakeCounters(available=False)).stage() as none:
        assert none is None


def test_indexed_device_names_a_device_by_type_and_index():
    assert indexed_device("cpu") == torch.device("cpu") and indexed_device(CUDA1) == CUDA1
    assert str(indexed_device("cuda:1")) == "cuda:1"


@pytest.mark.gpu
def test_indexed_device_names_the_current_cuda_device_as_its_tensors_do():
    assert indexed_device("cuda") == torch.empty(0, device="cuda").device
    assert indexed_device(torch.device("cuda")) == torch.device("cuda", torch.cuda.current_device())
