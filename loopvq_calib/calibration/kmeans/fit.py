"""K-means stage: Fisher-weighted codebooks for every (kind, block) layout of a capture.

For each layout the captured vectors (sinks excluded) are gathered into code groups, optionally in
TaSQ's transformed space, weighted by the group's summed empirical Fisher (docs/method.md sections 5 and 6) and
clustered per codebook (sharing: none | heads | groups | all). docs/kmeans.md describes the rules.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ...codes.codec import BlockCodec, TasqTransform, gather_groups
from ...codes.layouts import BlockLayout, codebook_shape, layout_owner, points_per_codebook
from ...codes.quantizer import KVQuantizer
from ...config.schema import KMeansConfig, QuantConfig
from ...models.sites import KVLayout
from ...runtime.clock import DeviceSpan
from ...runtime.processes import SINGLE, DistContext
from ...runtime.streams import SideStream, to_device
from ..capture.reader import CaptureData
from .seeding import INITS, kmeans_pp_init, random_init
from .select import resolve_backend
from .solvers import KMeansResult, mix_seed, weighted_kmeans

__all__ = [
    "KMeansResult",
    "kmeans_pp_init",
    "random_init",
    "weighted_kmeans",
    "resolve_backend",
    "layout_problems",
    "layout_seed",
    "fit_codebooks",
    "shard_tensor_names",
]


def layout_problems(
    x: torch.Tensor,
    fisher: torch.Tensor,
    layout: BlockLayout,
    *,
    transform: TasqTransform | None,
    codebook_size: int,
    sharing: str,
    fisher_weighted: bool = True,
    fisher_tasq_weighted: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K-means problems of one layout: x, fisher [N, T, H, D] -> points [P, M, G], weights [P, M].

    Problem index hc * nc + gc matches codebook [Hc, nc, K, G]; a shared axis pools its points.
    The weight of a group vector is sum F_i over its coordinates (TaSQ: F_i * (sigma / w_i)^2, the
    Fisher of the transformed coordinate), divided by its problem's maximum (all ones when the
    Fisher is off or a problem's maximum is zero). ``fisher_tasq_weighted``: ``fisher`` already is
    F_i / w_i^2 (a TaSQ capture's keys), so only sigma^2 is applied.
    """
    factor = fisher
    if transform is not None:
        transform = transform.on(x.device)
        sigma = transform.sigma(x)
        x = transform.forward(x, sigma)
        scale = sigma.float()[..., None, None]
        factor = fisher * (scale if fisher_tasq_weighted else scale / transform.weight).pow(2)
    elif fisher_tasq_weighted:
        raise ValueError(
            f"{layout.key}: the capture holds TaSQ-weighted key Fisher but the layout has no TaSQ transform"
        )
    hc, nc, _, _ = codebook_shape(layout, codebook_size, sharing)
    n, h = x.shape[0], layout.kv_heads
    groups = layout.num_groups

    def arrange(t: torch.Tensor) -> torch.Tensor:  # [N, H, n, ...] -> [Hc * nc, M, ...]
        t = t.reshape(n, hc, h // hc, nc, groups // nc, *t.shape[3:])
        return t.permute(1, 3, 0, 2, 4, *range(5, t.dim())).reshape(hc * nc, -1, *t.shape[5:])

    index = to_device(layout.groups, x.device)  # once for the points and their weights
    points = arrange(gather_groups(x, index))
    if not fisher_weighted:
        return points, torch.ones(points.shape[:2], device=points.device)
    weights = arrange(gather_groups(factor, index).sum(-1))
    peak = weights.amax(-1, keepdim=True)
    scaled = weights / peak.clamp_min(torch.finfo(peak.dtype).tiny)
    return points, torch.where(peak > 0, scaled, torch.ones_like(weights))


def layout_seed(seed: int, layout: BlockLayout) -> int:
    """Per-layout seed from ``kmeans.seed`` and the layout's key, so a layout's codebooks do not
    depend on which other layouts are fitted or in which order."""
    return mix_seed(seed, zlib.crc32(layout.key.encode()))


def shard_tensor_names(layouts: list[BlockLayout], world: int, tasq: bool = False) -> list[list[str]]:
    """Capture tensors each process reads when ``world`` processes share the layouts as :func:`fit_codebooks`
    (and ``fit_tasq``) do (:func:`~loopvq_calib.codes.layouts.layout_owner`): per process, its layouts' data and
    Fisher, plus the query statistics of its key layouts when ``tasq``."""
    names: list[list[str]] = [[] for _ in range(world)]
    for i, layout in enumerate(layouts):
        kinds = (layout.kind, "fisher_" + layout.kind) + (("qstat",) if tasq and layout.kind == "key" else ())
        names[layout_owner(i, world)] += [f"{kind}.{s}" for kind in kinds for s in layout.sites]
    return names


def _check_enough_points(reader: CaptureData, layout: BlockLayout, tokens: int, *, points: int, k: int) -> None:
    if points < k:
        m = reader.meta
        raise ValueError(
            f"quant.codebook_size {k} needs at least {k} calibration points per codebook, but {layout.key} has "
            f"{points} ({tokens} tokens: data.num_sequences {m['num_sequences']} x (sequence_length "
            f"{m['sequence_length']} - sink_tokens {m['sink_tokens']})); raise data.num_sequences or lower "
            f"quant.codebook_size"
        )


LLOYD_GROUP_BYTES = 4 << 30  # fused path: layouts' points (fp32) solved in one Lloyd loop


@dataclass
class _Pending:
    """A layout seeded and waiting for its Lloyd iterations."""

    layout: BlockLayout
    points: torch.Tensor
    weights: torch.Tensor
    init: torch.Tensor
    seed: int
    transform: TasqTransform | None
    seconds: float  # loading, problems and queueing the seeding (its device time is in ``seeding``)
    seeding: DeviceSpan
    ready: torch.cuda.Event | None  # the end of its problems and seeding on the side stream
    problems: int = 0

    def __post_init__(self) -> None:
        self.problems = self.points.shape[0]


def _join(pending: list[_Pending], name: str) -> torch.Tensor:
    """The ``name`` tensors of ``pending`` joined along problems, each layout's copy let go as soon as it is
    copied (peak: the joined tensor and one layout's, not twice the group)."""
    like = getattr(pending[0], name)
    if len(pending) == 1:
        setattr(pending[0], name, None)
        return like
    joined = like.new_empty((sum(getattr(p, name).shape[0] for p in pending), *like.shape[1:]))
    del like
    row = 0
    for p in pending:
        part = getattr(p, name)
        joined[row : row + part.shape[0]] = part
        row += part.shape[0]
        setattr(p, name, None)
        del part
    return joined


def run_points_per_codebook(
    layouts: list[BlockLayout], num_sequences: int, sequence_length: int, *, sink_tokens: int, sharing: str
) -> int:
    """Group vectors each codebook of a run's ``layouts`` is fitted on (the first layout's: a run's layouts share
    their shape), from its calibration tokens less the sinks; 0 without layouts. The k-means backend's probe
    (:func:`~loopvq_calib.calibration.kmeans.select.resolve_backend`) is sized by it."""
    tokens = num_sequences * (sequence_length - sink_tokens)
    return points_per_codebook(layouts[0], tokens, sharing) if layouts else 0


def fit_codebooks(
    reader: CaptureData,
    layouts: list[BlockLayout],
    transforms: dict[str, TasqTransform],
    *,
    quant: QuantConfig,
    cfg: KMeansConfig,
    kv: KVLayout,
    device: torch.device,
    progress: Callable[[int], Any] | None = None,
    dist: DistContext = SINGLE,
) -> tuple[KVQuantizer, dict]:
    """Fit every layout's codebooks; codebooks are fp32 on the CPU. One layout is in memory at a time, except
    on the fused Triton path, where consecutive layouts of the same problem shape (up to
    ``LLOYD_GROUP_BYTES`` of points) share one Lloyd loop, each seeded alone: the same codebooks as one at
    a time (reseeding draws are keyed by layout seed and problem), with the loop's host cost paid once. There
    a group's Lloyd loop starts once the next group is complete, and the layouts after it are loaded and seeded
    on a second CUDA stream (:class:`~loopvq_calib.runtime.streams.SideStream`) while the loop runs: the seeding fills
    the device while the loop's host steps leave it idle. Up to two groups and a layout are then in memory.

    ``dist`` (several processes sharing the work) fits only the layouts ``layout_owner`` gives this process (
    :func:`loopvq_calib.codes.quantizer.merge_quantizers` joins the parts). Returns the quantizer and a report:
    per layout key the objectives at init and at the end per codebook, Lloyd updates, empty clusters,
    backend, seconds (a shared Lloyd loop's time split evenly over its layouts), ``seconds_init`` (the seeding's
    time on the device, from CUDA events: on the fused path it shares the device with a Lloyd loop; a load from
    the disk waits for the stream it runs on, one from pinned host memory or the device does not); plus totals.
    """
    device = torch.device(device)
    probing = time.perf_counter()
    backend = _pick_backend(reader.meta, layouts, quant=quant, cfg=cfg, device=device)
    probing = time.perf_counter() - probing
    fits = _LayoutFits(reader, transforms, quant=quant, cfg=cfg, backend=backend, device=device, progress=progress)
    queue = _LloydQueue(fused=backend == "triton")
    try:
        for layout in dist.share(layouts):
            queue.add(fits.seed(layout))
            for group in queue.ready():
                fits.solve(group)
        for group in queue.drain():
            fits.solve(group)
    except BaseException:  # the queued copies may still read the capture's pinned host memory: let them finish
        if device.type == "cuda":
            with contextlib.suppress(Exception):  # a failed device raises again here: the first error is the one to see
                torch.cuda.synchronize(device)
        raise
    quantizer = KVQuantizer(
        codecs=fits.codecs,
        method=quant.method,
        codebook_size=quant.codebook_size,
        group_size=quant.group_size,
        steps_per_block=quant.block_steps,
        sharing=quant.codebook_sharing,
        kv=kv,
    )
    totals = {**_totals(fits.per_layout, backend, device), "seconds_backend": probing}
    return quantizer, {"layouts": fits.per_layout, "totals": totals}


def _pick_backend(
    meta: dict[str, Any], layouts: list[BlockLayout], *, quant: QuantConfig, cfg: KMeansConfig, device: torch.device
) -> str:
    """``kmeans.backend`` resolved for this device and the run's problem size."""
    points = run_points_per_codebook(
        layouts,
        meta["num_sequences"],
        meta["sequence_length"],
        sink_tokens=meta["sink_tokens"],
        sharing=quant.codebook_sharing,
    )
    return resolve_backend(cfg.backend, device, (quant.codebook_size, quant.group_size), points=points)


class _LloydQueue:
    """Seeded layouts waiting for their Lloyd loop, in groups, in layout order. On the fused Triton path
    (``fused``) consecutive layouts of one problem shape join a group up to ``LLOYD_GROUP_BYTES`` of points,
    and a group is ready once the group after it is complete (which is then seeded during its loop); otherwise
    every layout is ready as soon as it is seeded."""

    def __init__(self, fused: bool) -> None:
        self.fused = fused
        self.groups: list[list[_Pending]] = []

    def add(self, item: _Pending) -> None:
        """Queue a seeded layout: into the last group when it joins it, else as a new group."""
        last = self.groups[-1] if self.groups else []
        if (
            self.fused
            and last
            and last[0].points.shape[1:] == item.points.shape[1:]
            and (sum(p.points.numel() for p in last) + item.points.numel()) * 4 <= LLOYD_GROUP_BYTES
        ):
            last.append(item)
        else:
            self.groups.append([item])

    def ready(self) -> Iterator[list[_Pending]]:
        """The groups whose Lloyd loop may start now, oldest first."""
        while len(self.groups) > (2 if self.fused else 0):
            yield self.groups.pop(0)

    def drain(self) -> Iterator[list[_Pending]]:
        """Every group left, oldest first (after the last layout)."""
        while self.groups:
            yield self.groups.pop(0)


class _LayoutFits:
    """The two steps of one layout's fit, and their results: :meth:`seed` (load, k-means problems, seeding; on the
    fused path queued on the side stream) and :meth:`solve` (the Lloyd loop of a group of seeded layouts)."""

    def __init__(
        self,
        reader: CaptureData,
        transforms: dict[str, TasqTransform],
        *,
        quant: QuantConfig,
        cfg: KMeansConfig,
        backend: str,
        device: torch.device,
        progress: Callable[[int], Any] | None,
    ) -> None:
        self.reader, self.transforms, self.quant, self.cfg = reader, transforms, quant, cfg
        self.backend, self.device, self.progress = backend, device, progress
        # layout_problems' weights are >= 0 with a positive maximum per problem: no check that waits for the device
        self.init_fn = (
            partial(kmeans_pp_init, fused=backend == "triton", trusted_weights=True)
            if cfg.init == "kmeans++"
            else INITS[cfg.init]
        )
        self.side = SideStream(device, enabled=backend == "triton")
        self.codecs: dict[str, BlockCodec] = {}
        self.per_layout: dict[str, dict[str, Any]] = {}

    def seed(self, layout: BlockLayout) -> _Pending:
        """Load ``layout``'s data and Fisher, build its problems and draw their initial codebooks."""
        reader, quant, device = self.reader, self.quant, self.device
        start = time.perf_counter()
        with self.side.queue():  # on the fused path queued ahead on a second stream: it runs during a Lloyd loop
            x = reader.load(layout.kind, layout.sites, device=device, non_blocking=True)
            fisher = reader.load("fisher_" + layout.kind, layout.sites, device=device, non_blocking=True)
            transform = self.transforms.get(layout.key)
            points, weights = layout_problems(
                x,
                fisher,
                layout,
                transform=transform,
                codebook_size=quant.codebook_size,
                sharing=quant.codebook_sharing,
                fisher_weighted=self.cfg.fisher_weighted,
                fisher_tasq_weighted=layout.kind == "key" and reader.tasq_keys,
            )
            tokens = x.shape[0]
            del x, fisher
            _check_enough_points(reader, layout, tokens, points=points.shape[1], k=quant.codebook_size)
            seed = layout_seed(self.cfg.seed, layout)
            seeding = DeviceSpan(device)  # read in solve(): the next layout's work queues behind the draws
            init = self.init_fn(points, weights, quant.codebook_size, generator=torch.Generator().manual_seed(seed))
            seeding.stop()
        return _Pending(
            layout, points, weights, init, seed, transform, time.perf_counter() - start, seeding, self.side.mark()
        )

    def solve(self, pending: list[_Pending]) -> None:
        """One Lloyd loop over the joined problems of ``pending``; each layout's codec and report entry."""
        quant = self.quant
        start = time.perf_counter()
        for p in pending:
            self.side.take(p.ready, p.points, p.weights, p.init)
        keys = [(p.seed, q) for p in pending for q in range(p.points.shape[0])]
        points, weights, init = (_join(pending, name) for name in ("points", "weights", "init"))
        result = weighted_kmeans(
            points,
            weights,
            init,
            cfg=self.cfg,
            backend=self.backend,
            device=self.device,
            seed=pending[0].seed,
            problem_keys=keys,
        )  # faiss: one layout
        share = (time.perf_counter() - start) / len(pending)
        first = 0
        for p in pending:
            rows = slice(first, first + p.problems)
            first = rows.stop
            shape = codebook_shape(p.layout, quant.codebook_size, quant.codebook_sharing)
            self.codecs[p.layout.key] = BlockCodec(
                p.layout, result.centroids[rows].reshape(shape).contiguous(), p.transform
            )
            self.per_layout[p.layout.key] = {
                "objective_init": result.objective_init[rows].tolist(),
                "objective_final": result.objective_final[rows].tolist(),
                "iterations": result.iterations[rows].tolist(),
                "empty_clusters": int(result.empty_clusters[rows].sum()),
                "points_per_codebook": int(points.shape[1]),
                "backend": self.backend,
                "seconds": p.seconds + share,
                "seconds_init": p.seeding.seconds(),
            }
            if self.progress:
                self.progress(1)


def _totals(per_layout: dict[str, dict[str, Any]], backend: str, device: torch.device) -> dict[str, Any]:
    inits = [v for r in per_layout.values() for v in r["objective_init"]]
    finals = [v for r in per_layout.values() for v in r["objective_final"]]
    return {
        "layouts": len(per_layout),
        "codebooks": len(finals),
        "objective_init_mean": sum(inits) / max(len(inits), 1),
        "objective_final_mean": sum(finals) / max(len(finals), 1),
        "iterations_max": max((i for r in per_layout.values() for i in r["iterations"]), default=0),
        "empty_clusters": sum(r["empty_clusters"] for r in per_layout.values()),
        "backend": backend,
        "device": str(device),
        "seconds": sum(r["seconds"] for r in per_layout.values()),
        "seconds_init": sum(r["seconds_init"] for r in per_layout.values()),
    }
