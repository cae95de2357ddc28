"""Checks of ``loopvq.json``'s blocks against docs/bundle-format.md (sections 2 to 4): each block's key, sites,
shapes, grouping and TaSQ fields, the key and the value blocks each covering every KV site once, and what they
imply: the tensors of section 3 and ``codebook_bytes``. Each refusal is a BundleError naming the file, the block
and the field. The fields themselves are checked first (:mod:`~loopvq_calib.bundle.validate`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..codes.layouts import KINDS, BlockLayout, codebook_shape
from ..config.methods import get_method, methods
from ..config.source import shown
from ..models.loading import TORCH_DTYPES
from .format import BundleError


def expected_tensors(meta: dict[str, Any], file: Path) -> dict[str, tuple[list[int], torch.dtype, str]]:
    """Tensor name -> (shape, dtype, block key) the blocks imply (section 3), after checking each block's
    sites, shapes and TaSQ fields, that the key and the value blocks each cover every site once, and that
    ``codebook_bytes`` is their codebooks' size."""
    kv = meta["kv_layout"]
    h, d = kv["kv_heads"], kv["head_dim"]
    sites = {s["site"]: s for s in kv["sites"]}
    out: dict[str, tuple[list[int], torch.dtype, str]] = {}
    covered: dict[str, list[int]] = {kind: [] for kind in KINDS}
    codebook_values = 0
    for b in meta["blocks"]:
        key, where = b["key"], f"{file}: block {shown(b['key'])}"
        if key != f"{b['kind']}.{b['name']}":
            expected = shown(f"{b['kind']}.{b['name']}")
            raise BundleError(f"{where}: field key must be '<kind>.<name>' ({expected})")
        _check_block_sites(b, sites, steps_per_block=meta["steps_per_block"], where=where)
        _check_block_tasq(b, meta["method"], where)
        _check_block_grouping(b, where)
        covered[b["kind"]] += b["sites"]
        steps, gs = len(b["sites"]), b["groups_shape"]
        if len(gs) != 3 or gs[0] not in (1, h) or gs[2] != meta["group_size"] or gs[1] * gs[2] != steps * d:
            raise BundleError(
                f"{where}: field groups_shape {shown(gs)} is not [1 or {h}, n, {meta['group_size']}] "
                f"with n*G = {steps}*{d}"
            )
        groups = torch.zeros(1, dtype=torch.long).expand(gs)  # shape only, nothing allocated
        layout = BlockLayout(b["name"], b["kind"], tuple(b["sites"]), d, h, groups)
        want_cb = list(codebook_shape(layout, meta["codebook_size"], meta["codebook_sharing"]))
        if b["codebook_shape"] != want_cb:
            raise BundleError(
                f"{where}: field codebook_shape {shown(b['codebook_shape'])} does not match sharing "
                f"{meta['codebook_sharing']!r} (expected {want_cb})"
            )
        codebook_values += math.prod(want_cb)
        out[f"{key}.codebook"] = (want_cb, TORCH_DTYPES[meta["codebook_dtype"]], key)
        out[f"{key}.groups"] = (gs, torch.int32, key)
        if b["tasq"]:
            out[f"{key}.tasq_weight"] = ([steps, h, d], torch.float32, key)
    for kind, ids in covered.items():
        if sorted(ids) != sorted(sites):
            repeated = sorted({s for s in ids if ids.count(s) > 1})
            raise BundleError(
                f"{file}: the {kind} blocks must cover every KV site exactly once "
                f"(missing {shown(sorted(set(sites) - set(ids)))}, repeated {shown(repeated)})"
            )
    want_bytes = codebook_values * TORCH_DTYPES[meta["codebook_dtype"]].itemsize
    if meta["codebook_bytes"] != want_bytes:
        raise BundleError(
            f"{file}: field codebook_bytes is {shown(meta['codebook_bytes'])}, but the blocks' codebooks "
            f"hold {codebook_values} {meta['codebook_dtype']} values = {want_bytes} bytes"
        )
    return out


def _check_block_sites(
    b: dict[str, Any], sites: dict[int, dict[str, Any]], *, steps_per_block: int, where: str
) -> None:
    """Section 4: a looped block is the T_c consecutive steps of one layer, in step order, from a multiple of
    T_c; any other site is a block of its own."""
    ids = b["sites"]
    if not ids or not set(ids) <= set(sites) or len(set(ids)) != len(ids):
        raise BundleError(f"{where}: field sites {shown(ids)} are not distinct sites of kv_layout.sites")
    members = [sites[i] for i in ids]
    if len({(m["stage"], m["layer"]) for m in members}) > 1:
        raise BundleError(f"{where}: field sites {shown(ids)} span more than one layer or stage")
    if not members[0]["looped"]:
        if len(ids) != 1:
            raise BundleError(f"{where}: field sites {shown(ids)}: a non-looped site is a block of its own")
        return
    steps = [m["step"] for m in members]
    first = steps[0]
    if len(ids) != steps_per_block or first % steps_per_block or steps != list(range(first, first + len(ids))):
        raise BundleError(
            f"{where}: field sites {shown(ids)} (steps {shown(steps)}) are not the {steps_per_block} "
            "consecutive loop steps of one block in step order"
        )


def _check_block_grouping(b: dict[str, Any], where: str) -> None:
    """Section 2 (1.2): the optional ``grouping`` is ``"channels"``, on key blocks only (that the groups are such
    a layout is checked with the tensors, by the reader)."""
    if "grouping" not in b:
        return
    if b["grouping"] != "channels":
        raise BundleError(
            f"{where}: field grouping is {shown(b['grouping'])}, not 'channels' (the only value; leave "
            "the field out for any other layout)"
        )
    if b["kind"] != "key":
        raise BundleError(f"{where}: field grouping is set on a {b['kind']} block; it describes key layouts only")


def _check_block_tasq(b: dict[str, Any], method: str, where: str) -> None:
    """Section 2: TaSQ only on key blocks of a TaSQ method, with a finite sigma_min > 0; null otherwise."""
    sigma_min = b.get("sigma_min")
    if not b["tasq"]:
        if sigma_min is not None:
            raise BundleError(f"{where}: field sigma_min must be null when tasq is false, got {shown(sigma_min)}")
        return
    if not get_method(method).tasq_on(b["kind"]):
        tasq_methods = ", ".join(m.name for m in methods() if m.uses_tasq)
        raise BundleError(
            f"{where}: field tasq is true, but TaSQ applies to key blocks of methods "
            f"{tasq_methods} only (this is a {b['kind']} block of {method!r})"
        )
    if (
        not isinstance(sigma_min, (int, float))
        or isinstance(sigma_min, bool)
        or not math.isfinite(sigma_min)
        or sigma_min <= 0
    ):
        raise BundleError(
            f"{where}: field sigma_min must be a finite number > 0 for a TaSQ block, got {shown(sigma_min)}"
        )
