"""share_sequences (calibration/capture/kv.py): after an in-memory capture split between processes, each process
holds the tensors it needs of every sequence and lets go of the pinned slabs of those it dropped (two gloo
processes); a process without a sequence is refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp

from loopvq_calib.calibration.capture.kv import CaptureError, MemoryCapture, share_sequences
from loopvq_calib.runtime import host_memory as hm
from loopvq_calib.runtime.processes import DistContext


def _share_worker(rank: int, world: int, init_file: str, queue) -> None:
    torch_dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    unpinned = []
    pinner = hm.HostPinner(lambda ptr, nbytes: 0, unpinned.append)  # locking succeeds (a CPU has nothing to lock)
    names = ["key.0", "key.1", "fisher_key.0", "value.0"]
    needs = [["key.0", "fisher_key.0"], ["key.1", "value.0"]]
    memory = MemoryCapture()
    memory.copier = hm.HostCopier(torch.device("cpu"), slab_per_tensor=True, pinner=pinner)  # as under 2 processes
    with memory.copier:  # this process's captured sequences, every tensor of each, copied into pinned slabs
        captured = {
            seq: {n: torch.full((3, 2), 10.0 * seq + i) for i, n in enumerate(names)} for seq in range(rank, 5, world)
        }
        futures = {seq: memory.copier.submit(stored, seq) for seq, stored in captured.items()}
        memory.sequences.update({seq: f.result() for seq, f in futures.items()})
    dropped = {t.data_ptr() for stored in memory.sequences.values() for n, t in stored.items() if n not in needs[rank]}
    pinned_after, drop_unused = [], memory.copier.drop_unused

    def recording_drop_unused(seq, stored):  # the slabs still pinned after each call
        freed = drop_unused(seq, stored)
        pinned_after.append(len(memory.copier.pinned))
        return freed

    memory.copier.drop_unused = recording_drop_unused
    share_sequences(memory, needs, DistContext(rank, world), num_sequences=5)
    kept = {memory.sequences[seq][n].data_ptr() for seq in futures for n in needs[rank]}
    pinned = {slab.data_ptr() for slab in memory.copier.pinned}
    queue.put(
        (
            rank,
            (
                {seq: {n: t.tolist() for n, t in d.items()} for seq, d in memory.sequences.items()},
                pinned == kept and len(kept) == 2 * len(futures),
                set(unpinned) == dropped,
                len(unpinned),
                pinned_after,
            ),
        )
    )
    torch_dist.destroy_process_group()


def test_share_sequences_gives_each_process_its_tensors_of_every_sequence(tmp_path):
    """Two gloo processes, 5 sequences captured 3 + 2 (through the host copier, one pinned slab per tensor):
    afterwards each holds exactly the tensors it needs of all 5 sequences, with the capturing process's
    values, and the slabs of the tensors it dropped are unpinned and let go as each sequence is sent: only its
    kept ones stay pinned."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_share_worker, args=(r, 2, str(tmp_path / "init"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    index = {"key.0": 0, "key.1": 1, "fisher_key.0": 2, "value.0": 3}
    for rank, needs in ((0, ["key.0", "fisher_key.0"]), (1, ["key.1", "value.0"])):
        values, only_kept_pinned, dropped_unpinned, unpinned, pinned_after = results[rank]
        assert sorted(values) == [0, 1, 2, 3, 4]
        for seq, stored in values.items():
            assert sorted(stored) == sorted(needs)
            for n, t in stored.items():
                assert torch.equal(torch.tensor(t), torch.full((3, 2), 10.0 * seq + index[n]))
        assert only_kept_pinned and dropped_unpinned and unpinned == 2 * (3 - rank)  # 2 dropped per own sequence
        own = 3 - rank  # each sequence's 2 unneeded slabs go as soon as it is sent (not all at the end)
        assert pinned_after == [4 * own - 2 * k for k in range(1, own + 1)]


def test_share_sequences_needs_a_sequence_per_process():
    with pytest.raises(
        CaptureError, match="process 1 captured no sequence: data.num_sequences 1 is below the 2 processes"
    ):
        share_sequences(MemoryCapture(), [[], []], DistContext(1, 2), num_sequences=1)
