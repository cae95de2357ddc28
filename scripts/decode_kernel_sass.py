"""Static instruction counts of the CUDA decode kernel's token loop (decode_cuda.kernel_source()), per
launch configuration: builds the kernel with nvcc for sm_90 (the constants decode_cuda passes at Ouro-1.4B's
shapes), disassembles it (cuobjdump + nvdisasm) and counts the SASS instructions of the innermost loop that
stages index rows (LDGSTS) and accumulates packed halves (HFMA2), per token and by opcode; plus ptxas's
registers and spills. No GPU needed: CUDA's nvcc, cuobjdump and nvdisasm on PATH (or --cuobjdump).

    python scripts/decode_kernel_sass.py --out docs/data/decode-kernel-sass-sm90.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loopvq_calib.kernels.decode_cuda import kernel_source  # noqa: E402

# Ouro-1.4B, LoopVQ K 256 G 16 T_c 4, fp16 tables, bf16 activations (decode_cuda.decode_attention_cuda's defines)
OURO = dict(D=128, QG=1, KCB=256, NKC=32, NVC=32, KMIX=0, VT32=0, CHEB=1, HAS_MASK=0, ACT=0, IDXVEC=16)
CONFIGS = {
    "loopvq 16 lanes, fp16 keys, 16 tokens (default)": dict(LPT=16, U=16, WARPS=16, RPB=8, RK=4, RV=4, KG=1, VG=2,
                                                          KT32=0, TASQ=0),
    "loopvq 16 lanes, fp16 keys, 8 tokens": dict(LPT=16, U=8, WARPS=16, RPB=8, RK=4, RV=4, KG=1, VG=2, KT32=0, TASQ=0),
    "loopvq 16 lanes, fp32 keys": dict(LPT=16, U=8, WARPS=16, RPB=2, RK=4, RV=4, KG=1, VG=2, KT32=1, TASQ=0),
    "loopvq 8 lanes, fp16 keys": dict(LPT=8, U=8, WARPS=16, RPB=8, RK=4, RV=4, KG=2, VG=4, KT32=0, TASQ=0),
    "tasq+loopvq 16 lanes, fp32 keys (default)": dict(LPT=16, U=8, WARPS=16, RPB=2, RK=1, RV=4, KG=1, VG=2, KT32=1,
                                                      TASQ=1),
}
INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
BRANCH = re.compile(r"BRA\s.*?0x([0-9a-f]+)")


def build(defines: dict, workdir: Path, cuobjdump: str) -> tuple[str, str]:
    """(SASS text, ptxas report) of the kernel built with ``defines``."""
    src = workdir / "kernel.cu"
    src.write_text("".join(f"#define {k} {v}\n" for k, v in defines.items()) + kernel_source())
    cubin = workdir / "kernel.cubin"
    built = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(cubin), str(src)],
                           capture_output=True, text=True, check=True)
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return sass, built.stderr


def token_loop(sass: str) -> list[str]:
    """The shortest loop body (backward branch) that holds LDGSTS and HFMA2 and no WARPSYNC (the compiler's
    convergent copy of the token loop)."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in map(INSTRUCTION.match, sass.splitlines()) if m]
    where = {a: i for i, (a, _) in enumerate(ins)}
    best: list[str] | None = None
    for i, (a, text) in enumerate(ins):
        m = BRANCH.search(text)
        if m and int(m.group(1), 16) < a:
            body = [t for _, t in ins[where[int(m.group(1), 16)]:i + 1]]
            joined = " ".join(body)
            if "LDGSTS" in joined and "HFMA2" in joined and "WARPSYNC" not in joined:
                best = body if best is None or len(body) < len(best) else best
    if best is None:
        raise RuntimeError("token loop not found in the SASS")
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuobjdump", default="cuobjdump", help="cuobjdump executable (needs nvdisasm beside it or on PATH)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in CONFIGS.items():
            defines = {**OURO, **config}
            sass, report = build(defines, Path(tmp), args.cuobjdump)
            body = token_loop(sass)
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            tokens = 32 // defines["LPT"] * defines["U"]
            regs = re.search(r"Used (\d+) registers", report)
            spill = re.search(r"(\d+) bytes spill stores", report)
            result[name] = {"defines": defines, "loop_instructions": len(body), "tokens_per_iteration": tokens,
                            "instructions_per_token": round(len(body) / tokens, 2), "registers": int(regs.group(1)),
                            "spill_store_bytes": int(spill.group(1)), "opcodes": dict(ops.most_common())}
            print(f"{name}: {len(body)} instructions per {tokens} tokens = {len(body) / tokens:.1f} per token, "
                  f"{regs.group(1)} registers, {spill.group(1)} bytes spilled", flush=True)
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"nvcc": nvcc, "arch": "sm_90", "configs": result}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
