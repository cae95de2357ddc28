"""Checks of a parsed ``loopvq.json`` against docs/bundle-format.md: every field's presence and type, the
enumerations, finite and in-range numbers, and what the fields imply together (bits from K, G and the blocks'
TaSQ, the sites, the model and the files). Each refusal is a BundleError naming the file and the field. The
blocks and the tensors they imply: :mod:`~loopvq_calib.bundle.validate_blocks`."""

from __future__ import annotations

import hashlib
import json
import math
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from ..codes.codec import code_bits, sigma_bits
from ..codes.layouts import KINDS
from ..config.methods import get_method, method_names
from ..config.schema import DTYPE_NAMES, SHARING
from ..config.source import shown
from ..config.validate import MAX_LOOP_STEPS
from .format import FORMAT_VERSION, META_FILE, TENSOR_FILE, BundleError, file_name_problem

ROPE_STYLES = ("half", "interleaved")
STAGES = ("loop", "prelude", "coda")
_NUMBER = (int, float)
_REQUIRED: dict[str, type | tuple[type, ...]] = {  # section 2: all present in 1.0
    "format": str,
    "producer": dict,
    "created": str,
    "name": str,
    "method": str,
    "bits": dict,
    "bits_detail": dict,
    "codebook_size": int,
    "group_size": int,
    "steps_per_block": int,
    "codebook_sharing": str,
    "codebook_dtype": str,
    "index_dtype": str,
    "codebook_bytes": int,
    "model": dict,
    "kv_layout": dict,
    "rope": dict,
    "serving": dict,
    "sigma_rule": str,
    "blocks": list,
    "calibration": dict,
    "metrics": dict,
    "config": dict,
    "files": dict,
}
_REQUIRED_MODEL = {
    "name": str,
    "revision": (str, type(None)),
    "model_type": str,
    "config_sha256": str,
    "weights_sha256": str,
    "weights": list,
}
_REQUIRED_KV = {"model_type": str, "loop_steps": int, "kv_heads": int, "head_dim": int, "sites": list}
SITE_FIELDS = {"site": int, "step": int, "layer": int, "looped": bool, "stage": str}
_REQUIRED_BLOCK = {
    "key": str,
    "kind": str,
    "name": str,
    "sites": list,
    "codebook_shape": list,
    "groups_shape": list,
    "tasq": bool,
}
_HEX64 = re.compile(r"[0-9a-f]{64}")
_VERSION = re.compile(r"([0-9]{1,9})\.([0-9]{1,9})")
_CREATED = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?Z")


def check_version(meta: dict[str, Any], file: Path) -> None:
    """``format_version`` is ``"major.minor"`` of a major version this reader reads (section 11)."""
    version = meta.get("format_version")
    found = _VERSION.fullmatch(version) if isinstance(version, str) else None
    if found is None:
        raise BundleError(f"{file}: field format_version is missing or not 'major.minor' (got {shown(version)})")
    if int(found.group(1)) != int(FORMAT_VERSION.split(".")[0]):
        raise BundleError(
            f"{file}: format_version {version} is not supported; this reader supports "
            f"{FORMAT_VERSION.split('.')[0]}.x (any minor version)"
        )


def check_meta(meta: dict[str, Any], file: Path) -> None:
    """Every field of section 2 (tensors aside: :func:`~loopvq_calib.bundle.validate_blocks.expected_tensors`)."""
    check_version(meta, file)
    _require(meta, _REQUIRED, file, prefix="")
    if meta["format"] != "loopvq":
        raise BundleError(f"{file}: field format is {shown(meta['format'])}, expected 'loopvq'")
    for key, spec in (
        ("producer", {"name": str, "version": str}),
        ("bits", {"key": _NUMBER, "value": _NUMBER}),
        ("bits_detail", {"index": _NUMBER, "key_sigma": _NUMBER}),
        ("model", _REQUIRED_MODEL),
        ("serving", {k: int for k in ("sink_tokens", "recent_window", "page_size")}),
        ("rope", {"style": str, "theta": _NUMBER}),
        ("kv_layout", _REQUIRED_KV),
    ):
        _require(meta[key], spec, file, prefix=f"{key}.")
    for i, site in enumerate(meta["kv_layout"]["sites"]):
        _require(site, SITE_FIELDS, file, prefix=f"kv_layout.sites[{i}].")
    for i, block in enumerate(meta["blocks"]):
        _require(block, _REQUIRED_BLOCK, file, prefix=f"blocks[{i}].")
        for key in ("sites", "codebook_shape", "groups_shape"):
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in block[key]):
                raise BundleError(
                    f"{file}: field blocks[{i}].{key} must be a list of non-negative integers, got {shown(block[key])}"
                )
    _check_text(meta, file)
    _check_enums(meta, file)
    _check_sizes(meta, file)
    _check_serving(meta["serving"], file)
    _check_sites(meta["kv_layout"], file)
    _check_model(meta["model"], meta["kv_layout"], file)
    _check_files(meta["files"], file)
    _check_bits(meta, file)


