"""The teacher cache's two tiers: capacity arithmetic, which sequences go where, host-kept outputs equal to
recomputed ones, and the order in which they are fetched ahead (CPU; the CUDA stream path is GPU-marked)."""

from __future__ import annotations

import pytest
import torch

from loopvq_calib.calibration.finetune.teacher_cache import (
    TeacherCache,
    cache_capacity,
    prefetch_reserve,
    ranked,
    split_tiers,
    teacher_tensors,
)
from loopvq_calib.codes.objective import teacher
from loopvq_calib.config.schema import FinetuneConfig


def test_cache_capacity_counts_memory_outside_the_allocator():
    """Capacity in sequences of 1 unit on a device of 100 with a 10 % margin and a reserved peak of 60 (2 to
    come): 28 when the allocator holds all memory in use; 3 fewer when 3 units lie outside it (context, other
    processes: the device reports 3 less free); the device's size still bounds it when it reports more free;
    never below 0 nor above the sequences asked for."""
    assert cache_capacity(1, 50, 100, peak_reserved=60, device_free=40, reserved=60, to_come=2) == 100 - 10 - 60 - 2
    assert cache_capacity(1, 50, 100, peak_reserved=60, device_free=37, reserved=60, to_come=2) == 100 - 10 - 60 - 2 - 3
    assert (
        cache_capacity(1, 50, 100, peak_reserved=60, device_free=30, reserved=50, to_come=2) == 100 - 10 - 60 - 2 - 20
    )
    assert cache_capacity(1, 50, 100, peak_reserved=60, device_free=90, reserved=60, to_come=2) == 28
    assert cache_capacity(2, 50, 100, peak_reserved=60, device_free=37, reserved=60, to_come=2) == 12  # 25 units
    assert cache_capacity(1, 5, 100, peak_reserved=60, device_free=40, reserved=60) == 5
    assert cache_capacity(1, 5, 100, peak_reserved=95, device_free=5, reserved=95) == 0


def test_tiers_by_hand():
    """The Huginn-3.5B shape in small: selection batches [7, 8] after every 2 training steps; the selection
    sequences are asked for most and go on the device; the host tier costs one sequence of device room (the
    next group's fetch) or more where a joined selection batch holds host-kept sequences; it is used only
    where it keeps more than it costs."""
    plan = [[7, 8], [1], [2], [7, 8], [3], [1], [7, 8], [2], [3], [7, 8]]
    assert ranked(plan) == [7, 8, 1, 2, 3]
    assert prefetch_reserve(plan, {1, 2, 3}) == 1
    assert prefetch_reserve(plan, {8, 1, 2, 3}) == 2  # [7, 8] holds its fetched 8 while [3]'s copy comes
    assert prefetch_reserve(plan, set()) == 0
    assert split_tiers(plan, 10, 0) == ({7, 8, 1, 2, 3}, set())  # all fit the device
    assert split_tiers(plan, 3, 10) == ({7, 8}, {1, 2, 3})  # one device slot for the fetched copy
    assert split_tiers(plan, 3, 0) == ({7, 8, 1}, set())  # no host memory
    assert split_tiers(plan, 3, 1) == ({7, 8, 1}, set())  # 1 host slot costs 1 device slot: no gain
    assert split_tiers(plan, 4, 10) == ({7, 8, 1}, {2, 3})  # 4 - 1 device slots
    # 2 - 1 device slots leave 8 in the host tier: [7, 8] would hold its fetched 8 and the next group's copy
    assert split_tiers(plan, 2, 10) == ({7, 8}, set())
    assert split_tiers(plan, 0, 10) == (set(), set())  # no room for a fetched copy


def _tiny():
    from conftest import make_tiny_ouro

    model = make_tiny_ouro()
    ids = torch.randint(0, 4096, (4, 24), generator=torch.Generator().manual_seed(3))
    return model, ids


def _follow(cache: TeacherCache, plan, ids, device, reference):
    """Ask for every group of ``plan`` in order; every answer equals ``reference`` of its sequence bit for bit
    (a sequence without one: its first answer)."""
    for group in plan:
        for seq in group:
            fp = cache.get(seq, ids[seq : seq + 1].to(device), device)
            got = {k: t.cpu() for k, t in teacher_tensors(fp).items()}
            assert all(t.device.type == device.type for t in teacher_tensors(fp).values())
            want = reference.setdefault(seq, {k: t.clone() for k, t in got.items()})
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got), seq


def test_host_tier_values_equal_recomputed_and_are_fetched_ahead():
    """Sequences kept in the host tier (here on a CPU device: the same bookkeeping, synchronous copies) give
    the recomputed outputs; each group's host-kept sequences are fetched when the group before it has been
    asked for in full; an ask further on in the plan drops what was fetched ahead for the group skipped."""
    model, ids = _tiny()
    cpu = torch.device("cpu")
    reference = {
        s: {k: t.clone() for k, t in teacher_tensors(teacher(model, ids[s : s + 1])).items()} for s in range(4)
    }
    plan = [[0], [1], [0], [1, 2], [3], [0], [2]]
    cache = TeacherCache(model, FinetuneConfig(cache_teacher="auto"), plan)
    cache.assign({3}, {0, 1, 2}, cpu)
    _follow(cache, plan[:5], ids, cpu, reference)
    assert cache.host.fetched == [0, 1, 0] and list(cache.host.ready) == [0]  # 0 for the group after [3]
    _follow(cache, [[2]], ids, cpu, reference)  # [0] skipped
    assert cache.host.fetched == [0, 1, 0, 2] and cache.host.ready == {}
    assert cache.kept == 4 and sorted(cache.store) == [3] and sorted(cache.host.kept) == [0, 1, 2]
    cache.release()
    assert cache.host is None


def test_cpu_auto_keeps_the_first_sequences_without_tiers():
    """On CPU ``auto`` keeps the first sequences asked for, as far as ``TEACHER_CACHE_BYTES`` goes, with no host
    tier (``settle`` is CUDA's)."""
    model, ids = _tiny()
    cache = TeacherCache(model, FinetuneConfig(cache_teacher="auto"), [[0], [1], [2], [3]])
    for s in range(4):
        cache.get(s, ids[s : s + 1], torch.device("cpu"))
    assert cache.capacity == 4 and cache.tiers is None and cache.host is None and cache.kept == 4


@pytest.mark.gpu
def test_host_tier_on_cuda_fetches_on_a_side_stream():
    """On CUDA the host tier's outputs sit in pinned memory and come back, fetched ahead on a side stream, bit
    for bit as first computed; each copy is ordered before its use on the current stream."""
    model, ids = _tiny()
    cuda = torch.device("cuda")
    model = model.to(cuda)
    plan = [[0], [1], [2], [0, 3], [1], [2], [0, 3], [1], [2]]
    cache = TeacherCache(model, FinetuneConfig(cache_teacher="auto"), plan)
    cache.assign({0, 3}, {1, 2}, cuda)
    _follow(cache, plan, ids, cuda, {})
    assert cache.host.fetched == [1, 2, 1, 2] and sorted(cache.store) == [0, 3]
    assert all(t.is_pinned() for f in cache.host.kept.values() for t in f.result().values())
    torch.cuda.synchronize()
    cache.release()
