"""Served-cache quality of one shipped reference model (``--model ouro|huginn``):
every method at 0.5 and 0.25 bit, fine-tuned and k-means only, beside the baselines and full precision.

Calibrates one bundle per method (cq, tasq, loopvq, tasq+loopvq with TaSQ's free grouping and with its ``channels``
grouping), width (0.5 bit = G 16, 0.25 bit = G 32; K 256, T_c 4) and fine-tuning (the shipped recipe, or none:
``finetune.enabled false``) on the model's calibration text (benchmarks/quality/reference_models.py). The k-means-only
run starts from the fine-tuned run's data, TaSQ and k-means stages (hard links and their manifest records: the
fingerprints match, so the pipeline reuses them). Run folders: runs/eval-reference-<model>/ (reused when present).
Then one ``loopvq-eval`` over the 20 bundles, the baselines (last-step KV, KIVI 2/4, fp8) and the bf16 model:
evaluation KL and perplexity on the model's held-out text, the shipped task ``loopvq_recall`` (rounds of 12 items: one
per kind and length), passkey retrieval and bytes per token. The report goes to
benchmarks/results/eval-reference-<model>/ with ``setup.json`` (the command, the commit, the settings, each bundle's
method / width / fine-tuning, each part's seconds); benchmarks/quality/quality_table.py turns the stored reports into
docs/quality-models.md.

Time on the 2-core CPU development machine (Huginn, bf16, other work sharing the cores; Ouro's per-token costs
are the same within 10 %): a fine-tuned calibration takes about 3.5 min (8 of them on 2 workers: about 15 min), a
k-means-only one about 7 s; in loopvq-eval a coded entry decodes at about 0.55 s per new token at 1,400 tokens of
context (full precision: 0.04 s), so a recall item takes about 8 s while the model writes all 40 new tokens
(today's weights) and 2 to 3 s when it stops at the line's end, and the passkey lengths 256 + 1,024 + 2,040 about
16 s per trial. With the defaults (24 coded entries, 24 items, 2 passkey trials) that is about 110 min with today's
weights and about 60 min once the models stop after their answer. ``--device cuda`` runs both parts on a GPU,
where ``--limit 0`` (all 240 items) is the setting to use.

    python benchmarks/quality/eval_reference.py --model ouro
    python benchmarks/quality/eval_reference.py --model huginn
    python benchmarks/quality/eval_reference.py --model huginn --methods loopvq --widths 0.5 --limit 12 \
        --passkey-lengths 256 --passkey-trials 1 --kl-sequences 1 --out /tmp/quick     # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: local models and data only
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.* and an uninstalled loopvq_calib

import torch

from benchmarks.common.paths import RESULTS, ROOT
from benchmarks.common.provenance import short_commit
from benchmarks.quality.reference_models import CODEBOOK_SIZE, GROUP_SIZES, MODELS, SHIPPED_MODELS
from loopvq_calib import calibrate
from loopvq_calib.cli import eval_main
from loopvq_calib.config.schema import FinetuneConfig

METHODS = ("cq", "tasq", "loopvq", "tasq+loopvq", "tasq+loopvq-channels")
# a method name of this table -> (quant.method, other config keys): TaSQ+LoopVQ with the paper's channel grouping
VARIANTS: dict[str, tuple[str, dict]] = {"tasq+loopvq-channels": ("tasq+loopvq", {"tasq": {"grouping": "channels"}})}
WIDTHS = GROUP_SIZES  # bits -> group size G
BASELINES = "last-step-kv,kivi2,kivi4,fp8"
TASK = "loopvq_recall"
DATA = {"num_sequences": 16, "sequence_length": 512, "heldout_sequences": 4, "sink_tokens": 8}
KMEANS = {"iterations": 10}
FINETUNE: dict = {}  # the shipped recipe (FinetuneConfig's defaults)
SERVING = {"recent_window": 64, "page_size": 8}
EVAL_LENGTH = 512  # loopvq-eval --sequence-length: each KL window, and the prefill before bytes per token
SHARED_STAGES = ("data", "capture", "tasq", "kmeans")  # what a k-means-only run takes from its fine-tuned twin


@dataclass(frozen=True)
class Run:
    """One calibration: method, width (bits) and whether it fine-tunes."""

    method: str
    bits: float
    finetuned: bool

    @property
    def name(self) -> str:
        return f"{self.method}-{self.bits:g}" + ("" if self.finetuned else "-kmeans")

    def bundle_name(self, model: str) -> str:
        """The bundle's (and report entry's) name, e.g. tiny-ouro-loopvq-0.5bit-kmeans."""
        folder = Path(MODELS[model].folder).name
        return f"{folder}-{self.method}-{self.bits:g}bit" + ("" if self.finetuned else "-kmeans")


def plan(methods: tuple[str, ...] = METHODS, widths: tuple[float, ...] = tuple(WIDTHS)) -> list[Run]:
    """Every run, width-major: the fine-tuned run of each method, then its k-means-only twin."""
    return [Run(m, b, tuned) for b in widths for m in methods for tuned in (True, False)]


def run_config(model: str, run: Run, *, device: str = "cpu") -> dict:
    """The calibration config of ``run`` on ``model``."""
    ref = MODELS[model]
    method, extra = VARIANTS.get(run.method, (run.method, {}))
    return {
        "model": {"name_or_path": str(ROOT / ref.folder), "device": device},
        "data": {"dataset": str(ROOT / ref.calibration), **DATA},
        "quant": ref.quant(method, run.bits),
        "kmeans": dict(KMEANS),
        "finetune": dict(FINETUNE) if run.finetuned else {"enabled": False},
        "output": {"bundle_name": run.bundle_name(model), "serving": dict(SERVING)},
        **extra,
    }


def share_codebooks(src: Path, dst: Path) -> None:
    """Give ``dst`` the finished data, capture, TaSQ and k-means stages of ``src`` (hard links and their manifest
    records), unless ``dst`` has a manifest already."""
    if (dst / "manifest.json").is_file():
        return
    manifest = json.loads((src / "manifest.json").read_text())
    stages = {k: v for k, v in manifest["stages"].items() if k in SHARED_STAGES and v.get("status") == "done"}
    dst.mkdir(parents=True, exist_ok=True)
    for stage in stages:
        shutil.copytree(src / stage, dst / stage, copy_function=os.link)
    (dst / "manifest.json").write_text(json.dumps({**manifest, "stages": stages}))


def _calibrate(cfg: dict, folder: Path) -> tuple[str, float]:
    torch.set_num_threads(1)
    start = time.time()
    calibrate(cfg, output=folder)
    return folder.name, time.time() - start


def bundles(
    model: str, runs: list[Run], *, folder: Path, workers: int, device: str = "cpu"
) -> tuple[list[Path], dict[str, float]]:
    """Each run's bundle (calibrated unless already there: fine-tuned runs first, then the k-means-only runs from
    their twins' stages) and the seconds of those calibrated now."""
    seconds: dict[str, float] = {}
    for finetuned in (True, False):
        todo = [
            r for r in runs if r.finetuned == finetuned and not (folder / r.name / "bundle" / "loopvq.json").is_file()
        ]
        for r in todo:
            twin = folder / Run(r.method, r.bits, True).name
            if not finetuned and (twin / "manifest.json").is_file():
                share_codebooks(twin, folder / r.name)
        if todo:
            with ProcessPoolExecutor(workers) as pool:
                jobs = [(run_config(model, r, device=device), folder / r.name) for r in todo]
                for name, took in pool.map(_calibrate, *zip(*jobs)):
                    seconds[name] = round(took, 1)
                    print(f"calibrated {model} {name} in {took:.0f} s", flush=True)
    return [folder / r.name / "bundle" for r in runs], seconds


