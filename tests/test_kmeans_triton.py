"""The fused Triton k-means kernels against float64 numpy references and the torch k-means++ draws, and
their compilation for the GPUs we target.

The kernels run on a CUDA GPU, or on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1`` with
triton installed). The compilation test needs triton (with its bundled ptxas) but no GPU, and does not run
under the interpreter. Without triton everything here is skipped. test_kmeans_backends.py runs the Lloyd
and init behaviour tests on this backend too."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from loopvq_calib import kmeans_triton
from loopvq_calib.kmeans_backends import kmeans_pp_init

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_kernels = pytest.mark.skipif(
    not kmeans_triton.available(DEVICE), reason="needs triton with a CUDA GPU, or TRITON_INTERPRET=1"
)
needs_compiler = pytest.mark.skipif(
    kmeans_triton.triton is None or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs triton, not in interpreter mode",
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@needs_kernels
@pytest.mark.parametrize("k, g", [(32, 16), (20, 12), (6, 4), (300, 16), (256, 32)])  # padded K, G; tiles of 32 to 512 points
def test_lloyd_step_on_a_subset_of_problems_matches_numpy(k, g):
    x = torch.randn(4, 300, g, generator=gen(0))
    w = torch.rand(4, 300, generator=gen(1))
    w[:, :20] = 0.0
    rows = torch.tensor([3, 1])
    c = torch.randn(2, k, g, generator=gen(2))
    dev = [t.to(DEVICE) for t in (x, w, c, rows)]
    err, sums, mass = (t.cpu() for t in kmeans_triton.lloyd_step(*dev, accumulate=True))
    err_only, none_sums, none_mass = kmeans_triton.lloyd_step(*dev, accumulate=False)
    assert none_sums is None and none_mass is None
    for a, p in enumerate(rows.tolist()):
        xp, wp, cp = x[p].double().numpy(), w[p].double().numpy(), c[a].double().numpy()
        d = ((xp[:, None] - cp[None]) ** 2).sum(-1)
        near = d.argmin(-1)
        np.testing.assert_allclose(err[a].item(), (wp * d.min(-1)).sum(), rtol=1e-4)
        np.testing.assert_allclose(err_only[a].item(), (wp * d.min(-1)).sum(), rtol=1e-4)
        np.testing.assert_allclose(mass[a].numpy(), np.bincount(near, weights=wp, minlength=k), rtol=1e-5, atol=1e-6)
        ref = np.stack([(wp[near == r, None] * xp[near == r]).sum(0) for r in range(k)])
        np.testing.assert_allclose(sums[a].numpy(), ref, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_fused_kmeans_pp_makes_the_torch_draws():
    """Same uniforms, same rules: the fused draws pick the same points as the torch draws, including
    blocks of zero weight, a problem longer than one draw block and points past the last full block."""
    n = kmeans_triton.DRAW_BLOCK * 2 + 37
    x = torch.randn(3, n, 8, generator=gen(3))
    w = torch.rand(3, n, generator=gen(4))
    w[0, : kmeans_triton.DRAW_BLOCK] = 0.0  # the whole first block has no mass
    w[1, -50:] = 0.0
    fused = kmeans_pp_init(x.to(DEVICE), w.to(DEVICE), 24, gen(5), fused=True).cpu()
    assert torch.equal(fused, kmeans_pp_init(x, w, 24, gen(5)))
    assert not (fused[0, :, None] == x[0, None, : kmeans_triton.DRAW_BLOCK]).all(-1).any()


@needs_kernels
@pytest.mark.parametrize("offset", [0.0, 300.0])  # far from the origin, the bfloat16 copy's error dwarfs D^2
def test_draw_update_skips_only_points_the_new_centroid_cannot_come_closer_to(offset):
    """One D^2 update against the full fp32 pass: points whose D^2 sits just above or just below their
    distance to the new centroid, near and far from it, all end with min(D^2, ||x - c||^2)."""
    g, n = 16, kmeans_triton.DRAW_BLOCK + 300
    x = torch.randn(1, n, g, generator=gen(6)) + offset
    w = torch.rand(1, n, generator=gen(7))
    chosen = torch.tensor([5])
    exact = ((x[0] - x[0, 5]) ** 2).sum(-1)
    factor = torch.where(torch.arange(n) % 2 == 0, 1.001, 0.999)  # half just above, half just below
    d2 = (exact * factor)[None].contiguous()
    d2[0, :50] = float("inf")
    nb = -(-n // kmeans_triton.DRAW_BLOCK)
    out, bsum = torch.zeros(1, 1, g), torch.zeros(1, nb, dtype=torch.float64)
    dev = [t.to(DEVICE, copy=True) for t in (x, x.to(torch.bfloat16), w, d2, chosen, out, bsum)]
    kmeans_triton._pp_distance_kernel[(nb,)](*dev, n, 0, 1, nb, K=1, G=g, GP=g, BLOCK=kmeans_triton.DRAW_BLOCK,
                                             SUB=kmeans_triton.DRAW_SUB)
    got = dev[3].cpu()[0]
    torch.testing.assert_close(got, torch.minimum(d2[0], exact), rtol=1e-5, atol=1e-4 * (1 + offset))
    assert bool((got[0::2] < d2[0, 0::2]).all())  # every point with D^2 above its distance moved closer
    assert torch.equal(got[51::2], d2[0, 51::2])  # the others kept their D^2
    sums = (w[0] * got).double().split(kmeans_triton.DRAW_BLOCK)
    torch.testing.assert_close(dev[6].cpu()[0], torch.stack([s.sum() for s in sums]), rtol=1e-6, atol=0)


@needs_kernels
def test_fused_draws_equal_the_torch_draws_far_from_the_origin():
    x = torch.randn(2, 700, 16, generator=gen(8)) * 0.5 + 20.0
    x[1, 100:200] = x[1, :100]  # duplicates: zero distances
    w = torch.rand(2, 700, generator=gen(9))
    fused = kmeans_pp_init(x.to(DEVICE), w.to(DEVICE), 64, gen(10), fused=True).cpu()
    assert torch.equal(fused, kmeans_pp_init(x, w, 64, gen(10)))


@needs_kernels
def test_the_kernels_work_here():
    kmeans_triton.works.cache_clear()
    assert kmeans_triton.works(str(DEVICE)) and kmeans_triton.works(str(DEVICE), 16, 4, 1040)  # the run's points per problem


@needs_kernels
def test_available_needs_triton_and_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert kmeans_triton.available("cuda") and not kmeans_triton.available("cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 0))
    assert not kmeans_triton.available("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kmeans_triton.available("cpu")
    monkeypatch.setattr(kmeans_triton, "triton", None)
    assert not kmeans_triton.available("cuda")


SHARED_MEMORY_LIMIT = 99 * 1024  # per block on sm_86 / sm_89 cards, the smallest of the targets below


@needs_compiler
@pytest.mark.slow  # about 7 s of compilation each
@pytest.mark.parametrize("capability", [80, 89, 90])  # A100, RTX 6000 Ada / L40S, H100 / H200
def test_kernels_compile_within_shared_memory_for_every_supported_tile(capability):
    """Every kernel compiles to a cubin for the target, for the largest codebooks :func:`supports` takes
    and the shipped shapes, with a program's shared memory under the smallest limit of these GPUs."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_(fn, types: dict, constants: dict):
        signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
        constexprs = {(fn.arg_names.index(name),): value for name, value in constants.items()}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        return kmeans_triton.triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})

    lloyd = {"x_ptr": "*fp32", "w_ptr": "*fp32", "c_ptr": "*fp32", "rows_ptr": "*i64", "err_ptr": "*fp32",
             "sums_ptr": "*fp32", "mass_ptr": "*fp32", "n": "i32", "n_rows": "i32", "nb": "i32"}
    shapes = [(256, 16), (256, 32), (512, 16), (16, 128), (6, 4)]
    assert all(kmeans_triton.supports(k, g) for k, g in shapes) and not kmeans_triton.supports(512, 32)
    for k, g in shapes:
        out = compile_(kmeans_triton._lloyd_kernel, lloyd, dict(
            K=k, G=g, KP=kmeans_triton._pow2(k, 16), GP=kmeans_triton._pow2(g, 16), BLOCK=kmeans_triton._lloyd_block(k, g),
            ACCUMULATE=True, PRECISION="tf32x3"))
        assert out.asm["cubin"] and out.metadata.shared <= SHARED_MEMORY_LIMIT, (k, g, out.metadata.shared)
    distance = {"x_ptr": "*fp32", "xb_ptr": "*bf16", "w_ptr": "*fp32", "d2_ptr": "*fp32", "chosen_ptr": "*i64", "out_ptr": "*fp32",
                "bsum_ptr": "*fp64", "n": "i32", "j": "i32", "n_problems": "i32", "nb": "i32"}
    draw = {"w_ptr": "*fp32", "d2_ptr": "*fp32", "bsum_ptr": "*fp64", "wsum_ptr": "*fp64", "u_ptr": "*fp64",
            "chosen_ptr": "*i64", "n": "i32", "nb": "i32"}
    for g in (16, 32):
        out = compile_(kmeans_triton._pp_distance_kernel, distance, dict(K=256, G=g, GP=g, BLOCK=kmeans_triton.DRAW_BLOCK,
                                                                        SUB=kmeans_triton.DRAW_SUB))
        assert out.metadata.shared <= SHARED_MEMORY_LIMIT
    out = compile_(kmeans_triton._pp_draw_kernel, draw, dict(BLOCK=kmeans_triton.DRAW_BLOCK, NBP=256))
    assert out.asm["cubin"] and out.metadata.shared <= SHARED_MEMORY_LIMIT
