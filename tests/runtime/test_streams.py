"""Host-to-device copies that are queued behind the device's work instead of waiting for it; work queued ahead on a
side stream and handed back."""

from __future__ import annotations

import pytest
import torch

from loopvq_calib.runtime.streams import SideStream, to_device


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


def test_without_cuda_a_side_stream_runs_work_in_place():
    side = SideStream("cpu")
    with side.queue():
        t = torch.arange(4) * 2
    mark = side.mark()
    side.take(mark, t)
    assert side.stream is None and mark is None and t.tolist() == [0, 2, 4, 6]
    assert SideStream("cuda", enabled=False).stream is None  # disabled: no stream even where CUDA exists


@pytest.mark.gpu
def test_side_stream_work_runs_beside_the_current_stream_and_is_handed_back_in_order():
    x = torch.randn(256, 256, dtype=torch.float64).pin_memory()  # copied as it is: no new pinned block below
    before = torch.full((256, 256), 3.0, dtype=torch.float64, device="cuda")
    warm = to_device(x, "cuda") * 3 + before  # the kernels' first launch (CUDA loads them lazily) may wait for it
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    before.mul_(2)  # queued on the current stream before the side stream is made: the side stream waits for it
    side = SideStream("cuda")
    with side.queue():
        assert torch.cuda.current_stream() == side.stream
        torch.cuda._sleep(1_000_000_000)  # about half a second
        y = to_device(x, "cuda") * 3 + before
    mark = side.mark()
    torch.cuda.current_stream().synchronize()  # the current stream's work is done...
    assert not side.stream.query()  # ...while the side stream's still runs: the host queued it without waiting
    side.take(mark, y)
    z = y * 2  # on the current stream, after the side stream's work
    expected = (x * 3 + 6.0) * 2
    torch.testing.assert_close(z.cpu(), expected)
    torch.testing.assert_close(warm.cpu(), x * 3 + 3.0)