def eval_argv(model: str, paths: list[Path], args: argparse.Namespace) -> list[str]:
    """``loopvq-eval``'s arguments: every bundle, the baselines, the task, passkey and bytes per token."""
    ref = MODELS[model]
    argv = [arg for b in paths for arg in ("--bundle", str(b))]
    argv += [
        "--model",
        str(ROOT / ref.folder),
        "--data",
        str(ROOT / ref.heldout),
        "--dtype",
        "bfloat16",
        "--device",
        args.device,
        "--num-sequences",
        str(args.kl_sequences),
        "--sequence-length",
        str(EVAL_LENGTH),
        "--tasks",
        TASK,
        "--baseline",
        BASELINES,
        "--out",
        str(args.out),
    ]
    if args.passkey_lengths:
        argv += ["--passkey-lengths", args.passkey_lengths, "--passkey-trials", str(args.passkey_trials)]
    if args.recent_window is not None:
        argv += ["--recent-window", str(args.recent_window)]
    if args.limit:
        argv += ["--limit", f"{args.limit:g}"]
    return argv


def setup(model: str, runs: list[Run], argv: list[str], *, seconds: dict[str, float], device: str = "cpu") -> dict:
    """What setup.json records: the command, the commit, the device and the machine's cores, the model, the
    calibration settings, each bundle's method / width / fine-tuning and the seconds of each part."""
    ref = MODELS[model]
    calibration = {
        "dataset": ref.calibration,
        "sequences": DATA["num_sequences"],
        "sequence_length": DATA["sequence_length"],
        "selection_sequences": DATA["heldout_sequences"],
        "sink_tokens": DATA["sink_tokens"],
        "codebook_size": CODEBOOK_SIZE,
        "group_size": {f"{bits:g}": group for bits, group in ref.group_sizes},
        "steps_per_block": ref.steps_per_block,
        "kmeans_iterations": KMEANS["iterations"],
        "finetune": asdict(FinetuneConfig(**FINETUNE)),
        "serving": SERVING,
    }
    return {
        "command": shlex.join(["python", "benchmarks/quality/eval_reference.py", *argv]),
        "commit": short_commit(),
        "device": device,
        "cpu_count": os.cpu_count(),
        "model": model,
        "folder": ref.folder,
        "heldout": ref.heldout,
        "calibration": calibration,
        "bundles": [
            {"name": r.bundle_name(model), "method": r.method, "width": r.bits, "finetuned": r.finetuned} for r in runs
        ],
        "seconds": seconds,
    }


