"""Host-to-device copies that are queued behind the device's work instead of waiting for it."""

from __future__ import annotations

import pytest
import torch

from loopvq_calib.transfer import to_device


def test_on_the_cpu_a_tensor_is_returned_as_it_is():
    t = torch.arange(6)
    assert to_device(t, "cpu") is t and to_device(t, torch.device("cpu")) is t


@pytest.mark.gpu
def test_a_copy_to_the_gpu_is_queued_behind_running_work_where_a_pageable_copy_waits_for_it():
    t = torch.randn(1000, dtype=torch.float64)
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # about a quarter of a second of device work
    queued = to_device(t, "cuda")
    assert not stream.query()  # returned while the device is still busy
    torch.cuda._sleep(500_000_000)
    waited = t.to("cuda")  # pageable: CUDA runs the copy only once the stream is idle
    assert stream.query()
    assert queued.device.type == "cuda" and torch.equal(queued.cpu(), t) and torch.equal(waited.cpu(), t)
