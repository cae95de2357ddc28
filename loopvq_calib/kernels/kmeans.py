"""Fused Triton kernels for the k-means stage on CUDA (``kmeans.backend: triton``, the ``auto`` choice there).

The plain torch path materialises a [problems, points, K] fp32 distance block per Lloyd step and launches
about 17 small kernels per k-means++ draw; both bind it to memory traffic and launch latency
(docs/performance.md). Here:

- :func:`lloyd_step`: one program per (problem, block of points; 64 points at K = 256). The distances to the problem's K
  centroids stay in registers (a tensor-core dot at ``precision``; the default ``tf32x3`` is about fp32
  accurate), the nearest centroid is taken there, and the weighted point and its weight are added to the
  cluster's sums with atomic adds. Grid rows are an index list, so converged problems cost nothing and
  nothing is copied. Atomic adds make the last bits of the sums run-dependent (so does torch's
  ``index_add_`` on CUDA).
- :func:`kmeans_pp`: two kernels per draw. One updates D^2 with the last chosen centroid and writes
  per-block sums of w * D^2 (float64); one per problem picks a block by inverse CDF over the block sums,
  then the point inside it, with the same rules as the torch k-means++ draws (``calibration.kmeans.seeding``).

The kernels also run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``), which is how the tests
check them on a machine without a GPU when triton is installed.
"""

from __future__ import annotations

import torch

from ..runtime.devices import indexed_device
from .backends import Backend, Candidate, pow2, tl, triton

LLOYD_TILE = 16384  # distance-tile elements per program in a Lloyd step (K = 256: 64 points x 256 centroids)
POINT_TILE = 8192  # point-tile elements per program (64 points of G <= 128)
CODEBOOK_TILE = 8192  # K x G entries a program holds (K 256 x G 32: 64 KiB of shared memory, under sm_86/89's 99 KiB)
DRAW_BLOCK = 1024  # points per block of the k-means++ draw
DRAW_SUB = 128  # points per step inside a block of the D^2 update (H200: 67 ms per Ouro-1.4B layout; 1024: 85 ms)
DRAW_WARPS = 4  # warps per program of the D^2 update
LABEL = "the fused Triton kernels"


def candidate(device: torch.device | str, shape: tuple[int, int] | None, *, points: int = 0) -> Candidate:
    """The Triton candidate of the k-means dispatch on ``device`` for codebooks of ``shape`` = (K, G) (None: any
    the kernels take) and ``points`` per problem (0: a small problem): considered by ``auto`` on CUDA only, for
    the shapes :func:`supports` takes; its probe (:func:`probe`) compiles every kernel variant the stage uses."""
    k, g = shape or (16, 16)
    where = torch.device(device)
    if where.type == "cuda" and torch.cuda.is_available():  # named with its index (no CUDA: never probed)
        where = indexed_device(where)
    return Candidate(
        Backend.TRITON,
        LABEL,
        auto=where.type == "cuda",
        unfit=lambda: "" if shape is None else unfit(k, g),
        probe=lambda: probe(where, k, g, n=points),
        probe_key=("kmeans", str(where), k, g, points),
    )


def probe(device: torch.device, k: int, g: int, *, n: int = 0) -> None:
    """Run every kernel variant the k-means stage uses for codebooks of ``k`` x ``g`` and problems of ``n``
    points (0: a small problem) once, on two problems of :func:`probe_points` points; raises where they do not
    compile or run (Triton needs a C compiler and a matching driver at first use). The kernels keep what they
    compiled, so the check costs no extra compilation. On CUDA the probe's memory goes back to the driver, so
    free memory read after it is what the run has."""
    try:
        _run_every_variant(device, k, g, n=n)
    finally:
        if torch.device(device).type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def probe_points(n: int, k: int) -> int:
    """Points per problem for the probe of a run with ``n`` points per problem (0: a small problem) and ``k``
    centroids: the fewest (at least ``k``) that compile the run's kernel variants. The only specialisation
    on n is Triton's on integer arguments: n == 1, n divisible by 16, or neither (n stays below 2^31,
    Triton's other class). The draw's block-sum tile, the one size the host derives from n, the probe
    passes itself (:func:`draw_tile`)."""
    small = 64 * -(-int(k) // 64)  # a multiple of 16
    if n == 0:
        return small
    if n == 1 or n <= small + 1:
        return n
    return small if n % 16 == 0 else small + 1


def draw_tile(n: int) -> int:
    """Block sums a k-means++ draw program holds for problems of ``n`` points (a constexpr of its kernel)."""
    return pow2(triton.cdiv(n, DRAW_BLOCK))


def _run_every_variant(device: torch.device, k: int, g: int, *, n: int) -> None:
    k, g, m = int(k), int(g), probe_points(int(n), int(k))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, m, g, generator=gen).to(device)
    w = torch.rand(2, m, generator=gen).to(device)
    uniforms = torch.rand(k, 2, generator=gen, dtype=torch.float64).to(device)
    c = _kmeans_pp(x, w, k, uniforms=uniforms, tile=draw_tile(int(n) or m))
    for accumulate in (True, False):
        lloyd_step(x, w, c, rows=torch.arange(2, device=device), accumulate=accumulate)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)  # a launch failure surfaces here