def _require(obj: Any, spec: dict[str, Any], file: Path, *, prefix: str) -> None:
    if not isinstance(obj, dict):
        raise BundleError(f"{file}: field {prefix.rstrip('.')} must be an object")
    for key, tp in spec.items():
        if key not in obj:
            raise BundleError(f"{file}: required field {prefix}{key} is missing")
        if not isinstance(obj[key], tp) or (tp is not bool and isinstance(obj[key], bool)):
            raise BundleError(f"{file}: field {prefix}{key} has the wrong type ({type(obj[key]).__name__})")


def _choice(value: Any, allowed: tuple[str, ...], field: str, file: Path) -> None:
    if value not in allowed:
        raise BundleError(f"{file}: field {field} is {shown(value)}, not one of {', '.join(allowed)}")


def _check_text(meta: dict[str, Any], file: Path) -> None:
    """Names are non-empty; ``created`` is a UTC ISO 8601 time (section 2)."""
    for field, value in (
        ("name", meta["name"]),
        ("producer.name", meta["producer"]["name"]),
        ("producer.version", meta["producer"]["version"]),
    ):
        if not value.strip():
            raise BundleError(f"{file}: field {field} is empty")
    created = meta["created"]
    try:
        valid = _CREATED.fullmatch(created) is not None
        datetime.strptime(created[:19], "%Y-%m-%dT%H:%M:%S")  # a real date and time of day
    except ValueError:
        valid = False
    if not valid:
        raise BundleError(f"{file}: field created is {shown(created)}, not a UTC time like '2026-01-01T00:00:00Z'")


def _check_enums(meta: dict[str, Any], file: Path) -> None:
    _choice(meta["method"], method_names(), "method", file)
    _choice(meta["codebook_sharing"], SHARING, "codebook_sharing", file)
    _choice(meta["codebook_dtype"], DTYPE_NAMES, "codebook_dtype", file)
    _choice(meta["rope"]["style"], ROPE_STYLES, "rope.style", file)
    for i, site in enumerate(meta["kv_layout"]["sites"]):
        _choice(site["stage"], STAGES, f"kv_layout.sites[{i}].stage", file)
    for i, block in enumerate(meta["blocks"]):
        _choice(block["kind"], KINDS, f"blocks[{i}].kind", file)
    want = "uint8" if meta["codebook_size"] <= 256 else "int32"
    if meta["index_dtype"] != want:
        raise BundleError(
            f"{file}: field index_dtype is {shown(meta['index_dtype'])}; codebook_size "
            f"{meta['codebook_size']} needs {want!r}"
        )


def _check_sizes(meta: dict[str, Any], file: Path) -> None:
    """K a power of two, positive G, T_c, heads and an even head dim; RoPE theta finite and positive."""
    k, kv = meta["codebook_size"], meta["kv_layout"]
    if k < 2 or k & (k - 1):
        raise BundleError(f"{file}: field codebook_size must be a power of two >= 2, got {shown(k)}")
    for field, value in (
        ("group_size", meta["group_size"]),
        ("steps_per_block", meta["steps_per_block"]),
        ("kv_layout.loop_steps", kv["loop_steps"]),
        ("kv_layout.kv_heads", kv["kv_heads"]),
    ):
        if value < 1:
            raise BundleError(f"{file}: field {field} must be >= 1, got {shown(value)}")
    if kv["loop_steps"] > MAX_LOOP_STEPS:
        raise BundleError(
            f"{file}: field kv_layout.loop_steps is {shown(kv['loop_steps'])}, more loop steps than "
            f"this toolkit takes ({MAX_LOOP_STEPS:,})"
        )
    if kv["head_dim"] < 2 or kv["head_dim"] % 2:
        raise BundleError(
            f"{file}: field kv_layout.head_dim must be a positive even number (RoPE pairs "
            f"channels), got {shown(kv['head_dim'])}"
        )
    if kv["loop_steps"] % meta["steps_per_block"]:
        raise BundleError(
            f"{file}: field steps_per_block {meta['steps_per_block']} does not divide "
            f"kv_layout.loop_steps {kv['loop_steps']}"
        )
    want = get_method(meta["method"]).block_steps(meta["steps_per_block"])
    if meta["steps_per_block"] != want:
        raise BundleError(
            f"{file}: field steps_per_block must be {want} for method {meta['method']!r}, got {meta['steps_per_block']}"
        )
    theta = meta["rope"]["theta"]
    if not math.isfinite(theta) or theta <= 0:
        raise BundleError(f"{file}: field rope.theta must be a finite number > 0, got {shown(theta)}")
    if meta["codebook_bytes"] < 0:
        raise BundleError(f"{file}: field codebook_bytes must be >= 0, got {shown(meta['codebook_bytes'])}")


