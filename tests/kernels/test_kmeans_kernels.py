"""The fused Triton k-means kernels against float64 numpy references and the torch k-means++ draws, and
their compilation for the GPUs we target.

The kernels run on a CUDA GPU, or on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1`` with
triton installed). The compilation test needs triton (with its bundled ptxas) but no GPU, and does not run
under the interpreter. Without triton everything here is skipped. tests/calibration/kmeans/test_kmeans_solvers.py
and test_kmeans_init.py run the Lloyd and init behaviour tests on this backend too."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import KERNEL_DEVICE as DEVICE, needs_triton_kernels as needs_kernels

from loopvq_calib.calibration.kmeans.seeding import _draw_one, kmeans_pp_init
from loopvq_calib.kernels import backends, kmeans as kmeans_triton

needs_compiler = pytest.mark.skipif(
    backends.triton is None or os.environ.get("TRITON_INTERPRET") == "1", reason="needs triton, not in interpreter mode"
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@needs_kernels
@pytest.mark.parametrize(
    "k, g", [(32, 16), (20, 12), (6, 4), (300, 16), (256, 32)]
)  # padded K, G; tiles of 32 to 512 points
def test_lloyd_step_on_a_subset_of_problems_matches_numpy(k, g):
    x = torch.randn(4, 300, g, generator=gen(0))
    w = torch.rand(4, 300, generator=gen(1))
    w[:, :20] = 0.0
    rows = torch.tensor([3, 1])
    c = torch.randn(2, k, g, generator=gen(2))
    dev = [t.to(DEVICE) for t in (x, w, c, rows)]
    err, sums, mass = (t.cpu() for t in kmeans_triton.lloyd_step(*dev[:3], rows=dev[3], accumulate=True))
    err_only, none_sums, none_mass = kmeans_triton.lloyd_step(*dev[:3], rows=dev[3], accumulate=False)
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
    fused = kmeans_pp_init(x.to(DEVICE), w.to(DEVICE), 24, generator=gen(5), fused=True).cpu()
    assert torch.equal(fused, kmeans_pp_init(x, w, 24, generator=gen(5)))
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
    kmeans_triton._pp_distance_kernel[(nb,)](
        *dev, n, 0, 1, nb, K=1, G=g, GP=g, BLOCK=kmeans_triton.DRAW_BLOCK, SUB=kmeans_triton.DRAW_SUB
    )
    got = dev[3].cpu()[0]
    torch.testing.assert_close(got, torch.minimum(d2[0], exact), rtol=1e-5, atol=1e-4 * (1 + offset))
    assert bool((got[0::2] < d2[0, 0::2]).all())  # every point with D^2 above its distance moved closer
    assert torch.equal(got[51::2], d2[0, 51::2])  # the others kept their D^2
    sums = (w[0] * got).double().split(kmeans_triton.DRAW_BLOCK)
    torch.testing.assert_close(dev[6].cpu()[0], torch.stack([s.sum() for s in sums]), rtol=1e-6, atol=0)


def _update_d2(x: torch.Tensor, xb: torch.Tensor, w: torch.Tensor, d2: torch.Tensor, chosen: int):
    """One D^2 update of one problem with the centroid x[chosen] (the fp32 points ``x`` and their bfloat16
    copy ``xb`` given separately) -> (D^2, per-block sums of w * D^2), on the CPU."""
    n, g = x.shape
    nb = -(-n // kmeans_triton.DRAW_BLOCK)
    dev = [t[None].to(DEVICE, copy=True) for t in (x, xb, w, d2)]
    out, bsum = torch.zeros(1, 1, g, device=DEVICE), torch.zeros(1, nb, dtype=torch.float64, device=DEVICE)
    kmeans_triton._pp_distance_kernel[(nb,)](
        *dev,
        torch.tensor([chosen], device=DEVICE),
        out,
        bsum,
        n,
        0,
        1,
        nb,
        K=1,
        G=g,
        GP=g,
        BLOCK=kmeans_triton.DRAW_BLOCK,
        SUB=kmeans_triton.DRAW_SUB,
    )
    return dev[3].cpu()[0], bsum.cpu()[0]


@needs_kernels
def test_draw_update_skips_reading_the_points_its_bfloat16_test_puts_far_and_draws_as_the_full_update():
    """Points whose D^2 is far below their distance to the new centroid are not read in fp32: with their
    fp32 rows moved onto the centroid behind an unchanged bfloat16 copy, a kernel reading every point would
    set their D^2 to 0; this one keeps it, and all other points update as before. With consistent inputs
    the D^2 and every draw from it are those of the full update."""
    g, n, chosen = 16, kmeans_triton.DRAW_BLOCK + 300, 5
    x = torch.randn(n, g, generator=gen(14))
    w = torch.rand(n, generator=gen(15))
    exact = ((x - x[chosen]) ** 2).sum(-1)
    idx = torch.arange(n)
    far = (idx % 3 == 0) & (idx != chosen)  # D^2 a quarter of the distance: the new centroid cannot come closer
    d2 = exact * torch.where(far, 0.25, torch.where(idx % 3 == 1, 1.001, 0.999))
    d2[chosen] = float("inf")
    xb = x.to(torch.bfloat16)
    got, bsum = _update_d2(x, xb, w, d2, chosen)
    full = torch.minimum(d2, exact)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[far], d2[far]) and bool((got[idx % 3 == 1] < d2[idx % 3 == 1]).all())
    trap = x.clone()
    trap[far] = x[chosen]  # read in fp32, these would sit at distance 0
    trapped, _ = _update_d2(trap, xb, w, d2, chosen)
    assert torch.equal(trapped[far], d2[far])  # every far point skipped
    assert torch.equal(trapped[~far], got[~far])  # the others read as before
    nb = bsum.numel()
    for u in torch.rand(8, generator=gen(16), dtype=torch.float64).tolist():  # the draws from the updated D^2
        uniform = torch.tensor([u], dtype=torch.float64, device=DEVICE)
        picked = torch.empty(1, dtype=torch.int64, device=DEVICE)
        wsum = torch.nn.functional.pad(w.double(), (0, nb * kmeans_triton.DRAW_BLOCK - n)).view(1, nb, -1).sum(-1)
        dev = [t.to(DEVICE) for t in (w[None], got[None].contiguous(), bsum[None].contiguous(), wsum)]
        kmeans_triton._pp_draw_kernel[(1,)](
            *dev, uniform, picked, n, nb, BLOCK=kmeans_triton.DRAW_BLOCK, NBP=kmeans_triton.draw_tile(n)
        )
        assert picked.item() == _draw_one((w * full)[None], w[None], torch.tensor([u], dtype=torch.float64)).item()


@needs_kernels
def test_fused_draws_equal_the_torch_draws_far_from_the_origin():
    x = torch.randn(2, 700, 16, generator=gen(8)) * 0.5 + 20.0
    x[1, 100:200] = x[1, :100]  # duplicates: zero distances
    w = torch.rand(2, 700, generator=gen(9))
    fused = kmeans_pp_init(x.to(DEVICE), w.to(DEVICE), 64, generator=gen(10), fused=True).cpu()
    assert torch.equal(fused, kmeans_pp_init(x, w, 64, generator=gen(10)))


@needs_kernels
def test_the_kernels_work_here():
    """The probe runs every variant without an error, for a small problem and for the run's points per problem."""
    kmeans_triton.probe(DEVICE, 16, 16)
    kmeans_triton.probe(DEVICE, 16, 4, n=1040)