def parser() -> argparse.ArgumentParser:
    """The script's options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=SHIPPED_MODELS, default="ouro")
    p.add_argument("--out", help="report folder (default: benchmarks/results/eval-reference-<model>)")
    p.add_argument("--limit", type=float, default=24, help=f"items of {TASK} (24 = 2 rounds of 12; 0: all 240)")
    p.add_argument("--passkey-lengths", default="256,1024,2040", help="comma-separated; empty: no passkey")
    p.add_argument("--passkey-trials", type=int, default=2)
    p.add_argument("--recent-window", type=int, help="override the bundles' 64-token window (every entry)")
    p.add_argument("--kl-sequences", type=int, default=8, help="held-out windows of 512 tokens for the KL")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of the methods")
    p.add_argument("--widths", default=",".join(f"{b:g}" for b in WIDTHS), help="comma-separated subset of 0.5,0.25")
    p.add_argument("--runs", help="run folders (default: runs/eval-reference-<model>)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--device", default="cpu", help="calibration and loopvq-eval device (cpu, cuda, cuda:N)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Calibrate (or reuse) the bundles, run loopvq-eval, write setup.json; returns loopvq-eval's exit status."""
    p = parser()
    args = p.parse_args(argv)
    methods, widths = args.methods.split(","), args.widths.split(",")
    unknown = sorted(set(methods) - set(METHODS)) + sorted(set(widths) - {f"{b:g}" for b in WIDTHS})
    if unknown:
        p.error(f"unknown method or width {', '.join(unknown)} (methods {','.join(METHODS)}; widths 0.5,0.25)")
    args.out = Path(args.out or RESULTS / f"eval-reference-{args.model}")
    runs = plan(tuple(methods), tuple(float(b) for b in widths))
    start = time.time()
    paths, seconds = bundles(
        args.model,
        runs,
        folder=Path(args.runs or ROOT / "runs" / f"eval-reference-{args.model}"),
        workers=args.workers,
        device=args.device,
    )
    seconds["calibration"] = round(time.time() - start, 1)
    start = time.time()
    status = eval_main(eval_argv(args.model, paths, args))
    seconds["loopvq-eval"] = round(time.time() - start, 1)
    print(f"loopvq-eval took {seconds['loopvq-eval']:.0f} s (status {status})")
    args.out.mkdir(parents=True, exist_ok=True)
    record = setup(args.model, runs, sys.argv[1:] if argv is None else argv, seconds=seconds, device=args.device)
    (args.out / "setup.json").write_text(json.dumps(record, indent=1) + "\n")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
