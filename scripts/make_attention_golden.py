"""Attention-level golden vectors for serving backends: tests/golden_attention/ (deterministic).

For one loop block of each golden bundle (tests/golden/, written by scripts/make_golden.py) and every step of
that block: a query (post-RoPE, 2 query heads per KV head), the block's 16 coded tokens (the indices and
sigma of expected.safetensors, at positions 8..23), 8 sink tokens (positions 0..7) and 5 window tokens
(positions 24..28) in full precision (pre-RoPE), and the expected attention output, computed in float64 by
``decode_attention_reference`` (decode, RoPE, softmax over all 29 tokens, scale 1/sqrt(D)).

    python scripts/make_attention_golden.py [OUT_DIR]

It reads the golden bundles and codes of tests/golden/ and writes ``attention.safetensors`` and ``README.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loopvq_calib import load_bundle  # noqa: E402
from loopvq_calib.codes.packing import indices_entries  # noqa: E402
from loopvq_calib.serving.decode_attention import CodedTokens, decode_attention_reference  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden"
OUT = Path(__file__).resolve().parents[1] / "tests" / "golden_attention"
BLOCKS = {
    "ouro_loopvq": "b0.l1",
    "huginn_tasq_loopvq": "b0.l0",  # Huginn's: TaSQ keys, per-head permuted groups
    "ouro_tasq_loopvq_channels": "b0.l1",
}  # TaSQ keys in a channels layout, its pairs permuted in head 1
SINKS, WINDOW, QUERY_GROUP = 8, 5, 2


def build(golden: Path = GOLDEN) -> dict[str, torch.Tensor]:
    """The attention golden tensors, ``{case}/...`` (see the README section written beside them)."""
    expected = load_file(str(golden / "expected.safetensors"))
    inputs = load_file(str(golden / "inputs.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for case, block in BLOCKS.items():
        bundle = load_bundle(golden / case)
        kc, vc = (bundle.quantizer.codecs[f"{kind}.{block}"] for kind in ("key", "value"))
        rope = bundle.meta["rope"]
        heads, d, steps = kc.layout.kv_heads, kc.layout.head_dim, kc.layout.steps
        coded_pos = inputs[f"{case}/positions"]
        n = coded_pos.numel()
        fp_pos = torch.cat([torch.arange(SINKS), torch.arange(WINDOW) + int(coded_pos[-1]) + 1])
        sigma = expected.get(f"{case}/key.{block}.sigma")
        coded = CodedTokens(
            expected[f"{case}/key.{block}.indices"][None],
            expected[f"{case}/value.{block}.indices"][None],
            None if sigma is None else sigma[None],
            n,
            coded_pos[:1],
        )
        gen = torch.Generator().manual_seed(7)
        query = torch.randn(steps, heads * QUERY_GROUP, d, generator=gen)
        fp_keys = torch.randn(steps, SINKS + WINDOW, heads, d, generator=gen)
        fp_values = torch.randn(steps, SINKS + WINDOW, heads, d, generator=gen)
        outputs = [
            decode_attention_reference(
                query[m][None],
                kc,
                vc,
                step=m,
                coded=coded,
                fp_keys=fp_keys[m][None],
                fp_values=fp_values[m][None],
                fp_positions=fp_pos[None],
                fp_mask=None,
                rope_style=rope["style"],
                rope_theta=rope["theta"],
            )[0]
            for m in range(steps)
        ]
        for kind in ("key", "value"):  # the coded tokens' indices bit-packed (format 1.1, bundle-format section 8)
            idx = expected[f"{case}/{kind}.{block}.indices"]
            out.update(indices_entries(f"{case}/{kind}", idx, bundle.meta["codebook_size"], form="packed"))
        out.update(
            {
                f"{case}/query": query,
                f"{case}/fp_keys": fp_keys,
                f"{case}/fp_values": fp_values,
                f"{case}/fp_positions": fp_pos,
                f"{case}/coded_positions": coded_pos.clone(),
                f"{case}/output": torch.stack(outputs).float(),
            }
        )
    return out


README = """# Attention-level golden vectors

Written by `scripts/make_attention_golden.py` from the bundles and codes of `tests/golden/` (read its README
first); `tests/bundle/test_golden.py` checks them against an independent computation,
`tests/serving/test_decode_attention.py` against the Triton kernel. They let a serving backend check its whole
decode-attention path: codes -> decoded keys and values -> RoPE -> softmax over coded and full-precision tokens.

For each case, one loop block (`ouro_loopvq`: `b0.l1`, half-split RoPE; `huginn_tasq_loopvq`: `b0.l0`, TaSQ
keys with per-head permuted groups, interleaved RoPE; `ouro_tasq_loopvq_channels`: `b0.l1`, TaSQ keys in a
channels layout, format 1.2's `"grouping": "channels"`, half-split RoPE: head 1's codes hold the RoPE pairs
{0, 2} and {1, 3}, so a backend reading it through a per-head pair permutation is checked) and every step `m`
of it (T = 4), one sequence:

| tensor `{case}/...` | shape | meaning |
|---|---|---|
| `query` | [T, 4, 8] float32 | post-RoPE query of step `m`: 4 query heads, 2 per KV head \
(query head `q` reads KV head `q // 2`) |
| `coded_positions` | [16] int64 | positions 8..23 of the 16 coded tokens; their codes are \
`tests/golden/expected.safetensors`' `{case}/key.{block}.indices`, `.sigma` (TaSQ) and \
`{case}/value.{block}.indices` |
| `key.indices_packed`, `value.indices_packed` | [16, 2, ceil(n * 4 / 8)] uint8 (n: the block's codes per head) \
| the same codes bit-packed (K = 16: 4 bits per index, LSB first; bundle-format section 8): unpacked, they \
equal the plain indices above |
| `fp_keys`, `fp_values` | [T, 13, 2, 8] float32 | full-precision tokens of step `m`'s site, keys pre-RoPE: \
8 sinks then 5 window tokens |
| `fp_positions` | [13] int64 | their positions: 0..7, then 24..28 |
| `output` | [T, 4, 8] float32 | softmax(q . k / sqrt(8)) v over the 29 tokens, computed in float64 |

A reader passes when its output is within 1e-5 (relative L2 per step) of `output`, decoding the given codes
(no encoding is involved, so there are no near-ties); a reader of packed codes reads them from the
`indices_packed` tensors instead.
"""


def main() -> None:
    """Write the golden tensors and README.md to the folder given (default tests/golden_attention)."""
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    out.mkdir(parents=True, exist_ok=True)
    save_file(build(), str(out / "attention.safetensors"), metadata={"blocks": str(BLOCKS)})
    (out / "README.md").write_text(README)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
