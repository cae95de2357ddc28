"""The run's process context: ownership of work items, its checks, and the collectives over two real gloo
processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from loopvq_calib.runtime.processes import SINGLE, DistContext, end_processes, start_processes


def test_one_process_owns_everything_and_its_collectives_are_no_ops():
    assert SINGLE.is_main and SINGLE.world == 1 and SINGLE.mine(4) == [0, 1, 2, 3]
    t = torch.tensor([1.0, 2.0])
    assert SINGLE.all_reduce_sum(t) is t and t.tolist() == [1.0, 2.0]
    SINGLE.barrier()
    assert SINGLE.transfer_device() == torch.device("cpu")
    ctx = start_processes("cpu")  # no process group: this process alone
    assert (ctx.rank, ctx.world, ctx.device) == (0, 1, torch.device("cpu"))


def test_items_go_round_robin_and_a_bad_rank_is_refused():
    second = DistContext(1, 3)
    assert second.mine(8) == [1, 4, 7] and not second.is_main and second.owns(4) and not second.owns(3)
    assert sorted(i for r in range(3) for i in DistContext(r, 3).mine(8)) == list(range(8))
    items = ["s3", "s9", "s1", "s4", "s0"]  # a share is taken by position, whatever the items are
    assert second.share(items) == ["s9", "s0"] and SINGLE.share(items) == items
    assert sorted(x for r in range(3) for x in DistContext(r, 3).share(items)) == sorted(items)
    with pytest.raises(ValueError, match="rank 3 is not one of the 2 processes"):
        DistContext(3, 2)


def _worker(rank: int, init_file: str, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    ctx = DistContext(rank, 2)
    total = ctx.all_reduce_sum(torch.tensor([rank + 1.0, 10.0 * rank]))
    ctx.barrier()
    queue.put((rank, total.tolist(), str(ctx.transfer_device())))
    dist.destroy_process_group()


def test_two_gloo_processes_sum_and_meet():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, f"{tmp}/init", queue)) for r in range(2)]
        for p in procs:
            p.start()
        results = dict((rank, (total, via)) for rank, total, via in (queue.get(timeout=120) for _ in procs))
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    assert results == {0: ([3.0, 10.0], "cpu"), 1: ([3.0, 10.0], "cpu")}


def test_end_processes_leaves_a_joined_group_and_is_a_no_op_without_one(tmp_path):
    """A command ends by leaving the process group it joined (one gloo process here); without a group nothing
    happens, so a single-process run can call it too."""
    end_processes()  # no group: nothing to leave
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    assert dist.is_initialized()
    end_processes()
    assert not dist.is_initialized()
