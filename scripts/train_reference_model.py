"""Train the shipped reference model: a small model of the exact Ouro architecture on public-domain text.

Three steps (docs/reference-model.md has the measured results):

  python scripts/train_reference_model.py prepare   # CPU: corpora, shipped text slices, BPE tokenizer, token ids
  python scripts/train_reference_model.py train     # GPU: per-loop loss training, best held-out checkpoint
  python scripts/train_reference_model.py report    # CPU or GPU: held-out loss per loop, KV structure, recall
                                                    # rates -> JSON (stdout, and --out)

``--model-dir`` (default artifacts/tiny-ouro) is where prepare writes the tokenizer, train the weights and report
reads them; ``--build`` holds the token ids.

Text: Shakespeare's plays and the King James Bible (``reference_corpus.py``: held-out plays and books never enter
training). A quarter of every batch's rows are
fresh recall documents (``retrieval_text.py``: a pass key in filler, a registry looked up later, a line
repeated later), so that the model answers from its KV cache up to its window.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from python_corpus import read_sources, split_sources, stdlib_files
from reference_corpus import prepare_corpus
from retrieval_text import KINDS, Tokenize, recall_accuracy, recall_rows, tokenize_with
from training_rows import batches, repeat_rows
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from loopvq_calib.evaluation.kv_structure import average_structure, correlation_structure
from loopvq_calib.models import KVRecorder, OuroConfig, OuroForCausalLM, kv_hook

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "artifacts" / "tiny-ouro"
BUILD = ROOT / "build" / "reference"


ARCH = dict(
    vocab_size=4096,
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=6,
    head_dim=64,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    total_ut_steps=4,
    early_exit_threshold=1.0,
    tie_word_embeddings=False,
    initializer_range=0.02,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)


def prepare(args: argparse.Namespace) -> None:
    """:func:`reference_corpus.prepare_corpus` for :data:`ARCH`'s vocabulary and window; with ``--python-text`` the
    Huginn reference's training files (the standard library less the same held-out sample) join the training text."""
    extra = split_sources(read_sources(*stdlib_files()), random.Random(args.seed))[0] if args.python_text else []
    prepare_corpus(
        args.model_dir,
        args.build,
        tokenizer=args.tokenizer,
        seed=args.seed,
        vocab_size=ARCH["vocab_size"],
        window=ARCH["max_position_embeddings"],
        extra_train=extra,
    )


