"""Time the capture's passes at real model shapes (random bf16 weights, random token ids): a plain forward,
the forward-only query-statistics pass of TaSQ methods (``tasq_stats.query_statistics``, the function the
capture stage calls) at several batch sizes, and the capture step itself (``capture.capture_sequence``:
forward + backward with the Fisher probes, keys' Fisher reduced by TaSQ's weights). One JSON line per
measurement, after one warm-up of each; with --profile also the torch.profiler table (host time by op) of
one query-statistics sequence (and by device time on a GPU). Used for the capture analysis in docs/performance.md.

    python scripts/probe_capture_step.py --model ouro-1.4b --batches 1 4 --profile qstats-profile.txt
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_random_checkpoint import MODELS, frozen_random_model  # noqa: E402

from loopvq_calib.calibration.capture.kv import capture_sequence  # noqa: E402
from loopvq_calib.calibration.tasq.stats import key_weights, query_statistics  # noqa: E402
from loopvq_calib.codes.objective import shared_initial_state  # noqa: E402


def timed(fn, device: torch.device) -> float:
    """Seconds of ``fn()``, the device's queued work included."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="ouro-1.4b")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="batch sizes of the forward-only passes")
    ap.add_argument("--scale-down", type=int, default=1, help="divide widths and layers by this (CPU dry runs)")
    ap.add_argument("--profile", default=None, help="write the profiler table of one query-statistics sequence here")
    args = ap.parse_args()
    model, device = frozen_random_model(args.model, args.scale_down)
    kv = model.kv_layout()
    n = args.sequences
    ids = torch.randint(3, model.config.vocab_size, (n, args.seq_len), generator=torch.Generator().manual_seed(0))
    seqs = list(range(n))

    def forward(batch: int) -> None:
        with torch.no_grad(), shared_initial_state(model):
            for start in range(0, n, batch):
                model(ids[start : start + batch].to(device), use_cache=False)

    def capture() -> None:
        for i in seqs:
            capture_sequence(model, ids[i : i + 1].to(device), kv, seqs=[i], dtype=torch.bfloat16, fisher_channels=1, on_device=True,
                             tasq_weights=weights)

    stats = query_statistics(model, ids[:1], kv, mine=[0], batch_size=1)  # warm-up, and the weights of the capture step
    weights = key_weights({0: stats[0]}, kv, args.seq_len, floor=1e-6, device=device)
    capture_sequence(model, ids[:1].to(device), kv, seqs=[0], dtype=torch.bfloat16, fisher_channels=1, on_device=True, tasq_weights=weights)
    line = {"model": args.model, "seq_len": args.seq_len, "sequences": n,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    for batch in args.batches:
        for what, fn in (("forward", lambda: forward(batch)),
                         ("query_statistics", lambda: query_statistics(model, ids, kv, mine=seqs, batch_size=batch))):
            seconds = timed(fn, device)
            print(json.dumps({**line, "what": what, "batch": batch, "seconds": round(seconds, 3),
                              "per_sequence_s": round(seconds / n, 4)}), flush=True)
    seconds = timed(capture, device)
    print(json.dumps({**line, "what": "capture_step", "batch": 1, "seconds": round(seconds, 3),
                      "per_sequence_s": round(seconds / n, 4)}), flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            query_statistics(model, ids[:1], kv, mine=[0], batch_size=1)
        keys = ["cpu_time_total"] + (["device_time_total"] if device.type == "cuda" else [])
        Path(args.profile).write_text("\n".join(prof.key_averages().table(sort_by=k, row_limit=30) for k in keys))


if __name__ == "__main__":
    main()
