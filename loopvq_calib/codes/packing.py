"""Index storage in format files: plain uint8/int32 indices, or bit-packed (docs/bundle-format.md section 8)."""

from __future__ import annotations

import torch

from .codec import index_dtype


def index_bits(codebook_size: int) -> int:
    """Bits of one packed index: ceil(log2(K)) (K is a power of two in bundles: exactly log2(K))."""
    return max(1, (codebook_size - 1).bit_length())


def pack_indices(indices: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack the last axis of ``indices`` ([..., n], every value < 2**bits) into ``ceil(n * bits / 8)`` uint8.

    Bit order (docs/bundle-format.md section 8): index j of a row occupies bits ``j*bits .. j*bits + bits - 1``
    of the row's bit stream, least significant bit first; bit ``t`` of the stream is bit ``t % 8`` of byte
    ``t // 8``; the last byte is zero-padded. Indices may straddle bytes (e.g. 3 or 6 bits).
    """
    if not 1 <= bits <= 16:
        raise ValueError(f"index bits must be in 1..16, got {bits}")
    x = indices.long()
    if x.numel() and (x.min() < 0 or x.max() >= 1 << bits):
        raise ValueError(f"indices must lie in [0, {1 << bits}) to pack into {bits} bits")
    shifts = torch.arange(bits, device=x.device)
    stream = ((x[..., None] >> shifts) & 1).flatten(-2)  # [..., n * bits], LSB first
    pad = (-stream.shape[-1]) % 8
    stream = torch.nn.functional.pad(stream, (0, pad)).unflatten(-1, (-1, 8))
    return (stream << torch.arange(8, device=x.device)).sum(-1).to(torch.uint8)


def unpack_indices(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_indices`: [..., bytes] uint8 -> [..., count] int64."""
    if packed.shape[-1] * 8 < count * bits:
        raise ValueError(f"{packed.shape[-1]} bytes hold fewer than {count} indices of {bits} bits")
    stream = ((packed.long()[..., None] >> torch.arange(8, device=packed.device)) & 1).flatten(-2)
    chunks = stream[..., : count * bits].unflatten(-1, (count, bits))
    return (chunks << torch.arange(bits, device=packed.device)).sum(-1)


PACKED = "indices_packed"  # tensor-name suffix of bit-packed indices (format 1.1, docs/bundle-format.md section 8)


def indices_entries(
    name: str, indices: torch.Tensor, codebook_size: int, *, form: str = "both"
) -> dict[str, torch.Tensor]:
    """The tensors that store ``indices`` [..., n] under ``name`` in a format file: ``{name}.indices`` (uint8 for
    K <= 256, else int32; the 1.0 form) and/or ``{name}.indices_packed`` (uint8 [..., ceil(n * b / 8)], b =
    log2(K) bits, :func:`pack_indices`; 1.1, only for K < 256). ``form``: ``"both"``, ``"plain"`` or
    ``"packed"`` (a file with only the packed form needs a 1.1 reader); K = 256 always stores the plain form."""
    if form not in ("both", "plain", "packed"):
        raise ValueError(f"indices form {form!r}; expected 'both', 'plain' or 'packed'")
    out = {}
    if form != "packed" or codebook_size >= 256:
        out[f"{name}.indices"] = indices.to(index_dtype(codebook_size)).contiguous()
    if form != "plain" and codebook_size < 256:
        out[f"{name}.{PACKED}"] = pack_indices(indices, index_bits(codebook_size)).contiguous()
    return out


def read_indices(tensors: dict[str, torch.Tensor], name: str, codebook_size: int, *, count: int) -> torch.Tensor:
    """Indices [..., count] int64 stored under ``name`` in either form of :func:`indices_entries` (both forms
    present: they must agree). Errors name the tensor."""
    plain, packed = tensors.get(f"{name}.indices"), tensors.get(f"{name}.{PACKED}")
    if plain is None and packed is None:
        raise KeyError(f"no tensor {name}.indices or {name}.{PACKED}")
    if packed is not None:
        bits = index_bits(codebook_size)
        if packed.dtype != torch.uint8 or packed.shape[-1] != -(-count * bits // 8):
            raise ValueError(
                f"{name}.{PACKED}: expected uint8 with {-(-count * bits // 8)} bytes per row "
                f"({count} indices of {bits} bits), got {packed.dtype} {list(packed.shape)}"
            )
        unpacked = unpack_indices(packed, bits, count)
        if plain is not None and not torch.equal(plain.long(), unpacked):
            raise ValueError(f"{name}.indices and {name}.{PACKED} disagree")
        return unpacked
    if plain.shape[-1] != count:
        raise ValueError(f"{name}.indices: expected {count} indices per row, got {list(plain.shape)}")
    return plain.long()
