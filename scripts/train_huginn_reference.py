"""Train a tiny reference model of the exact Huginn architecture (``model_type: "huginn_raven"``) on Python source.

Three steps:

  python scripts/train_huginn_reference.py prepare --out build/huginn-data              # CPU: corpus, BPE, token ids
  python scripts/train_huginn_reference.py train --data build/huginn-data --out artifacts/tiny-huginn   # one GPU
  python scripts/train_huginn_reference.py report --data build/huginn-data --model artifacts/tiny-huginn \
      --out benchmarks/results/huginn-reference-report.json

Text: the Python standard library of the running interpreter (sorted file list; a seeded sample of files is held
out). A quarter of every batch's rows are fresh recall documents (``retrieval_text.py``: a pass key hidden in
filler, a registry looked up later, a line repeated later), so that the model learns to answer from its KV cache.
Training samples the recurrence count per step from Huginn's Poisson-lognormal and backpropagates through the last
``--backprop-depth`` recurrences only; the saved config runs ``mean_recurrence`` = 8 recurrences by default.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from python_corpus import HELDOUT_FRACTION, read_sources, split_sources, stdlib_files
from reference_corpus import train_tokenizer, write_jsonl
from retrieval_text import KINDS, recall_accuracy, recall_rows, tokenize_with, tokenizer_sample
from train_reference_model import kv_structure
from training_rows import batches
from transformers import PreTrainedTokenizerFast

from loopvq_calib.models import HuginnConfig, HuginnForCausalLM
from loopvq_calib.models.loading import load_model

ARCH = dict(
    n_embd=384,
    n_heads=6,
    n_layers=4,
    n_layers_in_prelude=1,
    n_layers_in_recurrent_block=2,
    n_layers_in_coda=1,
    intermediate_size=1024,
    vocab_size=4096,
    block_size=2048,
    rope_base=10000.0,
    norm_eps=1e-6,
    qk_bias=True,
    tie_embeddings=True,
    state_init="like-init",
    mean_recurrence=8,
    mean_backprop_depth=4,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def token_ids(tokenizer: PreTrainedTokenizerFast, docs: list[str]) -> np.ndarray:
    """The documents' ids, each followed by ``<|endoftext|>`` (id 0), as uint16."""
    ids: list[int] = []
    for doc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids += doc + [0]
    return np.asarray(ids, dtype=np.uint16)


