"""The golden vectors (tests/golden/, written by scripts/make_golden.py with our codec) and our codec, both
against a reader written from docs/bundle-format.md alone (numpy), and the builder's determinism; the
attention-level golden vectors (tests/golden_attention/, scripts/make_attention_golden.py) against independent
computations (the decode kernel reproducing them: test_decode_attention.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_script
from safetensors.torch import load_file
from support.golden import GOLDEN, GOLDEN_ATTENTION, attention_golden_case

from loopvq_calib.bundle.reader import load_bundle
from loopvq_calib.codes.packing import read_indices
from loopvq_calib.models.common import apply_rope, rope_angles

CASES = ("ouro_loopvq", "huginn_tasq_loopvq", "ouro_tasq_loopvq_channels")


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    return load_file(str(GOLDEN / "inputs.safetensors"))


@pytest.fixture(scope="module")
def expected() -> dict[str, torch.Tensor]:
    return load_file(str(GOLDEN / "expected.safetensors"))


class SpecReader:
    """A reader written from docs/bundle-format.md alone (numpy, float32), not from our codec."""

    def __init__(self, folder: Path) -> None:
        self.meta = json.loads((folder / "loopvq.json").read_text())
        self.t = {
            k: v.float().numpy() if v.is_floating_point() else v.numpy().astype(np.int64)
            for k, v in load_file(str(folder / "codebooks.safetensors")).items()
        }
        kv = self.meta["kv_layout"]
        self.h, self.d = kv["kv_heads"], kv["head_dim"]

    def _parts(self, key: str, h: int, g: int) -> tuple[np.ndarray, np.ndarray]:
        cb, groups = self.t[f"{key}.codebook"], self.t[f"{key}.groups"]
        hc = h if cb.shape[0] == self.h else 0
        gc = g if cb.shape[1] == groups.shape[1] else 0
        return cb[hc, gc], groups[h if groups.shape[0] == self.h else 0, g]

    def encode(self, block: dict, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        n_tok, steps = x.shape[:2]
        sigma = None
        if block["tasq"]:
            w = self.t[f"{block['key']}.tasq_weight"]
            rms = np.sqrt(np.mean((w * x) ** 2, axis=(2, 3), dtype=np.float32))
            sigma = np.maximum(rms, np.float32(block["sigma_min"])).astype(np.float16)
            x = (x * w) / sigma.astype(np.float32)[:, :, None, None]
        n = self.t[f"{block['key']}.groups"].shape[1]
        idx = np.zeros((n_tok, self.h, n), np.uint8)
        for h in range(self.h):
            flat = x[:, :, h, :].reshape(n_tok, steps * self.d)  # coordinate m*D + d
            for g in range(n):
                e, coords = self._parts(block["key"], h, g)
                dist = (e * e).sum(-1)[None] - 2 * flat[:, coords] @ e.T
                idx[:, h, g] = dist.argmin(-1)  # first (lowest) index on ties
        return idx, sigma

    def decode(self, block: dict, idx: np.ndarray, sigma: np.ndarray | None) -> np.ndarray:
        n_tok, steps = idx.shape[0], len(block["sites"])
        flat = np.zeros((n_tok, self.h, steps * self.d), np.float32)
        for h in range(self.h):
            for g in range(idx.shape[2]):
                e, coords = self._parts(block["key"], h, g)
                flat[:, h, coords] = e[idx[:, h, g]]
        x = flat.reshape(n_tok, self.h, steps, self.d).transpose(0, 2, 1, 3)
        if block["tasq"]:
            x = (x * sigma.astype(np.float32)[:, :, None, None]) / self.t[f"{block['key']}.tasq_weight"]
        return x

    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        d, style = self.d, self.meta["rope"]["style"]
        inv = 1.0 / (self.meta["rope"]["theta"] ** (np.arange(0, d, 2, dtype=np.float32) / d))
        ang = positions.astype(np.float32)[:, None, None, None] * inv.astype(np.float32)
        cos, sin = np.cos(ang), np.sin(ang)
        a, b = (x[..., : d // 2], x[..., d // 2 :]) if style == "half" else (x[..., 0::2], x[..., 1::2])
        ra, rb = a * cos - b * sin, b * cos + a * sin
        return np.concatenate([ra, rb], -1) if style == "half" else np.stack([ra, rb], -1).reshape(x.shape)


def spec_values(case: str, inputs: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Indices, sigma, decoded and RoPE'd decoded keys of every block of ``case``, computed by :class:`SpecReader`
    (numpy, from docs/bundle-format.md): the independent computation both the golden files and our codec are
    held to."""
    reader = SpecReader(GOLDEN / case)
    positions = inputs[f"{case}/positions"].numpy()
    out = {}
    for block in reader.meta["blocks"]:
        key = block["key"]
        idx, sigma = reader.encode(block, inputs[f"{case}/{key}"].numpy())
        decoded = reader.decode(block, idx, sigma)
        out[f"{key}.indices"], out[f"{key}.decoded"] = idx, decoded
        if sigma is not None:
            out[f"{key}.sigma"] = sigma
        if block["kind"] == "key":
            out[f"{key}.decoded_rope"] = reader.rope(decoded, positions)
    return out