@pytest.mark.parametrize(
    "n, k, points",
    [
        (0, 256, 256),
        (0, 20, 64),  # no run size: a small problem of a multiple of 16
        (1, 256, 1),  # Triton's n == 1 class: the run's own
        (16_711_680, 256, 256),
        (1_044_480, 256, 256),
        (32_640, 16, 64),  # divisible by 16 (Ouro-1.4B sharing all, groups)
        (522_241, 256, 257),
        (1041, 16, 65),  # neither
        (200, 256, 200),
        (257, 256, 257),
        (65, 16, 65),  # no more than a small problem: the run's own
    ],
)
def test_probe_points_keep_the_runs_specialisation_class_on_a_few_points(n, k, points):
    got = kmeans_triton.probe_points(n, k)
    assert got == points
    if n:
        assert (got == 1) == (n == 1) and (got % 16 == 0) == (n % 16 == 0) and got <= n


def _specialisation(kernel, arg, name: str):
    """Triton's key for one non-constexpr argument: integers by type, == 1 and divisibility by 16, tensors
    by dtype and 16-byte alignment, unless the kernel opts the argument out."""
    flags = getattr(kernel, "kwargs", None) or vars(kernel)  # the interpreter's function, or the JIT one
    specialise = name not in (flags.get("do_not_specialize") or [])
    align = specialise and name not in (flags.get("do_not_specialize_on_alignment") or [])
    if isinstance(arg, torch.Tensor):
        return str(arg.dtype), align and arg.data_ptr() % 16 == 0
    kind = "i32" if -(2**31) <= arg < 2**31 else "i64"
    return kind, specialise and arg == 1, specialise and arg % 16 == 0