def prepare(args: argparse.Namespace) -> None:
    """Corpus, tokenizer and token ids (train, held-out) into ``--out``; ``meta.json`` lists what went where."""
    root, files = stdlib_files(args.max_files)
    sources = read_sources(root, files)
    rng = random.Random(args.seed)
    train_code, held = split_sources(sources, rng, heldout_fraction=args.heldout_fraction)
    recall = tokenizer_sample(rng, count=300, max_tokens=ARCH["block_size"])
    train_docs = list(train_code)
    rng.shuffle(train_docs)
    tokenizer = train_tokenizer(train_docs + recall, vocab_size=ARCH["vocab_size"], window=ARCH["block_size"])
    out = Path(args.out)
    tokenizer.save_pretrained(out / "tokenizer")
    train_ids, held_ids = token_ids(tokenizer, train_docs), token_ids(tokenizer, [t for _, t in held])
    np.save(out / "train.npy", train_ids)
    np.save(out / "heldout.npy", held_ids)
    write_jsonl(out / "python-heldout.jsonl", held)
    if args.shipped_data is not None:  # the held-out files in turn: calibration text and evaluation text
        write_jsonl(args.shipped_data / "python-calib.jsonl", held[0::2])
        write_jsonl(args.shipped_data / "python-heldout.jsonl", held[1::2])
    meta = {
        "stdlib": str(root),
        "files": len(sources),
        "heldout_files": sorted(n for n, _ in held),
        "seed": args.seed,
        "train_tokens": len(train_ids),
        "heldout_tokens": len(held_ids),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(
        f"{len(sources)} files ({len(held)} held out), {len(train_ids):,} train / {len(held_ids):,} held-out tokens; "
        f"{out} holds {size / 1e6:.1f} MB"
    )


def sample_recurrence(rng: random.Random, mean: int, backprop: int, *, cap: int) -> tuple[int, int]:
    """Huginn's per-step draw: r = 1 + Poisson(exp(N(log(mean) - sigma^2 / 2, sigma))), sigma = 1/2, capped at
    ``cap``; returns (recurrences without gradient, the last ones with gradient, at most ``backprop``)."""
    rate = math.exp(rng.gauss(math.log(mean) - 0.125, 0.5))
    r = min(cap, 1 + int(np.random.default_rng(rng.getrandbits(32)).poisson(rate)))
    return r - min(r, backprop), min(r, backprop)


def truncated_loss(model: HuginnForCausalLM, ids: torch.Tensor, free: int, *, grad: int) -> torch.Tensor:
    """Next-token loss after ``free + grad`` recurrences, the gradient flowing through the last ``grad`` only (and
    through the prelude by the input injection)."""
    state = None
    if free:
        with torch.no_grad():
            state = model(ids, num_steps=free, output_loop_hidden_states=True, logits_to_keep=1).loop_hidden_states[-1]
    return model(ids, labels=ids, num_steps=grad, input_states=state).loss


@torch.no_grad()
def heldout_loss(
    model: HuginnForCausalLM, tokens: np.ndarray, *, seq: int, steps: int, windows: int, autocast: bool = False
) -> float:
    """Mean next-token loss at ``steps`` recurrences over the first ``windows`` windows of ``tokens`` (each
    sequence's like-init state seeded by its tokens); ``autocast``: under bf16 autocast (CUDA training)."""
    device = model.device
    data = torch.from_numpy(tokens[: windows * seq].astype(np.int64))
    n = len(data) // seq
    total = 0.0
    with model.seeded_initial_state(0):
        for chunk in data[: n * seq].view(n, seq).split(8):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                total += model(chunk.to(device), labels=chunk.to(device), num_steps=steps).loss.item() * len(chunk)
    return total / n


def new_model(device: str) -> HuginnForCausalLM:
    """The reference architecture (``ARCH``), freshly initialised, in fp32 on ``device``."""
    return HuginnForCausalLM(HuginnConfig(**ARCH)).to(device)


def train_loop(model: HuginnForCausalLM, args: argparse.Namespace, data: Path) -> tuple[dict, list[dict]]:
    """AdamW, warm-up then cosine lr, recurrences drawn per step; the held-out loss at ``mean_recurrence``
    every ``--eval-every`` steps; stops at ``--steps`` or ``--max-seconds``. Returns (best state, log)."""
    device = model.device
    train_tokens, held_tokens = np.load(data / "train.npy"), np.load(data / "heldout.npy")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    tokenize = tokenize_with(PreTrainedTokenizerFast.from_pretrained(data / "tokenizer"))
    recall = recall_rows(tokenize, random.Random(args.seed), seq=args.seq_len, eos=ARCH["eos_token_id"])
    stream = batches(
        train_tokens,
        args.seq_len,
        args.batch,
        gen=torch.Generator().manual_seed(args.seed),
        extra=[(recall, round(args.batch * args.recall_share))],
    )
    rng, cfg = random.Random(args.seed), model.config
    best, best_state, log, t0 = math.inf, None, [], time.time()
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, step / args.warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        free, grad = sample_recurrence(rng, cfg.mean_recurrence, cfg.mean_backprop_depth, cap=args.max_recurrence)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = truncated_loss(model, next(stream).to(device), free, grad=grad)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        out_of_time = time.time() - t0 > args.max_seconds
        if step % args.eval_every == 0 or step == args.steps or out_of_time or best_state is None:
            model.eval()
            held = heldout_loss(
                model,
                held_tokens,
                seq=args.seq_len,
                steps=cfg.mean_recurrence,
                windows=args.windows,
                autocast=device.type == "cuda",
            )
            model.train()
            log.append(
                {
                    "step": step,
                    "recurrences": free + grad,
                    "train_loss": round(loss.item(), 4),
                    "heldout_loss": round(held, 4),
                    "s": round(time.time() - t0, 1),
                }
            )
            print(json.dumps(log[-1]), flush=True)
            if held < best:
                best, best_state = held, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        if out_of_time:
            print(f"stopping at step {step}: --max-seconds {args.max_seconds} reached", flush=True)
            break
    return best_state, log


def train(args: argparse.Namespace) -> HuginnForCausalLM:
    """Train, then save the best held-out checkpoint in bf16 with the tokenizer into ``--out`` (a folder the
    toolkit's loader reads like a hub Huginn folder) and ``train_log.json`` beside the weights."""
    torch.manual_seed(args.seed)
    data, out = Path(args.data), Path(args.out)
    model = new_model(args.device).train()
    params = sum(p.numel() for p in model.parameters())
    print(f"Huginn reference: {params / 1e6:.2f} M parameters on {args.device}", flush=True)
    best_state, log = train_loop(model, args, data)
    model.load_state_dict(best_state)
    model = model.to(torch.bfloat16).cpu().eval()
    model.config.dtype = "bfloat16"
    model.save_pretrained(out, max_shard_size="8MB")  # shards under 8 MB, as the Ouro reference ships
    for name in TOKENIZER_FILES:
        shutil.copy(data / "tokenizer" / name, out / name)
    record = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "parameters": params,
        "log": log,
    }
    (out / "train_log.json").write_text(json.dumps(record, indent=1))
    best = min(e["heldout_loss"] for e in log)
    print(
        f"saved {out} (best held-out loss {best:.4f} at {model.config.mean_recurrence} recurrences) "
        f"in {log[-1]['s']:.0f} s",
        flush=True,
    )
    return model


