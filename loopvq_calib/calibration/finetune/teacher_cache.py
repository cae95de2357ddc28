"""Fine-tuning's teacher outputs kept across epochs (``finetune.cache_teacher``, docs/finetune.md): on the
accelerator for as many sequences as fit and, on CUDA, a second tier in pinned host memory for the others
(:class:`HostTier`), each copied back to the accelerator on a side stream while the step before its use runs.

The cache knows the order in which fine-tuning asks for the sequences (its *plan*, a list of groups: one
training sequence, or one selection batch whose outputs are joined), so it keeps the most asked sequences on
the accelerator and fetches a group's host-kept sequences ahead while the group before it runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from concurrent.futures import Future

import torch

from ...codes.objective import Teacher, teacher
from ...config.schema import FinetuneConfig
from ...runtime.host_memory import HostCopier, host_available, let_go

log = logging.getLogger("loopvq_calib")
Plan = list[list[int]]  # the sequences fine-tuning asks for, in order, in groups asked together

TEACHER_CACHE_BYTES = 2 << 30  # host memory (CPU runs)
TEACHER_CACHE_MARGIN = 0.10  # of a CUDA device's memory, left free beside the first two steps' peak


def cache_capacity(
    per_sequence: int,
    sequences: int,
    total: int,
    *,
    peak_reserved: int,
    device_free: int,
    reserved: int,
    to_come: int = 0,
    margin: float = TEACHER_CACHE_MARGIN,
) -> int:
    """Sequences of ``per_sequence`` bytes (at most ``sequences``) that fit a device of ``total`` bytes beside
    the allocator's ``peak_reserved``, ``to_come`` bytes still to be allocated and a margin of ``margin`` x
    ``total``: the lesser of what the device's size leaves (``total`` - margin - peak - to come) and what it
    has now (``device_free`` + the allocator's ``reserved`` - peak - margin - to come: memory outside the
    allocator, the CUDA context, libraries' workspaces, other processes, is not free)."""
    by_size = total * (1 - margin) - peak_reserved - to_come
    by_device = device_free + reserved - peak_reserved - total * margin - to_come
    return int(min(sequences, max(min(by_size, by_device), 0) // per_sequence))


def autocast(cfg: FinetuneConfig, device: torch.device) -> torch.autocast:
    """Fine-tuning's autocast (teacher and quantized passes alike): bfloat16 when asked, or ``auto`` on CUDA."""
    on = cfg.autocast == "bfloat16" or (cfg.autocast == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)


def ranked(plan: Plan) -> list[int]:
    """The distinct sequences of ``plan``, most asked for first (ties: the first asked for first)."""
    counts = Counter(s for group in plan for s in group)
    first = {s: i for i, s in reversed(list(enumerate(s for group in plan for s in group)))}
    return sorted(counts, key=lambda s: (-counts[s], first[s]))


def prefetch_reserve(plan: Plan, host: set[int]) -> int:
    """Sequences' worth of accelerator memory that host-kept outputs add to what computing them afresh takes:
    while a group runs, the next group's host-kept sequences are fetched ahead; a joined group (several
    sequences) also holds its own fetched copies beside their concatenation (a fresh batch has only the latter)."""
    counts = [len(set(group) & host) for group in plan] + [0]
    return max([(counts[i] if len(g) > 1 else 0) + counts[i + 1] for i, g in enumerate(plan)], default=0)


def split_tiers(plan: Plan, device_room: int, host_room: int) -> tuple[set[int], set[int]]:
    """(sequences kept on the accelerator, sequences kept in host memory) of ``plan``, the most asked for on
    the accelerator: ``device_room`` sequences fit there beside the step, ``host_room`` in host memory. The host
    tier takes accelerator room for its fetched copies (:func:`prefetch_reserve`, at least 1) and is used only
    where that room is there and it keeps more sequences than the room would."""
    order = ranked(plan)
    alone = set(order[:device_room]), set()
    if device_room >= len(order) or host_room <= 0:
        return alone
    reserve = 1
    while reserve <= device_room:
        device = device_room - reserve
        host = set(order[device : device + host_room])
        need = max(prefetch_reserve(plan, host), 1)
        if need <= reserve:
            return (set(order[:device]), host) if len(host) > reserve else alone
        reserve = need
    return alone


def teacher_tensors(fp: Teacher) -> dict[str, torch.Tensor]:
    return {
        "logits": fp.logits,
        **{f"key.{s}": t for s, t in fp.keys.items()},
        **{f"value.{s}": t for s, t in fp.values.items()},
    }


def as_teacher(tensors: dict[str, torch.Tensor]) -> Teacher:
    part = {
        kind: {int(k.split(".")[1]): t for k, t in tensors.items() if k.startswith(kind + ".")}
        for kind in ("key", "value")
    }
    return Teacher(tensors["logits"], part["key"], part["value"])


class HostTier:
    """Teacher outputs in pinned host memory. :meth:`put` copies a sequence's outputs from the accelerator
    behind the current work (a :class:`~loopvq_calib.runtime.host_memory.HostCopier`: its own thread and stream,
    fresh pinned memory per sequence, one copy in flight); :meth:`prefetch` starts copying them back on a side
    stream; :meth:`take` hands them to the current stream (it waits for the copy there, not on the host)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copier = HostCopier(device, depth=1)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.kept: dict[int, Future] = {}  # sequence -> its host tensors (once copied)
        self.ready: dict[int, tuple[dict[str, torch.Tensor], torch.cuda.Event | None]] = {}  # fetched ahead
        self.fetched: list[int] = []  # every sequence fetched, in order

    def put(self, seq: int, fp: Teacher) -> None:
        self.kept[seq] = self.copier.submit(teacher_tensors(fp), seq)

    def prefetch(self, seq: int) -> None:
        """Start copying ``seq``'s outputs to the accelerator (on the side stream) unless under way."""
        if seq in self.ready:
            return
        host = self.kept[seq].result()
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            moved = {k: t.to(self.device, non_blocking=True) for k, t in host.items()}
            done = None
            if self.stream is not None:
                done = torch.cuda.Event()
                done.record(self.stream)
        self.ready[seq] = (moved, done)
        self.fetched.append(seq)

    def take(self, seq: int) -> Teacher:
        """``seq``'s outputs on the accelerator, usable on the current stream."""
        self.prefetch(seq)
        moved, done = self.ready.pop(seq)
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            for t in moved.values():  # made on the side stream, used (and freed) on this one
                t.record_stream(current)
        return as_teacher(moved)

    def keep_only(self, seqs: list[int]) -> None:
        """Drop copies fetched ahead for sequences other than ``seqs`` (the plan was not followed)."""
        for seq in [s for s in self.ready if s not in seqs]:
            del self.ready[seq]


class TeacherCache:
    """Full-precision outputs per sequence, kept across epochs for as many sequences as fit
    (``finetune.cache_teacher``: ``true`` all, ``false`` none, ``auto`` what fits), each kept sequence saving
    one forward per later use. ``plan``: the groups of sequences this process asks for, in order.

    A sequence's size is measured on the first output (logits in the model's output dtype, keys and values in
    the compute dtype). ``auto`` on CPU: the first sequences asked for that fit ``TEACHER_CACHE_BYTES`` of host
    memory. On CUDA: undecided until :meth:`settle` after the second training step (the optimizer's state exists
    by then), then what fits the device memory those steps left unused (:func:`cache_capacity`), and the
    sequences that do not, as far as host memory allows (``host_available``), in pinned host memory
    (:func:`split_tiers`); outputs computed before the decision are not kept."""

    def __init__(self, model: torch.nn.Module, cfg: FinetuneConfig, plan: Plan) -> None:
        self.plan, self.sequences = plan, len(ranked(plan))
        self.per_sequence: int | None = None  # bytes of one sequence's outputs, measured on the first one
        self.capacity: int | None = {"true": self.sequences, "false": 0}.get(cfg.cache_teacher)
        self.model, self.cfg, self.store = model, cfg, {}
        self.tiers: tuple[set[int], set[int]] | None = None  # (device, host) sequences once settled on CUDA
        self.host: HostTier | None = None
        self.group, self.asked = -1, set()  # the plan's group being asked for, and its sequences asked so far
        self.host_seen = 0  # bytes of host memory available when the tiers were last worked out

    @property
    def kept(self) -> int:
        return len(self.store) + (len(self.host.kept) if self.host is not None else 0)

    def settle(self, device: torch.device, to_come: int = 0, peak_floor: int = 0) -> None:
        """Fix an undecided capacity from the peak memory the allocator reserved since the last reset
        (the caller resets it before the first step; ``peak_floor``: a peak measured before a later reset), the
        device's memory outside the allocator now, ``to_come`` bytes still to be allocated, and host memory for
        the sequences left over."""
        tiers = self.tiers_now(device, to_come, peak_floor)
        if tiers is None:
            return
        self.assign(*tiers, device)
        log.info(
            "teacher outputs: keeping %d of %d sequences on %s and %d in pinned host memory (%.1f GB each; "
            "%.1f GB of host memory available, less a tenth of the machine's)",
            len(self.tiers[0]),
            self.sequences,
            device,
            len(self.tiers[1]),
            self.per_sequence / 1e9,
            self.host_seen / 1e9,
        )

    def tiers_now(
        self, device: torch.device, to_come: int = 0, peak_floor: int = 0
    ) -> tuple[set[int], set[int]] | None:
        """The (accelerator, host) sequences :meth:`settle` would keep now (None: the capacity is decided or no
        output measured yet)."""
        if self.capacity is not None or self.per_sequence is None:
            return None
        room = cache_capacity(
            self.per_sequence,
            self.sequences,
            torch.cuda.get_device_properties(device).total_memory,
            peak_reserved=max(torch.cuda.max_memory_reserved(device), peak_floor),
            device_free=torch.cuda.mem_get_info(device)[0],
            reserved=torch.cuda.memory_reserved(device),
            to_come=to_come,
        )
        self.host_seen = max(host_available(), 0)
        return split_tiers(self.plan[self.group + 1 :], room, self.host_seen // self.per_sequence)

    def still_asked(self) -> int:
        """Distinct sequences the plan asks for after the current group."""
        return len(ranked(self.plan[self.group + 1 :]))

    def mark(self) -> tuple[int, set[int]]:
        """Where in the plan the asks are (for :meth:`rewind`)."""
        return self.group, set(self.asked)

    def rewind(self, mark: tuple[int, set[int]]) -> None:
        """Go back to ``mark``: the asks since then are repeated (a step redone)."""
        self.group, self.asked = mark[0], set(mark[1])

    def assign(self, on_device: set[int], in_host: set[int], device: torch.device) -> None:
        """Keep the outputs of ``on_device`` on ``device`` and those of ``in_host`` in pinned host memory."""
        self.tiers, self.capacity = (set(on_device), set(in_host)), len(on_device)
        self.host = HostTier(device) if in_host else None

    def keeps(self, seq: int) -> bool:
        """Whether :meth:`get` of ``seq`` returns kept outputs or keeps the ones it computes."""
        if seq in self.store:
            return True
        if self.tiers is not None:
            return seq in self.tiers[0] or seq in self.tiers[1]
        return self.capacity is not None and len(self.store) < self.capacity

    def get(self, seq: int, ids: torch.Tensor, device: torch.device) -> Teacher:
        group = self._locate(seq)
        if seq in self.store:
            fp = self.store[seq]
        elif self.host is not None and seq in self.host.kept:
            fp = self.host.take(seq)
        else:
            fp = self._compute(seq, ids, device)
        if self.host is not None and group is not None and self.asked >= set(self.plan[group]):
            for s in self.plan[group + 1] if group + 1 < len(self.plan) else []:
                if s in self.host.kept:  # fetched while this group runs
                    self.host.prefetch(s)
        return fp

    def _compute(self, seq: int, ids: torch.Tensor, device: torch.device) -> Teacher:
        with autocast(self.cfg, device):
            fp = teacher(self.model, ids)
        if self.per_sequence is None:
            self.per_sequence = sum(t.numel() * t.element_size() for t in teacher_tensors(fp).values())
            if self.capacity is None and device.type != "cuda":
                self.capacity = min(self.sequences, TEACHER_CACHE_BYTES // self.per_sequence)
        if self.tiers is not None and seq in self.tiers[1]:
            self.host.put(seq, fp)
        elif self.tiers is not None and seq in self.tiers[0]:
            self.store[seq] = fp
        elif self.tiers is None and self.capacity is not None and len(self.store) < self.capacity:
            self.store[seq] = fp
        return fp

    def _locate(self, seq: int) -> int | None:
        """The plan's group this ask belongs to (the current group while it holds ``seq`` not yet asked for,
        else the next group holding it; None: not in the plan), noted as asked for."""
        if 0 <= self.group < len(self.plan) and seq in self.plan[self.group] and seq not in self.asked:
            self.asked.add(seq)
            return self.group
        for g in range(self.group + 1, len(self.plan)):
            if seq in self.plan[g]:
                self.group, self.asked = g, {seq}
                if self.host is not None:
                    self.host.keep_only(self.plan[g])
                return g
        return None

    def release(self) -> None:
        """Let go of the host tier: its copies finished, its pinned memory unpinned and unmapped in a
        background thread (seconds per hundred GB)."""
        if self.host is not None:
            self.host.keep_only([])  # accelerator memory: now
            self.host.copier.finish()
            log.info(
                "teacher outputs: host copies (worker): %s",
                ", ".join(f"{k} {v:.2f} s" for k, v in self.host.copier.seconds.items()),
            )
            held = [self.host]
            self.host = None
            let_go("teacher outputs: host memory", held)