class _Recorder:
    """Stands in for a kernel: records each launch's variant (constexprs and argument specialisations) and
    its n in ``sink["into"]``, then launches the kernel."""

    def __init__(self, kernel, sink: dict):
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            names = self.kernel.arg_names
            self.sink["into"].add(
                (
                    self.kernel.__name__,
                    tuple(sorted(constexprs.items())),
                    tuple(_specialisation(self.kernel, a, names[i]) for i, a in enumerate(args)),
                )
            )
            if "n" in names:
                self.sink["into"].add(("n", args[names.index("n")]))
            return self.kernel[grid](*args, **constexprs)

        return launch


def _record(monkeypatch) -> dict:
    sink = {"into": set()}
    for name in ("_lloyd_kernel", "_pp_distance_kernel", "_pp_draw_kernel"):
        monkeypatch.setattr(kmeans_triton, name, _Recorder(getattr(kmeans_triton, name), sink))
    return sink


@needs_kernels
@pytest.mark.parametrize("n", [3000, 2064])  # 3 draw blocks (a 4-block tile), n not / divisible by 16
def test_the_probe_launches_on_a_few_points_every_kernel_variant_the_stage_launches(monkeypatch, n):
    """What the stage launches for problems of n points (an odd count of problems: the uniforms' rows
    alternate in alignment) was all compiled by the probe, which ran on probe_points(n, k) points."""
    from loopvq_calib.calibration.kmeans.solvers import weighted_kmeans
    from loopvq_calib.config.schema import KMeansConfig

    k, g = 16, 8
    sink = _record(monkeypatch)
    probe = sink["into"]
    kmeans_triton.probe(DEVICE, k, g, n=n)
    stage = sink["into"] = set()
    x = torch.randn(3, n, g, generator=gen(11)).to(DEVICE)
    w = torch.rand(3, n, generator=gen(12)).to(DEVICE)
    init = kmeans_pp_init(x, w, k, generator=gen(13), fused=True)
    weighted_kmeans(x, w, init, cfg=KMeansConfig(iterations=3, tolerance=0.0), backend="triton", device=DEVICE)
    probe_variants = {v for v in probe if v[0] != "n"}
    assert {v[1] for v in probe if v[0] == "n"} == {kmeans_triton.probe_points(n, k)}
    assert {v[1] for v in stage if v[0] == "n"} == {n}
    assert {v[0] for v in stage if v[0] != "n"} == {"_lloyd_kernel", "_pp_distance_kernel", "_pp_draw_kernel"}
    assert {v for v in stage if v[0] != "n"} <= probe_variants


def test_the_specialisation_model_is_tritons():
    """_specialisation above against Triton's own (where this Triton exposes it)."""
    libtriton = pytest.importorskip("triton._C.libtriton")
    if not hasattr(libtriton, "native_specialize_impl"):
        pytest.skip("this Triton does not expose native_specialize_impl")
    from triton.backends.compiler import BaseBackend

    class Plain:  # specialises everything
        kwargs = {}

    t = torch.zeros(8)
    for arg in (1, 2, 16, 17, 2**31 - 16, 2**31, t, t[1:], t.double()):
        want = libtriton.native_specialize_impl(BaseBackend, arg, False, True, True)
        got = _specialisation(Plain, arg, "a")
        if isinstance(arg, torch.Tensor):
            assert want == ("*" + {"torch.float32": "fp32", "torch.float64": "fp64"}[got[0]], "D" if got[1] else "")
        else:
            assert want == (("constexpr", 1) if got[1] else (got[0], "D" if got[2] else ""))