def loop_losses(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-loop next-token CE (per token) and gate logits, from one forward through every loop."""
    out = model(ids, output_loop_hidden_states=True)
    ces = []
    for h in out.loop_hidden_states:
        logits = model.lm_head(h[:, :-1]).float()
        ces.append(F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(ids.shape[0], -1))
    return ces, [g[:, :-1, 0].float() for g in out.gate_logits]


def training_loss(
    ces: list[torch.Tensor], gates: list[torch.Tensor], gate_weight: float, *, delta: float
) -> torch.Tensor:
    """Per-loop CE weighted 1:2:4:8 (every loop is a readout; the weight on later loops lets them refine
    the earlier ones) plus an exit-gate loss: the gate at step t learns whether step t+1 still lowers the
    token's loss by more than ``delta``."""
    weights = torch.tensor([2.0**t for t in range(len(ces))])
    weights = weights / weights.sum()
    lm = sum(w * c.mean() for w, c in zip(weights.tolist(), ces))
    gate = sum(
        F.binary_cross_entropy_with_logits(gates[t], ((ces[t] - ces[t + 1]).detach() < delta).float())
        for t in range(len(ces) - 1)
    ) / (len(ces) - 1)
    return lm + gate_weight * gate


@torch.no_grad()
def heldout_per_loop(
    model: torch.nn.Module, tokens: np.ndarray, seq: int, *, device: str, max_windows: int = 64
) -> list[float]:
    """Mean next-token loss per loop on the first ``max_windows`` non-overlapping windows of ``tokens``."""
    data = torch.from_numpy(tokens.astype(np.int64))
    n = min(max_windows, (len(data) - 1) // seq)
    windows = torch.stack([data[i * seq : (i + 1) * seq] for i in range(n)]).to(device)
    totals = None
    for chunk in windows.split(16):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            ces, _ = loop_losses(model, chunk)
        sums = [c.sum().item() for c in ces]
        totals = sums if totals is None else [a + b for a, b in zip(totals, sums)]
    return [t / (n * (seq - 1)) for t in totals]


def add_residual_dropout(model: torch.nn.Module, p: float) -> None:
    """Training-only dropout on each attention and MLP branch output (the architecture itself has none:
    hooks leave the saved model untouched). 2.6 M tokens overfit a 10 M-parameter model otherwise."""
    for layer in model.model.layers:
        for branch in (layer.self_attn, layer.mlp):
            branch.register_forward_hook(lambda mod, inp, out: F.dropout(out, p, mod.training))


def scale_branch_norms(model: torch.nn.Module, scale: float) -> None:
    """Start each attention and MLP branch's output norm (Ouro's sandwich norms ``input_layernorm_2`` and
    ``post_attention_layernorm_2``) at ``scale`` instead of 1, so that every branch first adds little to the
    residual stream (as LayerScale does). Measured on one H100 (benchmarks/results/reference-retrain-h100-b739aaa):
    at 0.1 the held-out last-loop loss after 1,500 steps fell from 4.13 to 3.92 nats; neither answered a recall
    item. A 2-layer, 4-loop copy of the architecture learns to copy a repeated random sequence by step 200 at 0.1
    and not by step 300 at 1 (CPU)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm_2.weight.fill_(scale)
            layer.post_attention_layernorm_2.weight.fill_(scale)


@torch.no_grad()
def repeat_gain(
    model: torch.nn.Module, tokens: np.ndarray, *, device: str, length: int = 256, windows: int = 8
) -> float:
    """In-context copying: mean last-loop next-token loss on the first copy of ``windows`` held-out passages of
    ``length`` tokens, minus that on their second copy when each passage is repeated once (0: the model does not
    read its context back; a model that copies drives the second copy's loss towards 0)."""
    data = torch.from_numpy(tokens[: windows * length].astype(np.int64)).view(windows, length)
    ids = torch.cat([data, data], 1).to(device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        ces, _ = loop_losses(model, ids)
    last = ces[-1].float()
    return (last[:, : length - 1].mean() - last[:, length:].mean()).item()


def training_batches(
    args: argparse.Namespace, train_tokens: np.ndarray, tokenize: Tokenize, *, gen: torch.Generator
) -> Iterator[torch.Tensor]:
    """The training batches: text windows with ``--recall-share`` recall rows and ``--repeat-share`` repeated-span
    rows; the first ``--short-steps`` batches hold rows of ``--short-seq-len`` tokens (as many tokens per batch)."""

    def stream(seq: int, batch: int) -> Iterator[torch.Tensor]:
        recall = recall_rows(tokenize, random.Random(args.seed), seq=seq, eos=ARCH["eos_token_id"])
        spans = (min(16, seq // 4), min(256, seq // 4))  # a pair of copies fits the row
        repeat = repeat_rows(np.random.default_rng(args.seed), seq=seq, vocab=ARCH["vocab_size"], spans=spans)
        extra = [(recall, round(batch * args.recall_share)), (repeat, round(batch * args.repeat_share))]
        return batches(train_tokens, seq, batch, gen=gen, extra=extra)

    if args.short_steps:
        yield from itertools.islice(
            stream(args.short_seq_len, args.batch * args.seq_len // args.short_seq_len), args.short_steps
        )
    yield from stream(args.seq_len, args.batch)


def reference_config(args: argparse.Namespace) -> OuroConfig:
    """The shipped architecture (:data:`ARCH`), with ``--layers`` looped layers when given."""
    return OuroConfig(**dict(ARCH, num_hidden_layers=args.layers or ARCH["num_hidden_layers"]))


def initial_model(args: argparse.Namespace) -> OuroForCausalLM:
    """The model before training: :func:`reference_config`'s, branch output norms at ``--branch-scale``, the token
    embedding at ``--embed-std``, the LM head (untied, as in Ouro) starting as ``--head-from-embedding`` times the
    embedding (reading a token's embedding back then scores that token), training-only branch dropout."""
    model = OuroForCausalLM(reference_config(args))
    scale_branch_norms(model, args.branch_scale)
    with torch.no_grad():
        if args.embed_std is not None:
            model.model.embed_tokens.weight.normal_(0.0, args.embed_std)
        if args.head_from_embedding is not None:
            model.lm_head.weight.copy_(model.model.embed_tokens.weight * args.head_from_embedding)
    add_residual_dropout(model, args.dropout)
    return model


def train(args: argparse.Namespace) -> None:
    """Per-loop loss training; the checkpoint with the best held-out last-loop loss goes to the model folder."""
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train_tokens = np.load(args.build / "train_tokens.npy")
    held_tokens = np.load(args.build / "heldout_tokens.npy")
    model = initial_model(args).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    tokenize = tokenize_with(PreTrainedTokenizerFast.from_pretrained(args.model_dir))
    stream = training_batches(args, train_tokens, tokenize, gen=gen)
    best, best_state, log = math.inf, None, []
    t0 = time.time()
    for step in range(1, args.steps + 1):
        out_of_time = time.time() - t0 > args.max_seconds
        lr = args.lr * min(1.0, step / args.warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        ids = next(stream).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            ces, gates = loop_losses(model, ids)
            loss = training_loss(ces, gates, args.gate_weight, delta=args.gate_delta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.eval_every == 0 or step == args.steps or out_of_time:
            model.eval()
            held = heldout_per_loop(model, held_tokens, args.seq_len, device=device)
            gain = repeat_gain(model, held_tokens, device=device)
            model.train()
            log.append(
                {
                    "step": step,
                    "train_loss": loss.item(),
                    "heldout_per_loop": held,
                    "repeat_gain": gain,
                    "s": time.time() - t0,
                }
            )
            print(json.dumps(log[-1]), flush=True)
            if held[-1] < best:
                best = held[-1]
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        if out_of_time:
            print(f"stopping at step {step}: --max-seconds {args.max_seconds} reached", flush=True)
            break
    model.load_state_dict(best_state)
    model = model.to(torch.bfloat16).cpu()
    model.config.dtype = "bfloat16"
    model.save_pretrained(args.model_dir, safe_serialization=True, max_shard_size="8MB")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.model_dir / "train_log.json").write_text(json.dumps({"args": settings, "log": log}, indent=1))
    print(f"saved {args.model_dir} (best held-out last-loop loss {best:.4f}) in {time.time() - t0:.0f} s")


def report(args: argparse.Namespace) -> None:
    """Held-out loss per loop, the inter-step structure of pre-RoPE keys and values (paper Fig. 2b) and exact-recall
    rates per kind and length (:func:`retrieval_text.recall_accuracy`); printed, and written to ``--out``."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).to(device).eval()
    held_tokens = np.load(args.build / "heldout_tokens.npy")
    held = heldout_per_loop(model, held_tokens, args.seq_len, device=device)
    data = torch.from_numpy(held_tokens.astype(np.int64))
    windows = torch.stack([data[i * args.seq_len : (i + 1) * args.seq_len] for i in range(16)]).to(device)
    structure = kv_structure(model, windows, sinks=8)
    gain = repeat_gain(model, held_tokens, device=device)
    tokenize = tokenize_with(PreTrainedTokenizerFast.from_pretrained(args.model_dir))
    recall = [recall_accuracy(model, tokenize, kind=k, tokens=n, items=args.items) for k in KINDS for n in args.lengths]
    result = {
        "heldout_loss_per_loop": held,
        "seq_len": args.seq_len,
        "repeat_gain": gain,
        "correlation": structure,
        "tokens_for_correlation": int(16 * (args.seq_len - 8)),
        "recall": recall,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


def kv_structure(model: torch.nn.Module, windows: torch.Tensor, *, sinks: int) -> dict:
    """Mean |Pearson r| of the pre-RoPE keys and values over ``windows`` (sinks excluded), across adjacent loop
    steps and within 16-channel groups, averaged over the looped layers (prelude and coda sites left out)."""
    rec = KVRecorder()
    with torch.no_grad(), kv_hook(model, rec):
        model(windows)
    looped = [s for s in model.kv_layout().sites if s.looped]
    structure = {}
    for kind, store in (("key", rec.keys), ("value", rec.values)):
        per_layer = []
        for layer in sorted({s.layer for s in looped}):
            sites = [s.site for s in sorted(looped, key=lambda s: s.step) if s.layer == layer]
            x = torch.stack([store[s][:, sinks:].flatten(0, 1) for s in sites], 1).float().cpu()  # [N, T, H, D]
            per_layer.append(correlation_structure(x, group_size=16))
        structure[kind] = average_structure(per_layer)
    return structure


def main() -> None:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["prepare", "train", "report"])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--recall-share", type=float, default=0.25, help="rows of each batch that are recall documents")
    p.add_argument("--items", type=int, default=32, help="report: recall items per kind and length")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2040], help="report: recall lengths")
    p.add_argument("--out", type=Path, default=None, help="report: also write the JSON here")
    p.add_argument("--model-dir", type=Path, default=MODEL_DIR, help="the model folder (tokenizer, weights)")
    p.add_argument("--build", type=Path, default=BUILD, help="token ids of training and held-out text")
    p.add_argument("--max-seconds", type=float, default=math.inf, help="train: stop after this long")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--gate-weight", type=float, default=0.1)
    p.add_argument("--gate-delta", type=float, default=0.01)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--branch-scale", type=float, default=0.1, help="train: initial weight of the branch output norms")
    p.add_argument("--repeat-share", type=float, default=0.0, help="rows of each batch that are repeated spans")
    p.add_argument("--python-text", action="store_true", help="prepare: the stdlib's source joins the training text")
    p.add_argument("--tokenizer", type=Path, default=None, help="prepare: use this folder's tokenizer, train none")
    p.add_argument("--embed-std", type=float, default=None, help="train: initial std of the token embedding")
    p.add_argument("--head-from-embedding", type=float, default=None, help="train: lm_head starts as X * embedding")
    p.add_argument("--layers", type=int, default=None, help="train: looped layers (default: the shipped 4)")
    p.add_argument("--short-seq-len", type=int, default=256, help="train: row length of the first --short-steps")
    p.add_argument("--short-steps", type=int, default=0, help="train: steps of short rows first (copying forms there)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    {"prepare": prepare, "train": train, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
