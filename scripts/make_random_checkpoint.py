"""Write a random-weight checkpoint in the hub layout (config.json + safetensors + tokenizer) with the real
config of Ouro-1.4B, Ouro-2.6B or Huginn-3.5B, so anyone can time the real command on it (speed and memory
do not depend on the weight values):

    python scripts/make_random_checkpoint.py --model ouro-1.4b --out /tmp/ouro-1.4b-random --device cuda
    loopvq-calibrate --config configs/ouro-1.4b.yaml --set model.name_or_path=/tmp/ouro-1.4b-random \
        --set data.dataset=artifacts/data/shakespeare-calib.jsonl

The weights are bf16, drawn on ``--device`` (normal, std = the config's initializer range; norms 1). The
tokenizer is the shipped ``artifacts/tiny-ouro`` one: its 4,096 ids fit every real vocabulary.
``--scale-down N`` divides the widths and layer counts by N (tests, CPU dry runs).
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
from transformers import PretrainedConfig

from loopvq_calib.models import HuginnConfig, HuginnForCausalLM, OuroConfig, OuroForCausalLM

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "artifacts" / "tiny-ouro"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
OURO = dict(
    vocab_size=49152,
    hidden_size=2048,
    intermediate_size=5632,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=128,
    rope_theta=1e6,
    total_ut_steps=4,
    max_position_embeddings=65536,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
HUGINN = dict(
    n_embd=5280,
    n_heads=55,
    n_layers=8,
    n_layers_in_prelude=2,
    n_layers_in_recurrent_block=4,
    n_layers_in_coda=2,
    intermediate_size=17920,
    vocab_size=65536,
    block_size=4096,
    rope_base=50000.0,
    mean_recurrence=32,
    bos_token_id=65504,
    eos_token_id=65505,
    pad_token_id=65509,
)
MODELS = {
    "ouro-1.4b": (OuroForCausalLM, OuroConfig, {**OURO, "num_hidden_layers": 24}),
    "ouro-2.6b": (OuroForCausalLM, OuroConfig, {**OURO, "num_hidden_layers": 48}),
    "huginn-3.5b": (HuginnForCausalLM, HuginnConfig, HUGINN),
}


def model_config(name: str, scale_down: int = 1) -> PretrainedConfig:
    """The real config of ``name``; ``scale_down`` > 1 divides the heads, widths and (Ouro) layer count by
    it, keeping the head width and loop counts (tests and CPU dry runs)."""
    _, config_cls, kwargs = MODELS[name]
    kwargs = dict(kwargs)
    if scale_down > 1:
        heads = "n_heads" if "n_heads" in kwargs else "num_attention_heads"
        head_dim = HUGINN["n_embd"] // HUGINN["n_heads"] if heads == "n_heads" else OURO["head_dim"]
        kwargs[heads] = max(1, kwargs[heads] // scale_down)
        kwargs["n_embd" if heads == "n_heads" else "hidden_size"] = kwargs[heads] * head_dim
        kwargs["intermediate_size"] //= scale_down
        if heads == "num_attention_heads":
            kwargs["num_key_value_heads"] = kwargs[heads]
            kwargs["num_hidden_layers"] = max(1, kwargs["num_hidden_layers"] // scale_down)
    return config_cls(**kwargs)


@torch.no_grad()
def random_model(name: str, device: str = "cpu", *, seed: int = 0, scale_down: int = 1) -> torch.nn.Module:
    """The model of ``name`` with random bf16 weights, built and drawn on ``device``."""
    model_cls, _, _ = MODELS[name]
    config = model_config(name, scale_down)
    config.dtype = "bfloat16"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # parameters are made in bf16 directly on the device
    try:
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(device=device).manual_seed(seed)
    std = getattr(config, "initializer_range", 0.02)
    for pname, p in model.named_parameters():  # drawn again: the values depend only on the seed
        if p.dim() >= 2:
            p.normal_(0.0, std, generator=gen)
        elif pname.endswith("bias"):
            p.zero_()
        else:
            p.fill_(1.0)  # norm weights
    return model.eval()


def write_checkpoint(name: str, out: Path, device: str = "cpu", *, seed: int = 0, scale_down: int = 1) -> Path:
    """Write ``out``/config.json, model safetensors and the shipped tokenizer; returns ``out``."""
    out = Path(out)
    model = random_model(name, device, seed=seed, scale_down=scale_down)
    model.save_pretrained(out)
    for file in TOKENIZER_FILES:
        shutil.copy(TOKENIZER / file, out / file)
    return out


def main() -> None:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale-down", type=int, default=1, help="divide widths and layers by this (tests, dry runs)")
    args = p.parse_args()
    start = time.time()
    write_checkpoint(args.model, args.out, args.device, seed=args.seed, scale_down=args.scale_down)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"{args.model}: wrote {args.out} ({size / 1e9:.2f} GB) in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
