"""Whole-pipeline benchmark at real model shapes with random weights (speed and memory do not depend on
weight values): capture with Fisher -> [TaSQ] -> k-means -> fine-tuning (epochs x train sequences, held-out
selection) -> bundle, on synthetic token ids. Prints one JSON line with per-stage wall time and peak GPU
memory (docs/performance.md has the measured numbers and the commands).

    python scripts/bench_pipeline.py --model ouro-1.4b --method loopvq --bits 0.5
    accelerate launch --multi_gpu --num_processes 2 scripts/bench_pipeline.py --model ouro-2.6b --batch-size 2
    python scripts/bench_pipeline.py --model huginn-3.5b --stages codebooks   # then --stages finetune: two calls
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from loopvq_calib import __version__
from loopvq_calib.capture import CaptureReader, MemoryCapture, MemoryReader, write_meta
from loopvq_calib.config import load_config
from loopvq_calib.data import CalibrationSet
from loopvq_calib.finetune import finetune_codebooks
from loopvq_calib.kmeans import fit_codebooks
from loopvq_calib.codec import BlockCodec
from loopvq_calib.layouts import codebook_shape, plan_layouts
from loopvq_calib.models import HuginnConfig, HuginnForCausalLM, OuroConfig, OuroForCausalLM
from loopvq_calib.models.loading import ModelIdentity
from loopvq_calib.pipeline import capture_for_processes
from loopvq_calib.quantizer import KVQuantizer, load_quantizer, merge_quantizers, save_quantizer

OURO = dict(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=16,
            rope_theta=1e6, total_ut_steps=4, max_position_embeddings=65536)
MODELS = {
    "ouro-1.4b": lambda: OuroForCausalLM(OuroConfig(num_hidden_layers=24, **OURO)),
    "ouro-2.6b": lambda: OuroForCausalLM(OuroConfig(num_hidden_layers=48, **OURO)),
    "huginn-3.5b": lambda: HuginnForCausalLM(HuginnConfig(state_init="zero")),
    "tiny": lambda: OuroForCausalLM(OuroConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=4, head_dim=16)),
}


def build_model(name: str, device: torch.device) -> torch.nn.Module:
    """Real config, random weights, built directly on the device in bf16 (fp32 on CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = MODELS[name]()
    finally:
        torch.set_default_dtype(previous)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.device, self.stages = device, {}

    @contextmanager
    def stage(self, name: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.time()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else None
        self.stages[name] = {"wall_s": round(time.time() - start, 2), "peak_gpu_gib": round(peak, 2) if peak else None}
        print(json.dumps({"stage": name, **self.stages[name]}), file=sys.stderr, flush=True)  # partial results survive a kill


def build_codebooks(model, calib: CalibrationSet, cfg, store: str, work: Path, timer: Timer, device: torch.device,
                    rank: int, world: int, profile: Path | None = None):
    """capture -> [tasq] -> k-means (layouts shared by the processes, parts merged); the capture is released."""
    kv = model.kv_layout()
    with timer.stage("capture"):
        memory = MemoryCapture() if store in ("memory", "device") else None
        capture_for_processes(model, calib, kv, cfg, memory or work / "capture", rank, world,
                              dist.barrier if world > 1 else lambda: None)
        if rank == 0:
            (work / "capture").mkdir(parents=True, exist_ok=True)
            write_meta(work / "capture", calib, kv, cfg.capture, memory)
        if world > 1:
            dist.barrier()
        reader = MemoryReader(memory) if memory else CaptureReader(work / "capture")
    layouts, transforms = plan_layouts(kv, cfg.quant), {}
    if cfg.quant.uses_tasq:  # each process fits the key layouts it will cluster
        with timer.stage("tasq"):
            from loopvq_calib.tasq import fit_tasq

            result = fit_tasq(reader, layouts, kv, cfg.quant, cfg.tasq, shard=(rank, world))
            layouts, transforms = result.layouts, result.transforms
    with timer.stage("kmeans"), profiled(profile, device):  # processes share the layouts, then every process joins the parts
        quantizer, report = fit_codebooks(reader, layouts, transforms, cfg.quant, cfg.kmeans, kv, device,
                                          shard=(rank, world))
        if world > 1:
            save_quantizer(quantizer, _mkdir(work / f"part{rank}"))
            dist.barrier()
            parts = [load_quantizer(work / f"part{r}") for r in range(world)]
            quantizer = merge_quantizers(parts, [lay.key for lay in layouts])
    del reader, memory
    return quantizer, report


@contextmanager
def profiled(path: Path | None, device: torch.device):
    """torch.profiler over the block when ``path`` is given: the operators' table (by device time, then by
    host time) is written there."""
    if path is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        yield
    table = prof.key_averages()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path.write_text(table.table(sort_by=sort, row_limit=30) + "\n" + table.table(sort_by="self_cpu_time_total", row_limit=30))


def random_quantizer(model: torch.nn.Module, quant, device: torch.device) -> KVQuantizer:
    """Codebooks of the method's layouts with random values (for timing fine-tuning without k-means)."""
    kv = model.kv_layout()
    gen = torch.Generator().manual_seed(0)
    codecs = {lay.key: BlockCodec(lay, torch.randn(codebook_shape(lay, quant.codebook_size, quant.codebook_sharing),
                                                   generator=gen).to(device))
              for lay in plan_layouts(kv, quant)}
    return KVQuantizer(codecs=codecs, method=quant.method, codebook_size=quant.codebook_size, group_size=quant.group_size,
                       steps_per_block=quant.block_steps, sharing=quant.codebook_sharing, kv=kv)


def kmeans_summary(report: dict) -> dict:
    totals = report["totals"]
    return {"kmeans_backend": totals["backend"], "kmeans_iterations_max": totals["iterations_max"],
            "kmeans_init_s": round(totals["seconds_init"], 2),
            "kmeans_loop_iterations": sum(max(r["iterations"]) for r in report["layouts"].values()),
            "kmeans_iterations_mean": round(sum(sum(r["iterations"]) for r in report["layouts"].values())
                                            / max(totals["codebooks"], 1), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="ouro-1.4b")
    p.add_argument("--method", default="loopvq", choices=["cq", "tasq", "loopvq", "tasq+loopvq"])
    p.add_argument("--bits", type=float, default=0.5, choices=[0.5, 0.25])
    p.add_argument("--num-sequences", type=int, default=16)
    p.add_argument("--heldout", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=1, help="fine-tuning sequences per step (split across processes)")
    p.add_argument("--kmeans-backend", default="auto", choices=["auto", "torch", "triton", "faiss"])
    p.add_argument("--kmeans-iterations", type=int, default=100)
    p.add_argument("--problems-per-batch", type=int, default=None)
    p.add_argument("--points-per-chunk", type=int, default=None)
    p.add_argument("--store", default="auto", choices=["auto", "memory", "device", "disk"],
                   help="capture store; auto = memory for one process, disk (under --workdir) for several")
    p.add_argument("--fisher-channels", type=int, default=None, help="default: channels per step of a code group")
    p.add_argument("--loop-checkpointing", action="store_true")
    p.add_argument("--cache-teacher", default="auto", choices=["auto", "true", "false"])
    p.add_argument("--workdir", default=None, help="where disk captures and the bundle go (default: /dev/shm or tmp)")
    p.add_argument("--profile-kmeans", type=Path, default=None,
                   help="write a torch.profiler table of the k-means stage here (the profiler slows the stage)")
    p.add_argument("--stages", default="all", choices=["all", "codebooks", "finetune"],
                   help="codebooks: capture -> [tasq] -> k-means only; finetune: fine-tuning + bundle from random "
                        "codebooks (timing does not depend on their values), so a large model can be timed in two calls")
    args = p.parse_args()
    if args.stages == "finetune" and "tasq" in args.method:
        p.error("--stages finetune times random codebooks without TaSQ transforms: use --method cq or loopvq")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = 16 if args.bits == 0.5 else 32
    steps_per_block = 4
    channels = group // (steps_per_block if "loopvq" in args.method else 1)
    fisher_channels = args.fisher_channels or (1 if "tasq" in args.method else channels)
    store = args.store if args.store != "auto" else ("memory" if world == 1 else "disk")
    cfg = load_config({
        "model": {"dtype": "bfloat16" if device.type == "cuda" else "float32"},
        "data": {"num_sequences": args.num_sequences, "sequence_length": args.seq_len, "heldout_sequences": args.heldout},
        "quant": {"method": args.method, "bits": args.bits, "group_size": group, "steps_per_block": steps_per_block},
        "capture": {"store": store, "fisher_channels": fisher_channels},
        "kmeans": {"backend": args.kmeans_backend, "iterations": args.kmeans_iterations,
                   "problems_per_batch": args.problems_per_batch, "points_per_chunk": args.points_per_chunk},
        "finetune": {"epochs": args.epochs, "batch_size": args.batch_size, "loop_checkpointing": args.loop_checkpointing,
                     "cache_teacher": args.cache_teacher},
    })
    base = Path(args.workdir or ("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()))
    work = base / f"loopvq-bench-{args.model}-{args.method}-{args.bits}-{args.num_sequences}"
    timer = Timer(device)
    with timer.stage("build_model"):
        model = build_model(args.model, device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (args.num_sequences, args.seq_len), generator=gen)
    n_train = args.num_sequences - args.heldout
    calib = CalibrationSet(ids, list(range(n_train)), list(range(n_train, args.num_sequences)), cfg.data.sink_tokens)

    report = None
    if args.stages in ("all", "codebooks"):
        quantizer, report = build_codebooks(model, calib, cfg, store, work, timer, device, rank, world,
                                            args.profile_kmeans if rank == 0 else None)
    else:
        quantizer = random_quantizer(model, cfg.quant, device)
    if args.stages == "codebooks":
        result = None
    else:
        with timer.stage("finetune"):
            result = finetune_codebooks(model, calib, quantizer, cfg.finetune, device)
        with timer.stage("bundle"):
            if rank == 0:
                from loopvq_calib.bundle import write_bundle

                conf = json.dumps(model.config.to_dict(), sort_keys=True).encode()
                identity = ModelIdentity(f"random-{args.model}", None, model.config.model_type, hashlib.sha256(conf).hexdigest(), [])
                write_bundle(work / "bundle", result.quantizer, name=f"bench-{args.model}", identity=identity,
                             calibration={"synthetic_ids": True}, metrics={"finetune_curve": result.curve},
                             serving=cfg.output.serving, codebook_dtype="float16", config=cfg.to_dict(),
                             producer_version=__version__)
    if rank == 0:
        timed = [s for s in timer.stages if s != "build_model"]
        print(json.dumps({
            "model": args.model, "method": args.method, "bits": args.bits, "sequences": args.num_sequences, "run": args.stages,
            "seq_len": args.seq_len, "processes": world, "store": store, "fisher_channels": fisher_channels,
            **(kmeans_summary(report) if report else {}), "stages": timer.stages, "pipeline_s": round(sum(timer.stages[s]["wall_s"] for s in timed), 2),
            "peak_gpu_gib": max((timer.stages[s]["peak_gpu_gib"] or 0) for s in timed),
            "best_epoch": result.best_epoch if result else None, "teacher_sequences_kept": result.teacher_kept if result else None, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        }))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