def spec_channel_runs(reader: SpecReader, block: dict, idx: np.ndarray, step: int) -> np.ndarray:
    """Step ``step`` of a ``"grouping": "channels"`` block decoded the way docs/bundle-format.md section 4 lets a
    backend read it (numpy, TaSQ aside): each head's channels ordered once, code by code (code g's channel set
    S_g, the same at every step), and code g's step slice read as one run of codeword values in that order."""
    d = reader.d
    out = np.zeros((idx.shape[0], reader.h, d), np.float32)
    for h in range(reader.h):
        runs, order = [], []
        for g in range(idx.shape[2]):
            e, coords = reader._parts(block["key"], h, g)
            mine = np.flatnonzero(coords // d == step)
            channels = coords[mine] % d
            assert all(sorted(coords[coords // d == m] % d) == sorted(channels) for m in range(len(block["sites"])))
            slot = mine[np.argsort(channels)]  # positions of the run, by channel
            runs.append(e[idx[:, h, g]][:, slot])
            order += sorted(channels)
        out[:, h, order] = np.concatenate(runs, 1)
    return out


@pytest.mark.parametrize("block", ["key.b0.l0", "key.b0.l1"])
def test_channels_blocks_read_as_per_code_runs(block, inputs, expected):
    """A flagged block's codes read as runs of one fixed channel set per code (the fast-path reading the format
    describes) give the golden decoded keys (before TaSQ's sigma / w, applied here as section 6.2 says)."""
    reader = SpecReader(GOLDEN / "ouro_tasq_loopvq_channels")
    meta = next(b for b in reader.meta["blocks"] if b["key"] == block)
    assert meta["grouping"] == "channels"
    idx = expected[f"ouro_tasq_loopvq_channels/{block}.indices"].numpy()
    sigma = expected[f"ouro_tasq_loopvq_channels/{block}.sigma"].numpy().astype(np.float32)
    weight = reader.t[f"{block}.tasq_weight"]
    for m in range(4):
        got = spec_channel_runs(reader, meta, idx, m) * sigma[:, m, None, None] / weight[m]
        want = expected[f"ouro_tasq_loopvq_channels/{block}.decoded"][:, m].numpy()
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def _check(name: str, got: np.ndarray, want: np.ndarray) -> None:
    if name.endswith((".indices", ".sigma")):
        np.testing.assert_array_equal(got, want, err_msg=name)
    else:  # float32 sums in another order: within rounding
        np.testing.assert_allclose(got, want, atol=1e-5 if name.endswith("_rope") else 1e-6, rtol=0, err_msg=name)


@pytest.mark.parametrize("case", CASES)
def test_golden_files_hold_what_the_spec_reader_computes(case, inputs, expected):
    """The shipped expected values (what a backend checks itself against) are the spec's, not just our codec's."""
    spec = spec_values(case, inputs)
    assert {k for k in expected if k.startswith(case + "/")} == {f"{case}/{k}" for k in spec}
    for name, want in spec.items():
        _check(name, expected[f"{case}/{name}"].numpy(), want)


@pytest.mark.parametrize("case", CASES)
def test_reference_codec_matches_the_spec_reader(case, inputs):
    """Our codec (encode, decode, then the model's RoPE) against the independent spec reader."""
    spec = spec_values(case, inputs)
    bundle = load_bundle(GOLDEN / case)
    kv = bundle.quantizer.kv
    cos, sin = rope_angles(inputs[f"{case}/positions"][None], kv.head_dim, kv.rope_theta)
    assert len(bundle.quantizer.codecs) == len(bundle.meta["blocks"]) >= 4
    for key, codec in bundle.quantizer.codecs.items():
        codes = codec.encode(inputs[f"{case}/{key}"])
        assert codes.indices.dtype == torch.uint8
        _check(f"{key}.indices", codes.indices.numpy(), spec[f"{key}.indices"])
        assert (codes.sigma is None) == (codec.transform is None) == (f"{key}.sigma" not in spec), key
        if codec.transform is not None:
            _check(f"{key}.sigma", codes.sigma.numpy(), spec[f"{key}.sigma"])
        decoded = codec.decode(codes)
        _check(f"{key}.decoded", decoded.numpy(), spec[f"{key}.decoded"])
        if codec.layout.kind == "key":
            roped = torch.stack(
                [apply_rope(decoded[:, m][None], cos, sin, style=kv.rope_style)[0] for m in range(codec.layout.steps)],
                1,
            )
            _check(f"{key}.decoded_rope", roped.numpy(), spec[f"{key}.decoded_rope"])


def test_golden_covers_the_edge_cases(expected):
    huginn = load_bundle(GOLDEN / "huginn_tasq_loopvq")
    assert huginn.meta["codebook_sharing"] == "heads" and huginn.meta["rope"]["style"] == "interleaved"
    assert {b["name"] for b in huginn.meta["blocks"]} >= {"prelude.l0", "coda.l0", "b0.l0", "b0.l1"}
    clamp = torch.tensor(1e-4).half()
    sigmas = [t for k, t in expected.items() if k.endswith(".sigma")]
    assert sigmas and all(s[0, -1] == clamp for s in sigmas)  # the all-zero site hits the sigma clamp
    tasq = huginn.quantizer.codecs["key.b0.l0"]
    assert tasq.layout.groups.shape[0] == 2 and not torch.equal(tasq.layout.groups[0], tasq.layout.groups[1])
    pairs = tasq.layout.groups // 2  # interleaved RoPE pair id (flat coordinate // 2)
    assert all(
        (pairs[h, g].view(-1, 2)[:, 0] == pairs[h, g].view(-1, 2)[:, 1]).all() for h in range(2) for g in range(4)
    )
    assert load_bundle(GOLDEN / "ouro_loopvq").meta["rope"]["style"] == "half"
    assert [load_bundle(GOLDEN / c).meta["format_version"] for c in CASES] == ["1.1", "1.1", "1.2"]
    channels = load_bundle(GOLDEN / "ouro_tasq_loopvq_channels")
    flagged = {b["key"] for b in channels.meta["blocks"] if b.get("grouping") == "channels"}
    assert flagged == {"key.b0.l0", "key.b0.l1"} and channels.meta["codebook_sharing"] == "groups"
    groups = channels.quantizer.codecs["key.b0.l1"].layout.groups.tolist()
    pairs = [[sorted({c % 4 for c in code}) for code in head] for head in groups]
    assert pairs == [[[0, 1], [2, 3]], [[0, 2], [1, 3]]]  # half-split pair i = channels (i, i + 4); head 1 permuted


def _same_golden_tensor(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Rebuilt golden tensors: inputs, indices, sigmas and codebooks bit for bit; decoded float32 values within
    float32 rounding (the TaSQ inverse is a float32 matmul whose accumulation order follows the CPU's vector
    width, AVX2 vs AVX-512, so the last bit of ``.decoded`` differs between machines)."""
    assert got.dtype == want.dtype and got.shape == want.shape, name
    if ".decoded" in name:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * max(want.abs().max().item(), 1.0), msg=name)
    else:
        assert torch.equal(got, want), name


def test_builder_is_deterministic(inputs, expected, tmp_path):
    module = load_script("make_golden")
    cases = module.build_cases()
    assert [c.name for c in cases] == list(CASES)
    rebuilt = {k: v for c in cases for part in (c.inputs, c.expected) for k, v in part.items()}
    assert rebuilt.keys() == inputs.keys() | expected.keys()
    for name, t in rebuilt.items():
        _same_golden_tensor(name, t, inputs.get(name, expected.get(name)))
    module.write_golden(tmp_path)  # and the files byte for byte (loopvq.json up to the producer version)
    files = sorted(p.relative_to(GOLDEN) for p in GOLDEN.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    for rel in files:
        if rel.name == "loopvq.json":
            old, new = (json.loads((root / rel).read_text()) for root in (GOLDEN, tmp_path))
            ignore = {"producer": None, "files": None, "meta_sha256": None}  # the checksum covers the version
            assert {**old, **ignore} == {**new, **ignore}, rel
            assert old["files"]["codebooks.safetensors"] == new["files"]["codebooks.safetensors"], rel
        elif rel.name == "expected.safetensors":  # holds the decoded values: tensor by tensor, as above
            old, new = (load_file(str(root / rel)) for root in (GOLDEN, tmp_path))
            assert old.keys() == new.keys(), rel
            for name in old:
                _same_golden_tensor(name, new[name], old[name])
        elif rel.name != "README.md" or rel.parent == Path("."):
            assert (GOLDEN / rel).read_bytes() == (tmp_path / rel).read_bytes(), rel


def test_golden_files_are_small():
    total = sum(p.stat().st_size for p in GOLDEN.rglob("*") if p.is_file())
    assert total < 200_000


# -- attention-level golden vectors (tests/golden_attention) --------------------------------------------------


def test_attention_golden_vectors_are_rebuilt_identically():
    module, *_ = attention_golden_case("ouro_loopvq")
    stored = load_file(str(GOLDEN_ATTENTION / "attention.safetensors"))
    rebuilt = module.build()
    assert rebuilt.keys() == stored.keys()
    for name, t in rebuilt.items():
        assert t.dtype == stored[name].dtype and torch.equal(t, stored[name]), name
    assert (GOLDEN_ATTENTION / "README.md").read_text() == module.README


@pytest.mark.parametrize("case", CASES)
def test_attention_golden_output_from_the_decoded_golden_tensors(case):
    """Independent of the reference function: the decoded (and rotated) keys and decoded values stored in
    tests/golden/expected.safetensors, the full-precision tokens rotated with the model's apply_rope, a float64
    softmax."""
    _, block, bundle, _ = attention_golden_case(case)
    gold = load_file(str(GOLDEN_ATTENTION / "attention.safetensors"))
    expected = load_file(str(GOLDEN / "expected.safetensors"))
    rope = bundle.meta["rope"]
    keys = expected[f"{case}/key.{block}.decoded_rope"]  # [N, T, H, D]
    values = expected[f"{case}/value.{block}.decoded"]
    fp_pos = gold[f"{case}/fp_positions"]
    for m in range(keys.shape[1]):
        cos, sin = rope_angles(fp_pos[None], keys.shape[-1], rope["theta"])
        fk = apply_rope(gold[f"{case}/fp_keys"][m][None], cos, sin, style=rope["style"])[0]
        k = torch.cat([keys[:, m], fk]).double().repeat_interleave(2, 1)  # [S, Hq, D]
        v = torch.cat([values[:, m], gold[f"{case}/fp_values"][m]]).double().repeat_interleave(2, 1)
        q = gold[f"{case}/query"][m].double()
        w = (torch.einsum("hd,shd->hs", q, k) / math.sqrt(q.shape[-1])).softmax(-1)
        out = torch.einsum("hs,shd->hd", w, v)
        assert ((out - gold[f"{case}/output"][m].double()).norm() / out.norm()) < 1e-5


def spec_unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Bit-packed indices as docs/bundle-format.md section 8 states them, written from the text: index j is
    bits j*b .. j*b + b - 1 of the row's stream, least significant first; stream bit t is bit t % 8 of byte
    t // 8."""
    out = np.zeros(packed.shape[:-1] + (count,), dtype=np.int64)
    for j in range(count):
        for k in range(bits):
            t = j * bits + k
            out[..., j] |= ((packed[..., t // 8].astype(np.int64) >> (t % 8)) & 1) << k
    return out


@pytest.mark.parametrize("case", CASES)
def test_attention_golden_packed_codes_are_the_golden_indices(case):
    """The 1.1 packed form of the golden codes: a spec-text unpacker and the package's reader both give the plain
    indices of tests/golden/."""
    _, block, bundle, _ = attention_golden_case(case)
    gold = load_file(str(GOLDEN_ATTENTION / "attention.safetensors"))
    expected = load_file(str(GOLDEN / "expected.safetensors"))
    k = bundle.meta["codebook_size"]
    for kind in ("key", "value"):
        plain = expected[f"{case}/{kind}.{block}.indices"]
        packed = gold[f"{case}/{kind}.indices_packed"]
        assert packed.dtype == torch.uint8 and packed.shape[-1] == -(-plain.shape[-1] * 4 // 8)  # K 16: 4 bits
        assert np.array_equal(spec_unpack(packed.numpy(), int(math.log2(k)), plain.shape[-1]), plain.numpy())
        assert torch.equal(read_indices(gold, f"{case}/{kind}", k, count=plain.shape[-1]), plain.long())
