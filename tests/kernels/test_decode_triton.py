"""The Triton decode-attention kernels (kernels/decode_triton.py) compile for the GPUs we target at Ouro's and Huginn's
shapes, within the smallest target's shared memory. Needs triton (with its bundled ptxas) but no GPU, and does
not run under the interpreter (the kernels' outputs: test_decode_attention.py)."""

from __future__ import annotations

import os

import pytest

from loopvq_calib.kernels.kmeans import triton

needs_compiler = pytest.mark.skipif(
    triton is None or os.environ.get("TRITON_INTERPRET") == "1", reason="needs triton, not in interpreter mode"
)
SHARED_MEMORY_LIMIT = 99 * 1024  # per block on sm_86 / sm_89 cards, the smallest of the targets below


@needs_compiler
@pytest.mark.parametrize("capability", [80, 90])
def test_kernels_compile_for_ouro_and_huginn_shapes(capability):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from loopvq_calib.kernels import decode_triton as dk

    def compile_(fn, types: dict, constants: dict):
        signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
        constexprs = {(fn.arg_names.index(name),): value for name, value in constants.items()}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        return triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})

    ptr = {name: "*fp32" for name in dk._split_kernel.arg_names if name.endswith("_ptr")}
    ptr.update(
        q_ptr="*bf16",
        kidx_ptr="*u8",
        vidx_ptr="*u8",
        sig_ptr="*fp16",
        ka_ptr="*fp16",
        kb_ptr="*fp16",
        tv_ptr="*fp16",
        kca_ptr="*i32",
        kcb_ptr="*i32",
        vc_ptr="*i32",
        p0_ptr="*i32",
        fk_ptr="*bf16",
        fv_ptr="*bf16",
        fpos_ptr="*i32",
        fmask_ptr="*i8",
    )
    ints = {
        name: "i32"
        for name in dk._split_kernel.arg_names
        if name.startswith("s_") or name in ("n_batch", "batch_per_program", "n_coded", "n_fp", "split_len")
    }
    for half, d, qg, tasq in ((True, 128, 1, True), (False, 96, 1, False), (True, 128, 4, False)):  # Ouro, Huginn, GQA
        out = compile_(
            dk._split_kernel,
            {**ptr, **ints, "qk_scale": "fp32"},
            dict(H=16, QG=qg, QGP=qg, D=d, K=256, HALF=half, TASQ=tasq, STEP=2, HAS_MASK=True, BLOCK_N=16, DP=128),
        )
        assert out.asm["cubin"] and out.metadata.shared <= SHARED_MEMORY_LIMIT
    out = compile_(
        dk._merge_kernel, {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": "*bf16"}, dict(S=6, SP=8, D=96, DP=128)
    )
    assert out.asm["cubin"]
