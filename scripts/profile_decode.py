"""One decode-attention call at Ouro-1.4B shapes (LoopVQ, 32k context, batch 8) for a profiler:

    ncu --clock-control none -k regex:loopvq_decode_split -s 2 -c 1 --section SpeedOfLight --section WarpStateStats \
        --section InstructionStats --section MemoryWorkloadAnalysis --section Occupancy \
        python scripts/profile_decode.py

Runs the kernel 3 times (the profiler skips the first two launches, compilation included); ``--triton`` profiles
the Triton kernel instead (``-k regex:_split_kernel``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode as bd  # noqa: E402

from loopvq_calib.serving import decode_attention as da  # noqa: E402


def main() -> None:
    device = torch.device("cuda")
    kc, vc = bd.codecs("loopvq")
    tables = da.step_tables(kc, vc, 2, rope_style="half", device=device, dtype=torch.float16)
    batch, context = 8, 32768
    n = context - bd.SINKS - bd.WINDOW
    gen = torch.Generator(device=device).manual_seed(0)
    idx = [bd.random_indices(batch, n, 32, device, gen) for _ in range(2)]
    coded = da.CodedTokens(idx[0], idx[1], None, n, torch.full((batch,), bd.SINKS, device=device, dtype=torch.int32))
    q = torch.randn(batch, bd.HEADS, bd.D, device=device, dtype=torch.bfloat16, generator=gen)
    fk, fv = (torch.randn(batch, bd.SINKS + bd.WINDOW, bd.KV_HEADS, bd.D, device=device, dtype=torch.bfloat16,
                          generator=gen) for _ in range(2))
    fpos = torch.cat([torch.arange(bd.SINKS), torch.arange(bd.SINKS + n, context)]).to(device)[None].repeat(batch, 1)
    rope = da.RopeTable(bd.D, bd.THETA)
    backend = "triton" if "--triton" in sys.argv[1:] else "cuda"
    for _ in range(3):
        da.decode_attention(q, tables, coded, fp_keys=fk, fp_values=fv, fp_positions=fpos, fp_mask=None, rope=rope, max_position=context, backend=backend)
    torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
