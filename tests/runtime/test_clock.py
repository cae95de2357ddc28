"""Stage instrumentation: a device span's seconds, read after the host has moved on."""

from __future__ import annotations

import time

import pytest
import torch

from loopvq_calib.runtime.clock import DeviceSpan


def test_on_the_cpu_a_span_is_the_hosts_seconds_between_start_and_stop():
    span = DeviceSpan("cpu")
    time.sleep(0.05)
    span.stop()
    time.sleep(0.05)  # after stop: not counted
    assert 0.05 <= span.seconds() < 0.1


@pytest.mark.gpu
def test_on_cuda_a_span_times_the_queued_work_without_stopping_the_host():
    torch.cuda.synchronize()
    span = DeviceSpan("cuda")
    torch.cuda._sleep(500_000_000)  # about a quarter of a second of device work
    span.stop()
    assert not torch.cuda.current_stream().query()  # start and stop did not wait for the device
    seconds = span.seconds()
    assert torch.cuda.current_stream().query() and 0.05 < seconds < 5.0