def test_the_probe_gives_its_gpu_memory_back(monkeypatch):
    """The probe empties the CUDA caching allocator after it ran (also when it failed), so the store choice that
    reads free memory next sees what the run has; on other devices it leaves CUDA alone."""
    emptied = []
    monkeypatch.setattr(kmeans_triton, "_run_every_variant", lambda device, k, g, n: None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    kmeans_triton.probe(torch.device("cpu"), 16, 16, n=100)
    assert emptied == []
    kmeans_triton.probe(torch.device("cuda", 0), 16, 16, n=100)
    assert emptied == [True]

    def broken(device, k, g, n):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(kmeans_triton, "_run_every_variant", broken)
    with pytest.raises(RuntimeError, match="out of resources"):
        kmeans_triton.probe(torch.device("cuda", 0), 16, 16)
    assert emptied == [True, True]


def test_a_failed_probe_is_remembered_once_per_key(monkeypatch):
    """The dispatch runs the kernels' probe once per (device, K, G, points); a failure (here a missing compiler)
    is kept as the reason to skip them, not raised."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(kmeans_triton, "_kmeans_pp", broken)  # the probe's first launch
    dispatch = backends.Dispatcher()
    candidate = kmeans_triton.candidate("cpu", (16, 16), points=100)
    for _ in range(2):
        assert dispatch.probe(candidate) == "its probe failed (RuntimeError: Failed to find C compiler)"
    assert len(calls) == 1 and dispatch.probed() == {("kmeans", "cpu", 16, 16, 100): dispatch.probe(candidate)}
    assert dispatch.probe(kmeans_triton.candidate("cpu", (16, 16), points=200)) and len(calls) == 2


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
        return backends.triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})

    lloyd = {
        "x_ptr": "*fp32",
        "w_ptr": "*fp32",
        "c_ptr": "*fp32",
        "rows_ptr": "*i64",
        "err_ptr": "*fp32",
        "sums_ptr": "*fp32",
        "mass_ptr": "*fp32",
        "n": "i32",
        "n_rows": "i32",
        "nb": "i32",
    }
    shapes = [(256, 16), (256, 32), (512, 16), (16, 128), (6, 4)]
    assert all(kmeans_triton.supports(k, g) for k, g in shapes) and not kmeans_triton.supports(512, 32)
    for k, g in shapes:
        out = compile_(
            kmeans_triton._lloyd_kernel,
            lloyd,
            dict(
                K=k,
                G=g,
                KP=backends.pow2(k, 16),
                GP=backends.pow2(g, 16),
                BLOCK=kmeans_triton._lloyd_block(k, g),
                ACCUMULATE=True,
                PRECISION="tf32x3",
            ),
        )
        assert out.asm["cubin"] and out.metadata.shared <= SHARED_MEMORY_LIMIT, (k, g, out.metadata.shared)
    distance = {
        "x_ptr": "*fp32",
        "xb_ptr": "*bf16",
        "w_ptr": "*fp32",
        "d2_ptr": "*fp32",
        "chosen_ptr": "*i64",
        "out_ptr": "*fp32",
        "bsum_ptr": "*fp64",
        "n": "i32",
        "j": "i32",
        "n_problems": "i32",
        "nb": "i32",
    }
    draw = {
        "w_ptr": "*fp32",
        "d2_ptr": "*fp32",
        "bsum_ptr": "*fp64",
        "wsum_ptr": "*fp64",
        "u_ptr": "*fp64",
        "chosen_ptr": "*i64",
        "n": "i32",
        "nb": "i32",
    }
    for g in (16, 32):
        out = compile_(
            kmeans_triton._pp_distance_kernel,
            distance,
            dict(K=256, G=g, GP=g, BLOCK=kmeans_triton.DRAW_BLOCK, SUB=kmeans_triton.DRAW_SUB),
        )
        assert out.metadata.shared <= SHARED_MEMORY_LIMIT
    out = compile_(kmeans_triton._pp_draw_kernel, draw, dict(BLOCK=kmeans_triton.DRAW_BLOCK, NBP=256))
    assert out.asm["cubin"] and out.metadata.shared <= SHARED_MEMORY_LIMIT