def report(args: argparse.Namespace) -> None:
    """Held-out loss per recurrence count and retrieval accuracy, fp32 and bf16 weights and compute (no autocast),
    through the toolkit's loader."""
    device = torch.device(args.device)
    held = np.load(Path(args.data) / "heldout.npy")
    result: dict = {"model": str(args.model), "seq_len": args.seq_len, "windows": args.windows}
    for dtype in ("float32", "bfloat16"):
        model, tokenizer = load_model(Path(args.model), dtype, device)
        losses = {
            r: round(heldout_loss(model, held, seq=args.seq_len, steps=r, windows=args.windows), 4)
            for r in args.recurrences
        }
        print(dtype, "held-out loss per recurrence count", losses, flush=True)
        model.config.mean_recurrence = args.retrieval_recurrences
        rows = [
            recall_accuracy(
                model,
                tokenize_with(tokenizer),
                kind=k,
                tokens=n,
                items=args.items,
                context=partial(model.seeded_initial_state, 0),
            )
            for k in KINDS
            for n in args.lengths
        ]
        for row in rows:
            print(dtype, json.dumps(row), flush=True)
        result[dtype] = {
            "heldout_loss_per_recurrence": losses,
            "retrieval_recurrences": args.retrieval_recurrences,
            "retrieval": rows,
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


def structure(args: argparse.Namespace) -> None:
    """The inter-step structure of the pre-RoPE keys and values of the core's layers (fp32, 16 held-out windows
    of ``--seq-len`` tokens, the first 8 tokens left out), as the Ouro reference's report measures it."""
    model, _ = load_model(Path(args.model), "float32", torch.device(args.device))
    held = np.load(Path(args.data) / "heldout.npy")[: 16 * args.seq_len].astype(np.int64)
    windows = torch.from_numpy(held).view(16, args.seq_len).to(args.device)
    torch.manual_seed(0)  # the like-init state is drawn at random: a fixed draw
    result = {
        "model": str(args.model),
        "seq_len": args.seq_len,
        "recurrences": model.config.mean_recurrence,
        "tokens_for_correlation": 16 * (args.seq_len - 8),
        "correlation": kv_structure(model, windows, sinks=8),
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


def parser() -> argparse.ArgumentParser:
    """The command line: ``prepare``, ``train``, ``report`` and ``structure`` (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare")
    prep.add_argument("--out", type=Path, required=True)
    prep.add_argument("--max-files", type=int, default=None, help="only the first N stdlib files (tests)")
    prep.add_argument("--heldout-fraction", type=float, default=HELDOUT_FRACTION)
    prep.add_argument(
        "--shipped-data",
        type=Path,
        default=None,
        help="also write the held-out files, in turn, as python-calib.jsonl / python-heldout.jsonl here "
        "(artifacts/data: the Huginn reference's calibration and evaluation text)",
    )
    prep.add_argument("--seed", type=int, default=0)
    tr = sub.add_parser("train")
    tr.add_argument("--data", type=Path, required=True)
    tr.add_argument("--out", type=Path, required=True)
    tr.add_argument("--steps", type=int, default=1500)
    tr.add_argument("--max-seconds", type=float, default=230.0)
    tr.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    tr.add_argument("--batch", type=int, default=32)
    tr.add_argument("--lr", type=float, default=2e-3)
    tr.add_argument("--warmup", type=int, default=100)
    tr.add_argument("--eval-every", type=int, default=100)
    tr.add_argument("--max-recurrence", type=int, default=24)
    tr.add_argument("--recall-share", type=float, default=0.25, help="rows of each batch that are recall documents")
    tr.add_argument("--seed", type=int, default=0)
    rep = sub.add_parser("report")
    rep.add_argument("--data", type=Path, required=True)
    rep.add_argument("--model", type=Path, required=True)
    rep.add_argument("--out", type=Path, required=True)
    rep.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    rep.add_argument("--recurrences", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    rep.add_argument("--retrieval-recurrences", type=int, default=8)
    rep.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2040])
    rep.add_argument("--items", type=int, default=32)
    st = sub.add_parser("structure")
    st.add_argument("--data", type=Path, required=True)
    st.add_argument("--model", type=Path, required=True)
    st.add_argument("--out", type=Path, required=True)
    st.add_argument("--device", default="cpu")
    st.add_argument("--seq-len", type=int, default=512)
    for sp in (tr, rep):
        sp.add_argument("--seq-len", type=int, default=1024)
        sp.add_argument("--windows", type=int, default=32, help="held-out windows of --seq-len tokens")
    return p


def main() -> None:
    """Run the chosen subcommand."""
    args = parser().parse_args()
    {"prepare": prepare, "train": train, "report": report, "structure": structure}[args.command](args)


if __name__ == "__main__":
    main()
