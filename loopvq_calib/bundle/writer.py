"""Writing LoopVQ bundles (format 1.x): a folder with ``loopvq.json`` (metadata, checksums),
``codebooks.safetensors`` (tensors of :meth:`KVQuantizer.tensors`) and ``README.md`` (a model card).
docs/bundle-format.md specifies it for serving backends; this module is the reference writer and
re-exports the reader (:mod:`loopvq_calib.bundle.reader`).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from ..codes.codec import code_bits, index_dtype, sigma_bits
from ..codes.layouts import channel_sets
from ..codes.packing import indices_entries, read_indices
from ..codes.quantizer import KVQuantizer
from ..config.schema import ServingConfig
from ..models.loading import TORCH_DTYPES, ModelIdentity
from ..runtime.files import temp_sibling
from ..runtime.input_files import read_capped
from .card import model_card
from .format import CARD_FILE, FORMAT_VERSION, META_FILE, TENSOR_FILE, file_entry, meta_bytes, written_version
from .reader import Bundle, BundleError, inspect_bundle, load_bundle

__all__ = [
    "FORMAT_VERSION",
    "META_FILE",
    "TENSOR_FILE",
    "CARD_FILE",
    "SIGMA_RULE",
    "Bundle",
    "BundleError",
    "write_bundle",
    "load_bundle",
    "inspect_bundle",
    "safetensors_bytes",
    "indices_entries",
    "read_indices",  # stored codes beside a bundle, plain or bit-packed (format 1.1, section 8)
]

SIGMA_RULE = (
    "TaSQ key blocks only. For each token and each site of the block (loop step m): sigma = sqrt(mean over all "
    "KV heads h and channels d of (w[m,h,d] * k[m,h,d])^2), k the pre-RoPE key in fp32 and w the block's "
    "tasq_weight; clamped to >= sigma_min, then rounded to float16 (round to nearest even). The encoder codes "
    "y = (k * w) / sigma, the decoder returns (e * sigma) / w, both in fp32 with the float16 sigma value."
)
_TORCH_INDEX = {torch.uint8: "uint8", torch.int32: "int32"}


# -- writing -----------------------------------------------------------------------------------------
def write_bundle(
    out_dir: Path,
    quantizer: KVQuantizer,
    *,
    name: str,
    identity: ModelIdentity,
    calibration: dict,
    metrics: dict,
    serving: ServingConfig,
    codebook_dtype: str,
    config: dict,
    producer_version: str,
) -> Path:
    """Write a bundle to ``out_dir`` atomically (built in a temporary sibling folder, then renamed).

        An existing bundle (or empty folder) at ``out_dir`` is replaced only once the new one is complete;
        any other existing folder is refused. ``created`` is SOURCE_DATE_EPOCH when set, else the Unix epoch
    (1970-01-01T00:00:00Z, "not recorded"), so identical runs write byte-identical bundles.
    """
    out_dir = Path(out_dir)
    if codebook_dtype not in TORCH_DTYPES:
        raise BundleError(f"codebook_dtype {codebook_dtype!r} is not one of {', '.join(TORCH_DTYPES)}")
    for field in ("sink_tokens", "recent_window", "page_size"):
        if not isinstance(getattr(serving, field), int):
            raise BundleError(f"serving.{field} must be an integer, got {getattr(serving, field)!r}")
    _check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = _cleared(temp_sibling(out_dir))
    tmp.mkdir()
    try:
        meta = _bundle_meta(
            quantizer,
            name,
            identity,
            calibration=calibration,
            metrics=metrics,
            serving=serving,
            codebook_dtype=codebook_dtype,
            config=config,
            producer_version=producer_version,
        )
        _save_tensors(tmp / TENSOR_FILE, quantizer.tensors(TORCH_DTYPES[codebook_dtype]), meta["format_version"])
        (tmp / CARD_FILE).write_text(model_card(meta), encoding="utf-8")
        meta["files"] = {f: file_entry(tmp / f) for f in (TENSOR_FILE, CARD_FILE)}
        (tmp / META_FILE).write_bytes(meta_bytes(meta))
        load_bundle(tmp)  # never publish what the reader would reject
        _swap_in(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _check_replaceable(out_dir: Path) -> None:
    """``out_dir`` may be replaced only when it is missing, empty, or a bundle holding nothing but its files."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise BundleError(f"{out_dir} exists and is not a folder; refusing to replace it")
    present = {p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*") if not p.is_dir()}
    if not present:
        return
    if not (out_dir / META_FILE).is_file():
        raise BundleError(f"{out_dir} exists and is not a bundle (no {META_FILE}); refusing to replace it")
    try:
        listed = set(
            json.loads(read_capped(out_dir / META_FILE, "bundle metadata file", error=BundleError)).get("files", {})
        )
    except (ValueError, AttributeError):
        listed = set()
    extra = sorted(present - listed - {META_FILE})
    if extra:
        raise BundleError(
            f"{out_dir} holds files that are not part of the bundle ({', '.join(extra[:3])}); "
            "refusing to replace it (move them out first)"
        )


def _bundle_meta(
    q: KVQuantizer,
    name: str,
    identity: ModelIdentity,
    *,
    calibration: dict,
    metrics: dict,
    serving: ServingConfig,
    codebook_dtype: str,
    config: dict,
    producer_version: str,
) -> dict[str, Any]:
    qm = q.meta()
    kv = q.kv.to_dict()
    rope = {"style": kv.pop("rope_style"), "theta": kv.pop("rope_theta")}
    key_sigma = sigma_bits(q.kv.kv_heads, q.kv.head_dim) if any(b["tasq"] for b in qm["blocks"]) else 0.0
    created = datetime.fromtimestamp(int(os.environ.get("SOURCE_DATE_EPOCH") or 0), timezone.utc)
    blocks = [_flagged(block, q, rope["style"]) for block in qm["blocks"]]
    return {
        "format": "loopvq",
        "format_version": written_version(blocks),
        "producer": {"name": "loopvq-calib", "version": producer_version},
        "created": created.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "name": name,
        "method": q.method,
        "bits": q.bits(),
        "bits_detail": {"index": code_bits(q.codebook_size, q.group_size), "key_sigma": key_sigma},
        "codebook_size": q.codebook_size,
        "group_size": q.group_size,
        "steps_per_block": q.steps_per_block,
        "codebook_sharing": q.sharing,
        "codebook_dtype": codebook_dtype,
        "index_dtype": _TORCH_INDEX[index_dtype(q.codebook_size)],
        "codebook_bytes": q.codebook_bytes(TORCH_DTYPES[codebook_dtype].itemsize),
        "model": identity.to_dict(),
        "kv_layout": kv,
        "rope": rope,
        "serving": {
            "sink_tokens": serving.sink_tokens,
            "recent_window": serving.recent_window,
            "page_size": serving.page_size,
        },
        "sigma_rule": SIGMA_RULE,
        "blocks": blocks,
        "calibration": calibration,
        "metrics": metrics,
        "config": config,
    }


def _flagged(block: dict[str, Any], q: KVQuantizer, rope_style: str) -> dict[str, Any]:
    """``block`` with ``"grouping": "channels"`` (format 1.2) when it is a TaSQ key block of several steps whose
    groups hold the same channels, whole RoPE pairs, at every step
    (:func:`~loopvq_calib.codes.layouts.channel_sets`)."""
    layout = q.codecs[block["key"]].layout
    if block["tasq"] and layout.steps > 1 and channel_sets(layout, rope_style) is not None:
        return {**block, "grouping": "channels"}
    return block


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A safetensors file as bytes, byte-reproducible (safetensors orders metadata keys at random)."""
    seen: set[int] = set()  # safetensors refuses tensors that share memory (e.g. one groups tensor, two blocks)
    for k, t in list(tensors.items()):
        tensors[k] = t.clone() if t.data_ptr() in seen else t
        seen.add(t.data_ptr())
    data = save(tensors, metadata=metadata)
    n = struct.unpack("<Q", data[:8])[0]
    header = json.dumps(json.loads(data[8 : 8 + n]), separators=(",", ":"), sort_keys=True).encode()
    return data[:8] + header.ljust(n) + data[8 + n :] if len(header) <= n else data


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor], version: str) -> None:
    # through bytes: safetensors' save_file creates files with mode 0600 regardless of the umask
    path.write_bytes(safetensors_bytes(tensors, {"format": "loopvq", "format_version": version}))


def _swap_in(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` is moved aside first and restored on failure."""
    if not final.exists():
        os.replace(tmp, final)
        return
    old = _cleared(temp_sibling(final.with_name(f"{final.name}.old")))
    os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _cleared(tmp: Path) -> Path:
    """``tmp``, a temporary sibling named for this process, without what a dead process of the same id left there."""
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp
