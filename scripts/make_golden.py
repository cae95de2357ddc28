"""Write the golden vectors under tests/golden/ for serving-backend authors (deterministic, seeded).

Three tiny bundles built from hand-made layouts and random codebooks (no calibration):
  ouro_loopvq          Ouro-like: 2 layers x 4 loop steps, half-split RoPE, loop-axis groups, float16 codebooks
  huginn_tasq_loopvq   Huginn-like: prelude 1 + core 2 (r = 4) + coda 1, interleaved RoPE, TaSQ keys with
                       per-head permuted groups that keep RoPE pairs together, bfloat16 codebooks shared over heads
  ouro_tasq_loopvq_channels
                       Ouro-like, TaSQ keys with a channels layout (each code: the same 2 RoPE pairs at every step;
                       format 1.2's grouping flag), G = 16, float32 codebooks shared over a head's groups
plus inputs.safetensors (pre-RoPE keys/values per block, positions), expected.safetensors (indices, sigma,
decoded, decoded keys after RoPE) and README.md. Run: ``python scripts/make_golden.py [OUT_DIR]``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from loopvq_calib import __version__
from loopvq_calib.bundle.writer import safetensors_bytes, write_bundle
from loopvq_calib.calibration.tasq.grouping import channel_units
from loopvq_calib.codes.codec import BlockCodec, TasqTransform, gather_groups
from loopvq_calib.codes.layouts import BlockLayout, codebook_shape, plan_layouts
from loopvq_calib.codes.quantizer import KVQuantizer
from loopvq_calib.config.schema import QuantConfig, ServingConfig
from loopvq_calib.models.common import apply_rope, rope_angles
from loopvq_calib.models.loading import TORCH_DTYPES, ModelIdentity
from loopvq_calib.models.sites import KVLayout, KVSite

OUT = Path(__file__).resolve().parents[1] / "tests" / "golden"
TOKENS = 16
POSITION_OFFSET = 8  # the tokens follow 8 sink tokens
MARGIN = 1e-3  # second-nearest codeword distance minus nearest, for every group vector
HEADS, HEAD_DIM, LOOPS, K, G, T_C = 2, 8, 4, 16, 8, 4
SERVING = ServingConfig(sink_tokens=8, recent_window=16, page_size=8)
CREATED_EPOCH = "1767225600"  # 2026-01-01T00:00:00Z, so loopvq.json is byte-stable


@dataclass
class GoldenCase:
    """One golden bundle's quantizer and identity, and its input and expected tensors."""

    name: str
    quantizer: KVQuantizer
    codebook_dtype: str
    identity: ModelIdentity
    inputs: dict[str, torch.Tensor]  # "{case}/{block key}" [N, T, H, D] fp32, "{case}/positions" [N]
    expected: dict[str, torch.Tensor]  # "{case}/{block key}.indices|.sigma|.decoded|.decoded_rope"


def ouro_layout() -> KVLayout:
    """An Ouro-like layout: 2 layers x 4 loop steps, half-split RoPE."""
    sites = tuple(KVSite(t * 2 + l, t, l, True, "loop") for t in range(LOOPS) for l in range(2))
    return KVLayout("ouro", sites, LOOPS, HEADS, HEAD_DIM, "half", 10000.0)


def huginn_layout() -> KVLayout:
    """A Huginn-like layout: prelude 1, core 2 x 4 recurrences, coda 1, interleaved RoPE."""
    p, core = 1, 2
    sites = [KVSite(0, 0, 0, False, "prelude")]
    sites += [KVSite(p + core * t + j, t, j, True, "loop") for t in range(LOOPS) for j in range(core)]
    sites += [KVSite(p + core * LOOPS, 0, 0, False, "coda")]
    return KVLayout("huginn_raven", tuple(sites), LOOPS, HEADS, HEAD_DIM, "interleaved", 500000.0)