def supports(k: int, g: int) -> bool:
    """Whether the kernels take ``k`` centroids of ``g`` dimensions: the codebook tile (both padded to
    powers of two >= 16) holds at most ``CODEBOOK_TILE`` entries, e.g. K 256 x G 32 or K 512 x G 16."""
    return pow2(k, 16) * pow2(g, 16) <= CODEBOOK_TILE


def unfit(k: int, g: int) -> str:
    """Why the kernels do not take codebooks of ``k`` x ``g`` ('' when :func:`supports` them)."""
    if supports(k, g):
        return ""
    return (
        f"quant.codebook_size {k} x group size {g} exceeds the kernels' codebook tile of {CODEBOOK_TILE} "
        "entries x dimensions (each rounded up to a power of two >= 16)"
    )


def _lloyd_block(k: int, g: int) -> int:
    """Points per Lloyd program: the distance tile holds ``LLOYD_TILE`` and the point tile ``POINT_TILE``
    entries (at least 16 points, the smallest dot tile)."""
    return max(16, min(LLOYD_TILE // pow2(k, 16), POINT_TILE // pow2(g, 16)))


if triton is not None:
    # counts that change between calls (active problems, blocks) are not specialised on: no recompilation
    @triton.jit(do_not_specialize=["n_rows", "nb"])
    def _lloyd_kernel(
        x_ptr,
        w_ptr,
        c_ptr,
        rows_ptr,
        err_ptr,
        sums_ptr,
        mass_ptr,
        n,
        n_rows,
        nb,
        K: tl.constexpr,
        G: tl.constexpr,
        KP: tl.constexpr,
        GP: tl.constexpr,
        BLOCK: tl.constexpr,
        ACCUMULATE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # one flat grid axis (2^31 programs; the second axis would cap blocks at 65,535), problems fastest
        a = tl.program_id(0) % n_rows
        b = tl.program_id(0) // n_rows
        p = tl.load(rows_ptr + a).to(tl.int64)
        pts = b * BLOCK + tl.arange(0, BLOCK)
        valid = pts < n
        gg = tl.arange(0, GP)
        kk = tl.arange(0, KP)
        x = tl.load(
            x_ptr + (p * n + pts[:, None]) * G + gg[None, :], mask=valid[:, None] & (gg[None, :] < G), other=0.0
        )
        w = tl.load(w_ptr + p * n + pts, mask=valid, other=0.0)
        c = tl.load(
            c_ptr + (a.to(tl.int64) * K + kk[:, None]) * G + gg[None, :],
            mask=(kk[:, None] < K) & (gg[None, :] < G),
            other=0.0,
        )
        c_sq = tl.where(kk < K, tl.sum(c * c, axis=1), float("inf"))
        d = c_sq[None, :] - 2.0 * tl.dot(x, tl.trans(c), input_precision=PRECISION)
        dmin, idx = tl.min(d, axis=1, return_indices=True, return_indices_tie_break_left=True)
        err = tl.where(valid, w * tl.maximum(dmin + tl.sum(x * x, axis=1), 0.0), 0.0)
        tl.store(err_ptr + a.to(tl.int64) * nb + b, tl.sum(err, axis=0))
        if ACCUMULATE:
            slot = a.to(tl.int64) * K + idx
            tl.atomic_add(
                sums_ptr + slot[:, None] * G + gg[None, :],
                x * w[:, None],
                mask=valid[:, None] & (gg[None, :] < G),
                sem="relaxed",
            )
            tl.atomic_add(mass_ptr + slot, w, mask=valid, sem="relaxed")

    @triton.jit(do_not_specialize=["j", "n_problems", "nb"])
    def _pp_distance_kernel(
        x_ptr,
        xb_ptr,
        w_ptr,
        d2_ptr,
        chosen_ptr,
        out_ptr,
        bsum_ptr,
        n,
        j,
        n_problems,
        nb,
        K: tl.constexpr,
        G: tl.constexpr,
        GP: tl.constexpr,
        BLOCK: tl.constexpr,
        SUB: tl.constexpr,
    ):
        p = (tl.program_id(0) % n_problems).to(tl.int64)  # flat grid, problems fastest (as in the Lloyd kernel)
        b = tl.program_id(0) // n_problems
        gg = tl.arange(0, GP)
        gmask = gg < G
        ch = tl.load(chosen_ptr + p)
        c = tl.load(x_ptr + (p * n + ch) * G + gg, mask=gmask, other=0.0)
        if b == 0:
            tl.store(out_ptr + (p * K + j) * G + gg, c, mask=gmask)
        total = tl.zeros([SUB], dtype=tl.float64)
        for s in tl.static_range(0, BLOCK, SUB):  # sub-blocks keep the point tiles in registers
            pts = b * BLOCK + s + tl.arange(0, SUB)
            valid = pts < n
            offs = (p * n + pts[:, None]) * G + gg[None, :]
            d2 = tl.load(d2_ptr + p * n + pts, mask=valid, other=0.0)
            # the bfloat16 copy bounds ||x - c|| from below: |x - xb| <= 2^-8 |xb| per coordinate (round to
            # nearest), taken as e = 2^-7 ||xb||, so ||x - c|| >= a - e with a = ||xb - c||. Since
            # (s + e)^2 <= (1 + 1/16) s^2 + 17 e^2, a^2 above that with s^2 = D^2 (1 + 1e-4, far above fp32
            # rounding) means x cannot come closer, and its fp32 row is not read
            xb = tl.load(xb_ptr + offs, mask=valid[:, None] & gmask[None, :], other=0.0).to(tl.float32)
            db = xb - c[None, :]
            far = tl.sum(db * db, axis=1) > 1.0625 * 1.0001 * d2 + 17.0 * 0.00006103515625 * tl.sum(xb * xb, axis=1)
            near = valid & ~far
            x = tl.load(x_ptr + offs, mask=near[:, None] & gmask[None, :], other=0.0)
            diff = x - c[None, :]
            dn = tl.sum(diff * diff, axis=1)
            closer = near & (dn < d2)
            d2 = tl.where(closer, dn, d2)
            tl.store(d2_ptr + p * n + pts, d2, mask=closer)
            w = tl.load(w_ptr + p * n + pts, mask=valid, other=0.0)
            total += tl.where(valid, w * d2, 0.0).to(tl.float64)
        tl.store(bsum_ptr + p * nb + b, tl.sum(total, axis=0))

    # u_ptr is a row of the [K, P] uniforms: its alignment changes with the draw when P is odd (a scalar load)
    @triton.jit(do_not_specialize=["nb"], do_not_specialize_on_alignment=["u_ptr"])
    def _pp_draw_kernel(
        w_ptr, d2_ptr, bsum_ptr, wsum_ptr, u_ptr, chosen_ptr, n, nb, BLOCK: tl.constexpr, NBP: tl.constexpr
    ):
        p = tl.program_id(0).to(tl.int64)
        blocks = tl.arange(0, NBP)
        bs = tl.load(bsum_ptr + p * nb + blocks, mask=blocks < nb, other=0.0)
        fallback = tl.sum(bs, axis=0) <= 0.0
        bs = tl.where(fallback, tl.load(wsum_ptr + p * nb + blocks, mask=blocks < nb, other=0.0), bs)
        cum = tl.cumsum(bs, axis=0)
        target = tl.load(u_ptr + p) * tl.sum(tl.where(blocks == nb - 1, cum, 0.0), axis=0)
        blk = tl.minimum(tl.sum((cum <= target).to(tl.int32), axis=0), tl.max(tl.where(bs > 0, blocks, -1), axis=0))
        target -= tl.sum(tl.where(blocks == blk - 1, cum, 0.0), axis=0)
        pts = blk * BLOCK + tl.arange(0, BLOCK)
        valid = pts < n
        w = tl.load(w_ptr + p * n + pts, mask=valid, other=0.0)
        d2 = tl.load(d2_ptr + p * n + pts, mask=valid, other=0.0)
        prob = tl.where(valid, tl.where(fallback, w, w * d2), 0.0).to(tl.float64)
        local = tl.cumsum(prob, axis=0)
        last = tl.max(tl.where(prob > 0, tl.arange(0, BLOCK), -1), axis=0)
        idx = tl.minimum(tl.sum((local <= target).to(tl.int32), axis=0), last)
        tl.store(chosen_ptr + p, (blk * BLOCK + idx).to(tl.int64))


def lloyd_step(
    x: torch.Tensor,
    w: torch.Tensor,
    c: torch.Tensor,
    *,
    rows: torch.Tensor,
    accumulate: bool,
    precision: str = "tf32x3",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Assign the points of problems ``rows`` [A] to their nearest centroid in ``c`` [A, K, G] (row a of c
    belongs to problem rows[a]); x [P, N, G], w [P, N] fp32 contiguous. Returns the weighted squared
    error [A] and, when ``accumulate``, per-cluster weighted sums [A, K, G] and weights [A, K]."""
    _, n, g = x.shape
    a, k = c.shape[0], c.shape[1]
    block = _lloyd_block(k, g)
    nb = triton.cdiv(n, block)
    err = torch.empty(a, nb, device=x.device, dtype=torch.float32)
    sums = torch.zeros(a, k, g, device=x.device, dtype=torch.float32) if accumulate else err
    mass = torch.zeros(a, k, device=x.device, dtype=torch.float32) if accumulate else err
    _lloyd_kernel[(a * nb,)](
        x,
        w,
        c.contiguous(),
        rows,
        err,
        sums,
        mass,
        n,
        a,
        nb,
        K=k,
        G=g,
        KP=pow2(k, 16),
        GP=pow2(g, 16),
        BLOCK=block,
        ACCUMULATE=accumulate,
        PRECISION=precision,
        num_warps=4,
    )
    return (err.sum(1), sums, mass) if accumulate else (err.sum(1), None, None)


def kmeans_pp(x: torch.Tensor, w: torch.Tensor, k: int, *, uniforms: torch.Tensor) -> torch.Tensor:
    """Weighted k-means++ (the rules of the torch ``kmeans_pp_init``) on x [P, N, G], w [P, N] fp32
    contiguous, with the draws' uniforms [K, P] float64 on x's device -> centroids [P, K, G]. A bfloat16
    copy of x lets each D^2 update skip reading the fp32 points the new centroid cannot come closer to
    (an exact test: the same D^2 as updating every point)."""
    return _kmeans_pp(x, w, k, uniforms=uniforms, tile=draw_tile(x.shape[1]))


def _kmeans_pp(x: torch.Tensor, w: torch.Tensor, k: int, *, uniforms: torch.Tensor, tile: int) -> torch.Tensor:
    """:func:`kmeans_pp` with the draw's block-sum ``tile`` given (a power of two, at least the blocks)."""
    p, n, g = x.shape
    nb = triton.cdiv(n, DRAW_BLOCK)
    out = x.new_empty(p, k, g)
    xb = x.to(torch.bfloat16)
    d2 = torch.full((p, n), float("inf"), device=x.device, dtype=torch.float32)
    bsum = torch.zeros(p, nb, device=x.device, dtype=torch.float64)  # all zero: the first draw is ~ w
    wsum = torch.nn.functional.pad(w.double(), (0, nb * DRAW_BLOCK - n)).view(p, nb, DRAW_BLOCK).sum(-1)
    chosen = torch.empty(p, device=x.device, dtype=torch.int64)
    for j in range(k):
        _pp_draw_kernel[(p,)](w, d2, bsum, wsum, uniforms[j], chosen, n, nb, BLOCK=DRAW_BLOCK, NBP=tile, num_warps=4)
        _pp_distance_kernel[(p * nb,)](
            x,
            xb,
            w,
            d2,
            chosen,
            out,
            bsum,
            n,
            j,
            p,
            nb,
            K=k,
            G=g,
            GP=pow2(g),
            BLOCK=DRAW_BLOCK,
            SUB=DRAW_SUB,
            num_warps=DRAW_WARPS,
        )
    return out
