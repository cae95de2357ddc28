"""Reading LoopVQ bundles (format 1.x): load and validate against docs/bundle-format.md, summarise.

:func:`loopvq_calib.bundle.writer.write_bundle` writes them (and checks its output with :func:`load_bundle`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..codes.layouts import KINDS, BlockLayout, codebook_shape
from ..codes.quantizer import KVQuantizer
from ..config.source import looks_local
from ..models.loading import (
    TORCH_DTYPES,
    ModelIdentity,
    ModelLoadError,
    hub_snapshot,
    model_identity,
    resolve_model_dir,
)
from .format import (
    FORMAT_VERSION,
    META_FILE,
    TENSOR_FILE,
    file_entry,
    meta_checksum,
)

_NUMBER = (int, float)
_REQUIRED: dict[str, type | tuple[type, ...]] = {  # docs/bundle-format.md section 2: all present in 1.0
    "format": str, "producer": dict, "created": str, "name": str, "method": str, "bits": dict, "bits_detail": dict,
    "codebook_size": int, "group_size": int, "steps_per_block": int, "codebook_sharing": str,
    "codebook_dtype": str, "index_dtype": str, "codebook_bytes": int, "model": dict, "kv_layout": dict,
    "rope": dict, "serving": dict, "sigma_rule": str, "blocks": list, "calibration": dict, "metrics": dict,
    "config": dict, "files": dict,
}
_REQUIRED_MODEL = {"name": str, "revision": (str, type(None)), "model_type": str, "config_sha256": str,
                   "weights_sha256": str, "weights": list}
_REQUIRED_BLOCK = {"key": str, "kind": str, "name": str, "sites": list, "codebook_shape": list,
                   "groups_shape": list, "tasq": bool}


class BundleError(ValueError):
    """A bundle cannot be written or is invalid; the message names the file, tensor or field."""


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

    Raises :class:`BundleError` on any missing file, checksum mismatch, unreadable safetensors, unsupported
    format version, missing/extra/mis-shaped/mis-typed tensor, or model mismatch.
    """
    path = resolve_bundle_dir(path)
    meta = _read_meta(path)
    _check_files(path, meta)
    tensors = _read_tensors(path / TENSOR_FILE)
    _check_tensors(path / TENSOR_FILE, meta, tensors)
    if model is not None:
        _check_identity(path, meta, _folder_identity(meta, model), what=f"model {model}")
    if identity is not None:
        _check_identity(path, meta, identity.to_dict(), what=f"model identity {identity.name}")
    qmeta = {**meta, "kv_layout": {**meta["kv_layout"], "rope_style": meta["rope"]["style"],
                                   "rope_theta": meta["rope"]["theta"]}}
    return Bundle(path, meta, KVQuantizer.from_tensors(qmeta, tensors, torch.float32))


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
    try:  # loopvq.json first, then exactly the files it lists
        meta_file = Path(hub_snapshot(str(spec), None, key, what="bundle", patterns=[META_FILE])) / META_FILE
        try:
            listed = [str(name) for name in json.loads(meta_file.read_text(encoding="utf-8")).get("files", {})]
        except (OSError, ValueError, AttributeError):
            listed = []  # load_bundle then names what is wrong with loopvq.json
        return Path(hub_snapshot(str(spec), None, key, what="bundle", patterns=[META_FILE, *listed]))
    except ModelLoadError as err:
        raise BundleError(str(err)) from err