def pair_groups(steps: int, gen: torch.Generator) -> torch.Tensor:
    """TaSQ-style permuted groups [H, n, G]: interleaved RoPE pairs (2i, 2i+1) of each step stay together."""
    units = torch.tensor(
        [[m * HEAD_DIM + 2 * i, m * HEAD_DIM + 2 * i + 1] for m in range(steps) for i in range(HEAD_DIM // 2)]
    )
    per_group = G // 2
    return torch.stack(
        [units[torch.randperm(len(units), generator=gen)].reshape(-1, per_group * 2) for _ in range(HEADS)]
    )


def channels_groups(steps: int, group_size: int, style: str, gen: torch.Generator) -> torch.Tensor:
    """A TaSQ channels layout [H, n, G] (``tasq.grouping: channels``): the TaSQ stage's units (one RoPE pair of
    ``style`` at every step) merged at random, G / (2 steps) units per code; coordinates ascending, codes by their
    first coordinate (as the TaSQ stage writes them)."""
    units = channel_units(HEAD_DIM, steps, style)
    out = []
    for _ in range(HEADS):
        groups = units[torch.randperm(len(units), generator=gen)].reshape(-1, group_size).sort(-1).values
        out.append(groups[groups[:, 0].argsort()])
    return torch.stack(out)


def tasq_weight(steps: int, gen: torch.Generator, style: str = "interleaved") -> torch.Tensor:
    """[T, H, D] positive weights, equal within a RoPE pair of ``style``, mean(w^2) = 1 per (step, head).
    Normalised in float64, then rounded: a float32 mean's summation order follows the CPU's vector width, which
    would make the shipped weights' last bit depend on the machine that builds them."""
    w = (0.5 + torch.rand(steps, HEADS, HEAD_DIM // 2, generator=gen)).double()
    w = w.repeat_interleave(2, -1) if style == "interleaved" else w.repeat(1, 1, 2)
    return (w / w.pow(2).mean(-1, keepdim=True).sqrt()).float()


def build_quantizer(
    kv: KVLayout,
    method: str,
    sharing: str,
    *,
    dtype: str,
    gen: torch.Generator,
    group_size: int = G,
    grouping: str = "free",
) -> KVQuantizer:
    """Random codebooks (rounded to ``dtype``) for every layout of ``method``; TaSQ keys get pair-preserving
    permuted groups (``grouping`` free) or a channels layout, and random weights."""
    quant = QuantConfig(
        method=method, bits=None, codebook_size=K, group_size=group_size, steps_per_block=T_C, codebook_sharing=sharing
    )
    codecs = {}
    for lay in plan_layouts(kv, quant):
        transform = None
        if quant.uses_tasq and lay.kind == "key":
            groups = (
                channels_groups(lay.steps, group_size, kv.rope_style, gen)
                if grouping == "channels"
                else pair_groups(lay.steps, gen)
            )
            lay = BlockLayout(lay.name, lay.kind, lay.sites, HEAD_DIM, HEADS, groups)
            transform = TasqTransform(tasq_weight(lay.steps, gen, kv.rope_style), sigma_min=1e-4)
        lay.check()
        cb = torch.randn(codebook_shape(lay, K, sharing), generator=gen).to(TORCH_DTYPES[dtype]).float()
        codecs[lay.key] = BlockCodec(lay, cb, transform)
    return KVQuantizer(codecs, method, K, group_size, T_C, sharing, kv)


def _bad_tokens(codec: BlockCodec, x: torch.Tensor) -> torch.Tensor:
    """Tokens whose nearest codeword is ambiguous (margin <= MARGIN) or whose sigma lies near an fp16 tie."""
    bad = torch.zeros(x.shape[0], dtype=torch.bool)
    z = x
    if codec.transform is not None:
        wx = x * codec.transform.weight
        rms = wx.pow(2).mean(dim=(-1, -2)).sqrt()
        free = rms > codec.transform.sigma_min
        near_tie = ((rms * (1 + 1e-5)).half() != rms.half()) | ((rms * (1 - 1e-5)).half() != rms.half())
        bad |= (free & near_tie).any(-1)
        z = codec.transform.forward(x, codec.transform.sigma(x))
    zg = gather_groups(z, codec.layout.groups)  # [N, H, n, G]
    cb = codec.codebook.expand(HEADS, zg.shape[2], -1, -1)
    dist = cb.pow(2).sum(-1) - 2 * torch.einsum("thng,hnkg->thnk", zg, cb)
    top2 = dist.topk(2, dim=-1, largest=False).values
    bad |= ((top2[..., 1] - top2[..., 0]) <= MARGIN).flatten(1).any(-1)
    return bad


def block_inputs(codec: BlockCodec, gen: torch.Generator) -> torch.Tensor:
    """[N, T, H, D] inputs with unambiguous codes; TaSQ keys get scale/offset and exact-zero sites (sigma clamp)."""
    shape = (TOKENS, codec.layout.steps, HEADS, HEAD_DIM)
    tasq = codec.transform is not None

    def sample(n: int) -> torch.Tensor:  # n tokens' inputs
        x = torch.randn(n, *shape[1:], generator=gen)
        return x * 3.0 + 0.5 if tasq else x

    x = sample(TOKENS)
    for _ in range(100):
        if tasq:
            x[0, -1] = 0.0  # token 0's last site is all zero: sigma = fp16(sigma_min)
        bad = _bad_tokens(codec, x)
        if not bad.any():
            return x
        x[bad] = sample(int(bad.sum()))
    raise RuntimeError(f"{codec.layout.key}: could not draw unambiguous inputs")


def build_case(
    name: str,
    kv: KVLayout,
    method: str,
    *,
    sharing: str,
    dtype: str,
    seed: int,
    group_size: int = G,
    grouping: str = "free",
) -> GoldenCase:
    """The golden case ``name``: its quantizer, unambiguous inputs and their codes, decoded values and (keys) the
    decoded values after RoPE."""
    gen = torch.Generator().manual_seed(seed)
    q = build_quantizer(kv, method, sharing, dtype=dtype, gen=gen, group_size=group_size, grouping=grouping)
    positions = torch.arange(TOKENS) + POSITION_OFFSET
    cos, sin = rope_angles(positions[None], HEAD_DIM, kv.rope_theta)
    inputs, expected = {f"{name}/positions": positions}, {}
    for key, codec in q.codecs.items():
        x = block_inputs(codec, gen)
        codes = codec.encode(x)
        y = codec.decode(codes).contiguous()
        inputs[f"{name}/{key}"] = x
        expected[f"{name}/{key}.indices"] = codes.indices
        expected[f"{name}/{key}.decoded"] = y
        if codes.sigma is not None:
            expected[f"{name}/{key}.sigma"] = codes.sigma
        if codec.layout.kind == "key":
            rope = [apply_rope(y[:, m][None], cos, sin, style=kv.rope_style)[0] for m in range(codec.layout.steps)]
            expected[f"{name}/{key}.decoded_rope"] = torch.stack(rope, 1).contiguous()
    config_json = json.dumps({"model_type": kv.model_type, "golden": name}, sort_keys=True).encode()
    identity = ModelIdentity(f"golden/{name}", None, kv.model_type, hashlib.sha256(config_json).hexdigest(), [])
    return GoldenCase(name, q, dtype, identity, inputs, expected)


def build_cases() -> list[GoldenCase]:
    """The golden cases, rebuilt identically on every call."""
    return [
        build_case("ouro_loopvq", ouro_layout(), "loopvq", sharing="none", dtype="float16", seed=1),
        build_case("huginn_tasq_loopvq", huginn_layout(), "tasq+loopvq", sharing="heads", dtype="bfloat16", seed=2),
        build_case(
            "ouro_tasq_loopvq_channels",
            ouro_layout(),
            "tasq+loopvq",
            sharing="groups",
            dtype="float32",
            seed=3,
            group_size=16,
            grouping="channels",
        ),
    ]


README = """# Golden vectors for LoopVQ bundle readers

Written by `scripts/make_golden.py` (deterministic; `tests/bundle/test_golden.py` checks that our reference
encoder/decoder reproduces them and that the script rebuilds identical tensors). The format itself is
specified in `docs/bundle-format.md`; these files let a serving backend check its reader bit for bit.

## Files
- `ouro_loopvq/`: a bundle for an Ouro-like layout: 2 layers x 4 loop steps (sites `step*2 + layer`),
  2 KV heads, head dim 8, half-split RoPE (theta 10000), method `loopvq`: K = 16, G = 8, T_c = 4 (c = 2
  channels per step per code, 4 joint groups per head), one codebook per (block, head, group) in float16.
- `huginn_tasq_loopvq/`: a bundle for a Huginn-like layout: prelude 1 layer (site 0), core 2 layers x r = 4
  (sites `1 + 2t + j`), coda 1 layer (site 9), interleaved RoPE (theta 500000), method `tasq+loopvq`:
  TaSQ on keys with per-head permuted groups (`groups` [2, n, 8]) that keep every RoPE pair (2i, 2i+1) of a
  step in one code, codebooks shared across heads (`[1, n, K, G]`, broadcast) in bfloat16. Prelude and coda
  are single-site blocks coded like CQ.
- `ouro_tasq_loopvq_channels/`: the Ouro-like layout of `ouro_loopvq` (half-split RoPE, theta 10000), method
  `tasq+loopvq` with G = 16 (c = 4 channels per step per code, 2 codes per head) and TaSQ keys in a *channels*
  layout: each code holds the same 2 RoPE pairs `(i, i + 4)` at every step (per head; coordinates ascending,
  codes by first coordinate), so its key blocks carry `"grouping": "channels"` and the bundle is format 1.2
  (`docs/bundle-format.md` section 4: step `m`'s slice of a code is those 4 channels). In `key.b0.l1` head 0's
  codes hold pairs {0, 1} and {2, 3}, head 1's {0, 2} and {1, 3}. Codebooks shared across a head's groups
  (`[H, 1, K, G]`) in float32; values keep loop-axis groups.
- `inputs.safetensors`: `{case}/{kind}.{block}` float32 [N, T, H, D]: the pre-RoPE keys or values of the
  block's T sites (in the order of `blocks[].sites` in loopvq.json) for N = 16 tokens; `{case}/positions`
  int64 [N]: the tokens' absolute positions (after 8 sink tokens), for RoPE.
- `expected.safetensors`, per block:
  - `{case}/{kind}.{block}.indices` uint8 [N, H, n]: the code of every (token, head, group);
  - `{case}/key.{block}.sigma` float16 [N, T]: TaSQ's per-token, per-site scale (TaSQ key blocks only);
  - `{case}/{kind}.{block}.decoded` float32 [N, T, H, D]: decode of those indices (and sigma), pre-RoPE;
  - `{case}/key.{block}.decoded_rope` float32 [N, T, H, D]: decoded keys after RoPE at `positions`.

## How to use them
1. Read each bundle as the format document says (check the sha256 in `loopvq.json`).
2. Encode the inputs: indices must be equal, sigma bitwise equal. Every group vector's nearest codeword beats
   the second nearest by more than 1e-3 in the distance ||c||^2 - 2 z.c, and no sigma lies within 1e-5
   (relative) of a float16 rounding tie, so fp32 arithmetic in any order gives the same codes.
3. Decode the expected indices (and sigma): within 1e-6 of `decoded`; after RoPE within 1e-5 of
   `decoded_rope`.

Edge cases covered: token 0 of every TaSQ key block has an all-zero last site (its sigma is the clamp,
float16(1e-4), and its group vectors are zero there); codebook broadcast over heads and over a head's groups;
per-head groups; float16, bfloat16 and float32 codebooks; single-site (prelude/coda) blocks; loop blocks of
4 steps; a format 1.2 bundle whose key blocks are flagged `"grouping": "channels"` (a reader of 1.1 ignores
the flag and reads the same groups).

## Tensors
| name | shape | dtype |
|---|---|---|
"""


def golden_readme(inputs: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> str:
    """README.md: the fixed text and a table of every tensor."""
    rows = [
        f"| `{k}` | {list(t.shape)} | {str(t.dtype).replace('torch.', '')} |"
        for k, t in sorted({**inputs, **expected}.items())
    ]
    return README + "\n".join(rows) + "\n"


def write_golden(out: Path = OUT) -> None:
    """(Re)write every golden file under ``out``; byte-identical on every run of the same toolkit version."""
    out.mkdir(parents=True, exist_ok=True)
    previous = os.environ.get("SOURCE_DATE_EPOCH")
    os.environ["SOURCE_DATE_EPOCH"] = CREATED_EPOCH
    inputs, expected = {}, {}
    try:
        for case in build_cases():
            write_bundle(
                out / case.name,
                case.quantizer,
                name=case.name,
                identity=case.identity,
                calibration={"dataset": "none: random codebooks and inputs for test vectors"},
                metrics={},
                serving=SERVING,
                codebook_dtype=case.codebook_dtype,
                config={"golden": {"tokens": TOKENS, "position_offset": POSITION_OFFSET, "margin": MARGIN}},
                producer_version=__version__,
            )
            inputs.update(case.inputs)
            expected.update(case.expected)
    finally:
        if previous is None:
            del os.environ["SOURCE_DATE_EPOCH"]
        else:
            os.environ["SOURCE_DATE_EPOCH"] = previous
    meta = {"format": "loopvq-golden", "tokens": str(TOKENS), "margin": str(MARGIN)}
    (out / "inputs.safetensors").write_bytes(safetensors_bytes(inputs, meta))
    (out / "expected.safetensors").write_bytes(safetensors_bytes(expected, meta))
    (out / ".gitattributes").write_text("* -text\n")  # checksummed files must keep their bytes
    (out / "README.md").write_text(golden_readme(inputs, expected))


if __name__ == "__main__":
    write_golden(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
    print(f"wrote golden vectors to {sys.argv[1] if len(sys.argv) > 1 else OUT}")