def _check_serving(serving: dict[str, int], file: Path) -> None:
    """Section 12: pages of at least one token; sinks and window non-negative multiples of the page."""
    page = serving["page_size"]
    if page <= 0:
        raise BundleError(f"{file}: field serving.page_size must be > 0, got {page}")
    for key in ("sink_tokens", "recent_window"):
        if serving[key] < 0 or serving[key] % page:
            raise BundleError(
                f"{file}: field serving.{key} must be a non-negative multiple of page_size {page}, got {serving[key]}"
            )


def _check_sites(kv: dict[str, Any], file: Path) -> None:
    """Section 4: unique ids; looped sites are the loop stage's, at steps below loop_steps; others at step 0."""
    seen: set[int] = set()
    for i, s in enumerate(kv["sites"]):
        field = f"kv_layout.sites[{i}]"
        if s["site"] < 0 or s["site"] in seen:
            raise BundleError(f"{file}: field {field}.site {s['site']} is negative or repeated")
        seen.add(s["site"])
        if s["layer"] < 0:
            raise BundleError(f"{file}: field {field}.layer must be >= 0, got {s['layer']}")
        if s["looped"] != (s["stage"] == "loop"):
            raise BundleError(
                f"{file}: field {field}.looped is {s['looped']} but stage is {s['stage']!r} (only "
                "loop sites are looped)"
            )
        top = kv["loop_steps"] if s["looped"] else 1
        if not 0 <= s["step"] < top:
            raise BundleError(f"{file}: field {field}.step {s['step']} is outside 0..{top - 1}")
    if not kv["sites"]:
        raise BundleError(f"{file}: field kv_layout.sites is empty")


def _check_model(model: dict[str, Any], kv: dict[str, Any], file: Path) -> None:
    """Section 10: hex digests, weight entries, weights_sha256 over them, one model_type."""
    for key in ("config_sha256", "weights_sha256"):
        if not _HEX64.fullmatch(model[key]):
            raise BundleError(f"{file}: field model.{key} is not 64 lowercase hex digits")
    for i, w in enumerate(model["weights"]):
        _require(w, {"file": str, "bytes": int, "header_sha256": str}, file, prefix=f"model.weights[{i}].")
        for key in ("header_sha256", "sample_sha256", "sha256"):
            if key in w and not (isinstance(w[key], str) and _HEX64.fullmatch(w[key])):
                raise BundleError(f"{file}: field model.weights[{i}].{key} is not 64 lowercase hex digits")
    want = hashlib.sha256(json.dumps(model["weights"], sort_keys=True).encode()).hexdigest()
    if model["weights_sha256"] != want:
        raise BundleError(f"{file}: field model.weights_sha256 is not the sha256 of model.weights ({want[:12]}...)")
    if model["model_type"] != kv["model_type"]:
        raise BundleError(
            f"{file}: field model.model_type {shown(model['model_type'])} differs from "
            f"kv_layout.model_type {shown(kv['model_type'])}"
        )


def _check_files(files: dict[str, Any], file: Path) -> None:
    """Section 11: names of plain relative paths, entries of a sha256 and a size; the codebooks listed."""
    if TENSOR_FILE not in files:
        raise BundleError(f"{file}: field files does not list {TENSOR_FILE}")
    for name, entry in files.items():
        problem = file_name_problem(name) or (
            f"is {META_FILE} itself, which lists the others" if name == META_FILE else None
        )
        if problem is not None:
            raise BundleError(f"{file}: files entry {shown(name)} {problem}")
        if not isinstance(entry, dict):
            raise BundleError(f"{file}: files entry {shown(name)} must be an object with sha256 and bytes")
        if not (isinstance(entry.get("sha256"), str) and _HEX64.fullmatch(entry["sha256"])):
            raise BundleError(f"{file}: field files.{name}.sha256 is not 64 lowercase hex digits")
        size = entry.get("bytes")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BundleError(f"{file}: field files.{name}.bytes must be a non-negative integer, got {shown(size)}")


def _check_bits(meta: dict[str, Any], file: Path) -> None:
    """Section 8: ``bits`` and ``bits_detail`` are log2(K)/G, plus 16/(H*D) for keys when a block uses TaSQ."""
    k, g, kv = meta["codebook_size"], meta["group_size"], meta["kv_layout"]
    index = code_bits(k, g)
    tasq = any(b["tasq"] for b in meta["blocks"])
    sigma = sigma_bits(kv["kv_heads"], kv["head_dim"]) if tasq else 0.0
    want = {"bits_detail.index": index, "bits_detail.key_sigma": sigma, "bits.key": index + sigma, "bits.value": index}
    for field, value in want.items():
        group, key = field.split(".")
        got = meta[group][key]
        if not math.isclose(got, value, rel_tol=1e-6, abs_tol=1e-12):
            raise BundleError(
                f"{file}: field {field} is {shown(got)}, but K={k}, G={g}"
                + (f", TaSQ sigma over H*D={kv['kv_heads'] * kv['head_dim']}" if tasq else "")
                + f" give {value:.6g}"
            )
