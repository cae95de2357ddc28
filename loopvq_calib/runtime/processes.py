"""The processes of a run: one :class:`DistContext` (rank, world, device, collective helpers) made once per
run and passed explicitly to every stage that shares work, instead of each reading process globals.

Under ``accelerate launch`` the processes talk over NCCL (GPUs) or gloo (CPU); a single process needs no
process group and every helper is then a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist
from accelerate import PartialState

from .devices import indexed_device

T = TypeVar("T")


@dataclass(frozen=True)
class DistContext:
    """This process's place among ``world`` processes; work item ``i`` belongs to process ``i % world``."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is not one of the {self.world} processes")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def owns(self, index: int) -> bool:
        """Whether item ``index`` (a sequence, a selection sequence, a layout) is this process's."""
        return index % self.world == self.rank

    def share(self, items: Sequence[T]) -> list[T]:
        """The items of ``items`` at the positions this process owns (its share of a list split by position)."""
        return [item for n, item in enumerate(items) if self.owns(n)]

    def mine(self, count: int) -> list[int]:
        """The items of ``range(count)`` this process owns."""
        return [i for i in range(count) if self.owns(i)]

    def barrier(self) -> None:
        """Wait until every process reaches this point."""
        if self.world > 1:
            dist.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` in place over the processes; returns it."""
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def transfer_device(self) -> torch.device:
        """Where tensors go for a collective: this process's GPU under NCCL, the CPU under gloo."""
        if self.world > 1 and dist.get_backend() == "nccl":
            return indexed_device("cuda")
        return torch.device("cpu")


SINGLE = DistContext()


def end_processes() -> None:
    """Leave the process group this process joined under ``accelerate launch`` (nothing for a single process):
    at the end of a command, so that no group is left for the interpreter's exit to tear down."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def start_processes(device_setting: str) -> DistContext:
    """The context of this process: accelerate's process state (which joins the process group under
    ``accelerate launch``; CPU processes, for ``model.device: cpu`` or no CUDA, talk over gloo)."""
    state = PartialState(cpu=device_setting == "cpu" or not torch.cuda.is_available())
    return DistContext(state.process_index, state.num_processes, torch.device(state.device))