def _read_meta(path: Path) -> dict[str, Any]:
    file = path / META_FILE
    if not file.is_file():
        raise BundleError(f"{file}: missing (not a LoopVQ bundle)")
    data = file.read_bytes()
    try:
        meta = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BundleError(f"{file}: not valid JSON ({err})") from err
    if not isinstance(meta, dict):
        raise BundleError(f"{file}: expected a JSON object")
    if "meta_sha256" in meta:  # since format 1.1; older bundles have no metadata checksum
        got = meta_checksum(data)
        if got is None or got != meta["meta_sha256"]:
            raise BundleError(f"{file}: metadata checksum mismatch (field meta_sha256): the file was edited after "
                              "it was written; restore the original or calibrate again")
    version = meta.get("format_version")
    major = str(version).split(".")[0]
    if not isinstance(version, str) or not major.isdigit():
        raise BundleError(f"{file}: field format_version is missing or not 'major.minor' (got {version!r})")
    if int(major) != int(FORMAT_VERSION.split(".")[0]):
        raise BundleError(f"{file}: format_version {version} is not supported; this reader supports "
                          f"{FORMAT_VERSION.split('.')[0]}.x (any minor version)")
    _require(meta, _REQUIRED, file, prefix="")
    if meta["format"] != "loopvq":
        raise BundleError(f"{file}: field format is {meta['format']!r}, expected 'loopvq'")
    _require(meta["producer"], {"name": str, "version": str}, file, prefix="producer.")
    _require(meta["bits"], {"key": _NUMBER, "value": _NUMBER}, file, prefix="bits.")
    _require(meta["model"], _REQUIRED_MODEL, file, prefix="model.")
    _require(meta["serving"], {k: int for k in ("sink_tokens", "recent_window", "page_size")}, file, prefix="serving.")
    _check_serving(meta["serving"], file)
    _require(meta["rope"], {"style": str, "theta": (int, float)}, file, prefix="rope.")
    _require(meta["kv_layout"], {"model_type": str, "loop_steps": int, "kv_heads": int, "head_dim": int,
                                 "sites": list}, file, prefix="kv_layout.")
    if meta["codebook_dtype"] not in TORCH_DTYPES:
        raise BundleError(f"{file}: field codebook_dtype {meta['codebook_dtype']!r} is not one of "
                          f"{', '.join(TORCH_DTYPES)}")
    for i, site in enumerate(meta["kv_layout"]["sites"]):
        _require(site, {"site": int, "step": int, "layer": int, "looped": bool, "stage": str}, file,
                 prefix=f"kv_layout.sites[{i}].")
    for i, block in enumerate(meta["blocks"]):
        _require(block, _REQUIRED_BLOCK, file, prefix=f"blocks[{i}].")
    return meta


def _check_serving(serving: dict[str, int], file: Path) -> None:
    """Section 12: pages of at least one token; sinks and window non-negative multiples of the page."""
    page = serving["page_size"]
    if page <= 0:
        raise BundleError(f"{file}: field serving.page_size must be > 0, got {page}")
    for key in ("sink_tokens", "recent_window"):
        if serving[key] < 0 or serving[key] % page:
            raise BundleError(f"{file}: field serving.{key} must be a non-negative multiple of page_size {page}, "
                              f"got {serving[key]}")


def _require(obj: Any, spec: dict[str, Any], file: Path, *, prefix: str) -> None:
    if not isinstance(obj, dict):
        raise BundleError(f"{file}: field {prefix.rstrip('.')} must be an object")
    for key, tp in spec.items():
        if key not in obj:
            raise BundleError(f"{file}: required field {prefix}{key} is missing")
        if not isinstance(obj[key], tp) or (tp is int and isinstance(obj[key], bool)):
            raise BundleError(f"{file}: field {prefix}{key} has the wrong type ({type(obj[key]).__name__})")


def _check_files(path: Path, meta: dict[str, Any]) -> None:
    files = meta["files"]
    if TENSOR_FILE not in files:
        raise BundleError(f"{path / META_FILE}: field files does not list {TENSOR_FILE}")
    for name, entry in files.items():
        if not isinstance(entry, dict):
            raise BundleError(f"{path / META_FILE}: files entry {name!r} must be an object with sha256 and bytes")
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise BundleError(f"{path / META_FILE}: files entry {name!r} points outside the bundle")
        file = path / name
        if not file.is_file():
            raise BundleError(f"{file}: missing (listed in {META_FILE})")
        actual = file_entry(file)
        if actual["bytes"] != entry.get("bytes"):
            raise BundleError(f"{file}: size mismatch: {actual['bytes']} bytes, {META_FILE} says {entry.get('bytes')} "
                              "(truncated or modified)")
        if actual["sha256"] != entry.get("sha256"):
            raise BundleError(f"{file}: checksum mismatch: sha256 {actual['sha256']}, {META_FILE} says "
                              f"{entry.get('sha256')} (corrupted or modified)")


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(file), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # safetensors raises its own error types for truncated/garbled files
        raise BundleError(f"{file}: not a readable safetensors file ({type(err).__name__}: {err})") from err
    if header.get("format") != "loopvq":
        raise BundleError(f"{file}: safetensors metadata format is {header.get('format')!r}, expected 'loopvq'")
    return tensors


