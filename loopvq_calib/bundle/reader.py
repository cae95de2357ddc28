"""Reading LoopVQ bundles (format 1.x): load and validate against docs/bundle-format.md, summarise.

:func:`loopvq_calib.bundle.writer.write_bundle` writes them (and checks its output with :func:`load_bundle`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..codes.layouts import BlockLayout, channel_sets
from ..codes.quantizer import KVQuantizer
from ..config.source import looks_local, shown
from ..models.loading import ModelIdentity, ModelLoadError, hub_snapshot, model_identity, resolve_model_dir
from ..runtime.input_files import read_capped
from .format import (
    META_FILE,
    TENSOR_FILE,
    BundleError,
    bundle_file,
    file_entry,
    file_name_problem,
    hub_blobs,
    meta_checksum,
    strict_json,
)
from .validate import SITE_FIELDS, check_meta
from .validate_blocks import expected_tensors

__all__ = ["Bundle", "BundleError", "inspect_bundle", "load_bundle", "meta_checksum", "resolve_bundle_dir"]


@dataclass
class Bundle:
    """A validated bundle: its folder, the parsed ``loopvq.json`` and the quantizer (float32 codebooks)."""

    path: Path
    meta: dict
    quantizer: KVQuantizer

    @property
    def serving(self) -> dict:
        """Serving defaults: ``sink_tokens``, ``recent_window``, ``page_size``."""
        return dict(self.meta["serving"])


# -- reading -----------------------------------------------------------------------------------------
def load_bundle(path: str | Path, model: str | Path | None = None, identity: ModelIdentity | None = None) -> Bundle:
    """Read and validate a bundle (a folder, or a hub id ``org/name`` fetched into the hub cache); with
    ``model`` (folder or hub id) or ``identity``, check the model identity.

    Raises :class:`BundleError` on any missing file, a file that is not a regular file inside the folder (a
    symlink, except a hub-cache snapshot's links to its blobs), checksum mismatch, metadata that is not strict
    JSON or breaks a rule of docs/bundle-format.md, unreadable safetensors, unsupported format version,
    missing/extra/mis-shaped/mis-typed tensor, or model mismatch.
    """
    path = resolve_bundle_dir(path)
    blobs = hub_blobs(path)
    meta = _read_meta(path, blobs)
    expected = expected_tensors(meta, path / META_FILE)
    _check_files(path, meta, blobs)
    tensor_file = bundle_file(path, TENSOR_FILE, blobs=blobs)
    tensors = _read_tensors(tensor_file, meta)
    _check_tensors(tensor_file, meta, tensors, expected)
    if model is not None:
        _check_identity(path, meta, _folder_identity(meta, model), what=f"model {model}")
    if identity is not None:
        _check_identity(path, meta, identity.to_dict(), what=f"model identity {identity.name}")
    kv = {
        **meta["kv_layout"],
        "rope_style": meta["rope"]["style"],
        "rope_theta": meta["rope"]["theta"],
        "sites": [{k: s[k] for k in SITE_FIELDS} for s in meta["kv_layout"]["sites"]],
    }  # unknown fields ignored
    return Bundle(path, meta, KVQuantizer.from_tensors({**meta, "kv_layout": kv}, tensors, torch.float32))


def resolve_bundle_dir(spec: str | Path, key: str = "bundle") -> Path:
    """A bundle folder as is; a hub id (a str ``org/name`` that is not a local-looking path) through the hub
    cache (snapshot_download; offline: only what the cache holds). A missing local path says so."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise BundleError(f"{spec}: is a file, not a bundle folder")
    if isinstance(spec, Path) or looks_local(str(spec), Path.cwd()):
        raise BundleError(f"{spec}: no such bundle folder")
    try:  # loopvq.json first, then exactly the files it lists (names that are not plain paths never fetched)
        meta_file = Path(hub_snapshot(str(spec), None, key, what="bundle", patterns=[META_FILE])) / META_FILE
        try:
            files = strict_json(_meta_bytes(meta_file), meta_file).get("files", {})
            listed = [str(name) for name in files if file_name_problem(name) is None]
        except (OSError, BundleError, AttributeError):
            listed = []  # load_bundle then names what is wrong with loopvq.json
        return Path(hub_snapshot(str(spec), None, key, what="bundle", patterns=[META_FILE, *listed]))
    except ModelLoadError as err:
        raise BundleError(str(err)) from err


def _read_meta(path: Path, blobs: Path | None) -> dict[str, Any]:
    """``loopvq.json``: a regular file, strict JSON, its ``meta_sha256``, then every field (:func:`check_meta`)."""
    file = path / META_FILE
    if not os.path.lexists(file):
        raise BundleError(f"{file}: missing (not a LoopVQ bundle)")
    data = _meta_bytes(bundle_file(path, META_FILE, blobs=blobs))
    meta = strict_json(data, file)
    if not isinstance(meta, dict):
        raise BundleError(f"{file}: expected a JSON object")
    if "meta_sha256" in meta:  # since format 1.1; older bundles have no metadata checksum
        got = meta_checksum(data)
        if got is None or got != meta["meta_sha256"]:
            raise BundleError(
                f"{file}: metadata checksum mismatch (field meta_sha256): the file was edited after "
                "it was written; restore the original or calibrate again"
            )
    check_meta(meta, file)
    return meta


def _meta_bytes(file: Path) -> bytes:
    """The bytes of a ``loopvq.json``: a regular file of at most 64 MiB (runtime/input_files.py), else a BundleError."""
    return read_capped(file, "bundle metadata file", error=BundleError)


def _check_files(path: Path, meta: dict[str, Any], blobs: Path | None) -> None:
    for name, entry in meta["files"].items():
        file = bundle_file(path, name, blobs=blobs)
        actual = file_entry(file)
        if actual["bytes"] != entry["bytes"]:
            raise BundleError(
                f"{file}: size mismatch: {actual['bytes']} bytes, {META_FILE} says {entry['bytes']} "
                "(truncated or modified)"
            )
        if actual["sha256"] != entry["sha256"]:
            raise BundleError(
                f"{file}: checksum mismatch: sha256 {actual['sha256']}, {META_FILE} says "
                f"{entry['sha256']} (corrupted or modified)"
            )


def _read_tensors(file: Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of ``codebooks.safetensors``; its header metadata says format loopvq and, when it names a
    format_version, the one of ``loopvq.json``."""
    try:
        with safe_open(str(file), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # safetensors raises its own error types for truncated/garbled files
        raise BundleError(f"{file}: not a readable safetensors file ({type(err).__name__}: {err})") from err
    if header.get("format") != "loopvq":
        raise BundleError(f"{file}: safetensors metadata format is {shown(header.get('format'))}, expected 'loopvq'")
    version = header.get("format_version")
    if version is not None and version != meta["format_version"]:
        raise BundleError(
            f"{file}: safetensors metadata format_version {shown(version)} differs from field "
            f"format_version {shown(meta['format_version'])} of {META_FILE} (one bundle, one version)"
        )
    return tensors


def _check_tensors(
    file: Path,
    meta: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    expected: dict[str, tuple[list[int], torch.dtype, str]],
) -> None:
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise BundleError(
            f"{file}: tensor {missing[0]!r} (block {expected[missing[0]][2]!r}) is missing"
            + (f", and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise BundleError(f"{file}: tensors not described by {META_FILE} blocks: {', '.join(extra)}")
    for name, (shape, dtype, key) in expected.items():
        t = tensors[name]
        if list(t.shape) != shape:
            raise BundleError(f"{file}: tensor {name!r} has shape {list(t.shape)}, block {key!r} needs {shape}")
        if t.dtype != dtype:
            raise BundleError(f"{file}: tensor {name!r} has dtype {t.dtype}, expected {dtype}")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise BundleError(f"{file}: tensor {name!r} has non-finite values")
        if name.endswith(".tasq_weight") and (t == 0).any():
            raise BundleError(f"{file}: tensor {name!r} has zero weights (the decoder divides by them)")
    style = meta["rope"]["style"]
    for b in meta["blocks"]:
        groups = tensors[f"{b['key']}.groups"].long()
        layout = BlockLayout(
            b["name"],
            b["kind"],
            tuple(b["sites"]),
            meta["kv_layout"]["head_dim"],
            meta["kv_layout"]["kv_heads"],
            groups,
        )
        try:
            layout.check()
        except ValueError as err:
            raise BundleError(f"{file}: tensor '{b['key']}.groups': {err}") from err
        if "grouping" in b and channel_sets(layout, style) is None:
            raise BundleError(
                f"{file}: block {shown(b['key'])}: field grouping is 'channels', but tensor "
                f"'{b['key']}.groups' does not hold the same channels, whole RoPE pairs ({style}), at "
                "every step of the block"
            )


def _folder_identity(meta: dict[str, Any], model: str | Path) -> dict[str, Any]:
    stored = meta["model"]
    try:
        folder = Path(model) if Path(model).is_dir() else resolve_model_dir(str(model), stored.get("revision"), "model")
        return model_identity(folder, stored.get("name", ""), stored.get("revision")).to_dict()
    except (ModelLoadError, OSError, ValueError) as err:
        raise BundleError(f"cannot compute the identity of model {model}: {err}") from err


def _check_identity(path: Path, meta: dict[str, Any], actual: dict[str, Any], *, what: str) -> None:
    stored = meta["model"]
    diffs = []
    if stored.get("model_type") != actual.get("model_type"):
        diffs.append(f"model_type {stored.get('model_type')!r} vs {actual.get('model_type')!r}")
    if stored.get("config_sha256") != actual.get("config_sha256"):
        diffs.append(
            f"config.json sha256 {str(stored.get('config_sha256'))[:12]}... vs "
            f"{str(actual.get('config_sha256'))[:12]}..."
        )
    want = {w["file"]: w for w in stored.get("weights", [])}
    have = {w["file"]: w for w in actual.get("weights", [])}
    for name in sorted(set(want) | set(have)):
        if name not in have:
            diffs.append(f"weight file {name} missing from the model")
        elif name not in want:
            diffs.append(f"weight file {name} not in the bundle's model")
        else:  # fields both sides carry (sha256 only where both came from the hub cache)
            fields = [k for k in sorted(set(want[name]) & set(have[name])) if want[name][k] != have[name][k]]
            if fields or not {"bytes", "header_sha256"} <= set(want[name]) & set(have[name]):
                diffs.append(f"weight file {name} differs in {', '.join(fields) or 'its description'}")
    if diffs:
        raise BundleError(
            f"{path}: calibrated for {stored.get('name')!r} (revision {stored.get('revision')!r}); "
            f"{what} differs: " + "; ".join(diffs)
        )


# -- summary -----------------------------------------------------------------------------------------
def inspect_bundle(path: str | Path) -> str:
    """Human summary of a (validated) bundle, as printed by ``loopvq-inspect``."""
    b = load_bundle(path)
    m, q = b.meta, b.quantizer
    ident, kv, s = m["model"], m["kv_layout"], m["serving"]
    checksum = "verified" if "meta_sha256" in m else "absent: written before format 1.1"
    n_codebooks = sum(c.codebook.shape[0] * c.codebook.shape[1] for c in q.codecs.values())
    shapes: dict[tuple, list[str]] = {}
    for blk in m["blocks"]:
        sig = (
            blk["kind"],
            tuple(blk["codebook_shape"]),
            tuple(blk["groups_shape"]),
            len(blk["sites"]),
            blk["tasq"],
            blk.get("grouping"),
        )
        shapes.setdefault(sig, []).append(blk["name"])
    lines = [
        f"bundle      {m['name']}  ({b.path})",
        f"format      {m['format_version']} (metadata checksum {checksum}), produced by {m['producer']['name']} "
        f"{m['producer']['version']} "
        f"at {m.get('created', '?')}",
        f"method      {m['method']}",
        f"bits        key {m['bits']['key']:.4f}  value {m['bits']['value']:.4f}  (per element)",
        f"codes       K={m['codebook_size']}  G={m['group_size']}  T_c={m['steps_per_block']}  "
        f"sharing={m['codebook_sharing']}  codebook dtype={m['codebook_dtype']}  index dtype={m['index_dtype']}",
        f"blocks      {len(m['blocks'])} ({sum(blk['kind'] == 'key' for blk in m['blocks'])} key), "
        f"{n_codebooks} codebooks",
        f"memory      codebooks {m['codebook_bytes']:,} bytes ({m['codebook_bytes'] / 2**20:.3f} MiB)",
        "shapes",
    ]
    for (kind, cb, gs, steps, tasq, grouping), names in shapes.items():
        extra = (" +tasq" if tasq else "") + (f" grouping={grouping}" if grouping else "")
        lines.append(
            f"  {kind:<5} x{len(names):<3} steps {steps}  codebook {list(cb)}  groups {list(gs)}{extra}"
            f"  ({names[0]}{', ...' if len(names) > 1 else ''})"
        )
    lines += [
        f"model       {ident['name']}  revision {ident['revision']}  type {ident['model_type']}",
        f"            config sha256 {ident['config_sha256'][:16]}  weights sha256 {ident['weights_sha256'][:16]} "
        f"({len(ident['weights'])} files)",
        f"kv layout   {len(kv['sites'])} sites, {kv['loop_steps']} loop steps, {kv['kv_heads']} KV heads, "
        f"head dim {kv['head_dim']}, RoPE {m['rope']['style']} theta {m['rope']['theta']:g}",
        f"serving     sink tokens {s['sink_tokens']}, recent window {s['recent_window']}, page size {s['page_size']}",
        "metrics",
    ]
    lines += [f"  {k}: {v}" for k, v in _flat_metrics(m.get("metrics") or {})] or ["  (none)"]
    return "\n".join(lines)


def _flat_metrics(metrics: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    out = []
    for k, v in metrics.items():
        if isinstance(v, dict):
            out += _flat_metrics(v, f"{prefix}{k}.")
        elif isinstance(v, list):
            out.append((f"{prefix}{k}", f"[{len(v)} entries]"))
        else:
            out.append((f"{prefix}{k}", f"{v:.6g}" if isinstance(v, float) else str(v)))
    return out