def _expected_tensors(meta: dict[str, Any], file: Path) -> dict[str, tuple[list[int], torch.dtype, str]]:
    """Tensor name -> (shape, dtype, block key) implied by loopvq.json; checks block consistency."""
    kv = meta["kv_layout"]
    h, d = kv["kv_heads"], kv["head_dim"]
    site_ids = {s.get("site") for s in kv["sites"] if isinstance(s, dict)}
    out: dict[str, tuple[list[int], torch.dtype, str]] = {}
    covered: dict[str, list[int]] = {kind: [] for kind in KINDS}
    for b in meta["blocks"]:
        key, where = b["key"], f"{file.parent / META_FILE}: block {b['key']!r}"
        if b["kind"] not in KINDS or key != f"{b['kind']}.{b['name']}":
            raise BundleError(f"{where}: kind must be key/value and key must be '<kind>.<name>'")
        if not b["sites"] or not set(b["sites"]) <= site_ids:
            raise BundleError(f"{where}: sites {b['sites']} are not all in kv_layout.sites")
        covered[b["kind"]] += b["sites"]
        steps, gs = len(b["sites"]), b["groups_shape"]
        if len(gs) != 3 or gs[0] not in (1, h) or gs[2] != meta["group_size"] or gs[1] * gs[2] != steps * d:
            raise BundleError(f"{where}: groups_shape {gs} is not [1 or {h}, n, {meta['group_size']}] with "
                              f"n*G = {steps}*{d}")
        layout = BlockLayout(b["name"], b["kind"], tuple(b["sites"]), d, h, torch.zeros(gs, dtype=torch.long))
        want_cb = list(codebook_shape(layout, meta["codebook_size"], meta["codebook_sharing"]))
        if b["codebook_shape"] != want_cb:
            raise BundleError(f"{where}: codebook_shape {b['codebook_shape']} does not match sharing "
                              f"{meta['codebook_sharing']!r} (expected {want_cb})")
        out[f"{key}.codebook"] = (want_cb, TORCH_DTYPES[meta["codebook_dtype"]], key)
        out[f"{key}.groups"] = (gs, torch.int32, key)
        if b["tasq"]:
            if not isinstance(b.get("sigma_min"), (int, float)) or b["sigma_min"] <= 0:
                raise BundleError(f"{where}: a TaSQ block needs sigma_min > 0, got {b.get('sigma_min')!r}")
            out[f"{key}.tasq_weight"] = ([steps, h, d], torch.float32, key)
    for kind, sites in covered.items():
        if sorted(sites) != sorted(site_ids):
            repeated = sorted({s for s in sites if sites.count(s) > 1})
            raise BundleError(f"{file.parent / META_FILE}: the {kind} blocks must cover every KV site exactly once "
                              f"(missing {sorted(site_ids - set(sites))}, repeated {repeated})")
    return out


def _check_tensors(file: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    expected = _expected_tensors(meta, file)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise BundleError(f"{file}: tensor {missing[0]!r} (block {expected[missing[0]][2]!r}) is missing"
                          + (f", and {len(missing) - 1} more" if len(missing) > 1 else ""))
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
    for b in meta["blocks"]:
        groups = tensors[f"{b['key']}.groups"].long()
        layout = BlockLayout(b["name"], b["kind"], tuple(b["sites"]), meta["kv_layout"]["head_dim"],
                             meta["kv_layout"]["kv_heads"], groups)
        try:
            layout.check()
        except ValueError as err:
            raise BundleError(f"{file}: tensor '{b['key']}.groups': {err}") from err


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
        diffs.append(f"config.json sha256 {str(stored.get('config_sha256'))[:12]}... vs "
                     f"{str(actual.get('config_sha256'))[:12]}...")
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
        raise BundleError(f"{path}: calibrated for {stored.get('name')!r} (revision {stored.get('revision')!r}); "
                          f"{what} differs: " + "; ".join(diffs))


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
        sig = (blk["kind"], tuple(blk["codebook_shape"]), tuple(blk["groups_shape"]), len(blk["sites"]), blk["tasq"])
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
    for (kind, cb, gs, steps, tasq), names in shapes.items():
        extra = " +tasq" if tasq else ""
        lines.append(f"  {kind:<5} x{len(names):<3} steps {steps}  codebook {list(cb)}  groups {list(gs)}{extra}"
                     f"  ({names[0]}{', ...' if len(names) > 1 else ''})")
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
