"""The hub side of bundles: the model card (README.md) and publishing a validated folder (``loopvq-push``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled
from huggingface_hub.utils import validate_repo_id

from .bundle import META_FILE, Bundle, load_bundle

_TRUE = {"1", "true", "yes", "on"}


class PushError(RuntimeError):
    """The bundle could not be pushed (offline, no network, authentication, bad repo id)."""


class RepoIdError(PushError):
    """``--repo-id`` is not ORG/NAME (bad input, not a failed push)."""


def bundle_files(bundle: Bundle) -> list[str]:
    """The files the bundle format lists: ``loopvq.json`` and every file under its ``files`` (sorted POSIX
    paths). Nothing else in the folder (``.env``, ``.git/``, notes) is ever uploaded."""
    return sorted({META_FILE, *bundle.meta["files"]})


def push_bundle(path: str | Path, repo_id: str, private: bool = False, dry_run: bool = False,
                token: str | None = None, revision: str | None = None) -> list[str]:
    """Validate the bundle, then upload its files (:func:`bundle_files`) to the model repo ``repo_id``
    (created if needed).

    ``dry_run`` returns the files that would be uploaded without touching the network. Returns the
    uploaded files (relative paths, sorted). Raises BundleError for an invalid bundle and
    :class:`PushError` for a bad repo id, offline mode (HF_HUB_OFFLINE) or any hub/network failure.
    """
    path = Path(path)
    bundle = load_bundle(path)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise RepoIdError(f"--repo-id {repo_id!r} is not a valid hub repo id (ORG/NAME): {err}") from err
    if "/" not in repo_id:
        raise RepoIdError(f"--repo-id {repo_id!r}: give the namespace too (ORG/NAME)")
    files = bundle_files(bundle)
    if dry_run:
        return files
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE:
        raise PushError(f"cannot push {path} to {repo_id}: offline mode is on (HF_HUB_OFFLINE="
                        f"{os.environ['HF_HUB_OFFLINE']}); unset it on a machine with network access")
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        api.upload_folder(folder_path=str(path), repo_id=repo_id, revision=revision, allow_patterns=files,
                          commit_message=f"Upload LoopVQ bundle {path.name}")
    except Exception as err:  # hub, HTTP and connection errors all end the push the same way
        raise PushError(_explain(err, path, repo_id)) from err
    return files


def _explain(err: Exception, path: Path, repo_id: str) -> str:
    base = f"cannot push {path} to {repo_id}"
    if isinstance(err, OfflineModeIsEnabled):
        return f"{base}: huggingface_hub is in offline mode (HF_HUB_OFFLINE); unset it on a machine with network access"
    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, HfHubHTTPError) and status in (401, 403):
        return (f"{base}: not authorised (HTTP {status}); set HF_TOKEN or run `hf auth login` with a token that "
                f"can write to {repo_id.split('/')[0]}")
    if isinstance(err, HfHubHTTPError) and status is not None:
        return f"{base}: the hub answered HTTP {status}: {err}"
    return f"{base}: could not reach the Hugging Face Hub ({type(err).__name__}: {err})"


def model_card(meta: dict[str, Any]) -> str:
    """README.md of a bundle: hub front matter and a human summary."""
    ident, bits, serving, metrics = meta["model"], meta["bits"], meta["serving"], meta["metrics"]
    front: dict[str, Any] = {
        **({"base_model": ident["name"]} if is_hub_id(ident["name"]) else {}),
        "tags": ["loopvq", "kv-cache", "quantization", "vector-quantization", "looped-transformer", ident["model_type"]],
        "library_name": "loopvq-calib",
    }
    cfg = meta.get("config") or {}
    license_ = cfg.get("license") or (cfg.get("output") or {}).get("license")
    if license_:
        front["license"] = license_
    kv = meta["kv_layout"]
    n_key = sum(b["kind"] == "key" for b in meta["blocks"])
    lines = [
        "---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
        f"# {meta['name']}", "",
        f"LoopVQ KV-cache codebooks for `{ident['name']}`"
        + (f" (revision `{ident['revision']}`)" if ident.get("revision") else "")
        + f", model type `{ident['model_type']}`, produced by loopvq-calib {meta['producer']['version']} "
        f"(bundle format {meta['format_version']}). The codes replace the pre-RoPE keys and values of the KV "
        "cache; the model weights are unchanged.", "",
        "| | |", "|---|---|",
        f"| method | {meta['method']} |",
        f"| bits per element | key {bits['key']:.4f}, value {bits['value']:.4f} |",
        f"| codebook size K / group size G / loop steps per block T_c | {meta['codebook_size']} / "
        f"{meta['group_size']} / {meta['steps_per_block']} |",
        f"| codebook sharing | {meta['codebook_sharing']} |",
        f"| blocks | {n_key} key + {len(meta['blocks']) - n_key} value |",
        f"| KV sites | {len(kv['sites'])} ({kv['loop_steps']} loop steps, {kv['kv_heads']} KV heads, head dim "
        f"{kv['head_dim']}) |",
        f"| codebook memory | {meta['codebook_bytes']:,} bytes ({meta['codebook_dtype']}) |",
        f"| RoPE | {meta['rope']['style']}, theta {meta['rope']['theta']:g} (applied after decoding) |",
    ]
    if "selection_kl" in metrics:
        init = f" (after k-means: {_num(metrics['selection_kl_init'])})" if "selection_kl_init" in metrics else ""
        lines.append(f"| selection KL to full precision (calibration selection sequences) | "
                     f"{_num(metrics['selection_kl'])}{init} |")
    lines += [
        "", "## Load", "", "```python",
        "from huggingface_hub import snapshot_download",
        "from loopvq_calib import load_bundle", "",
        "path = snapshot_download(\"<this repo id>\")  # or a local bundle folder",
        f"bundle = load_bundle(path, model=\"{ident['name']}\")  # checks checksums and the model identity",
        "codec = bundle.quantizer.codecs[\"" + meta["blocks"][0]["key"] + "\"]  # one (kind, block)",
        "codes = codec.encode(x)        # x [N, block steps, H, D] pre-RoPE, fp32",
        "x_hat = codec.decode(codes)    # apply RoPE afterwards for keys", "```", "",
        "## Serving defaults", "",
        f"- sink tokens kept in full precision: {serving['sink_tokens']}",
        f"- recent window kept in full precision: {serving['recent_window']} tokens",
        f"- page size (tokens encoded together once they leave the window): {serving['page_size']}", "",
        "The file format (tensor names, group layout, encoder/decoder rules) is specified in loopvq-calib's "
        "docs/bundle-format.md.", "",
    ]
    return "\n".join(lines)


def is_hub_id(name: str) -> bool:
    """Whether a bundle's model name is a hub id ``org/name`` (the card's ``base_model`` holds nothing else;
    a local model is recorded by its absolute path)."""
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def _num(value: Any) -> str:
    return f"{value:.5g}" if isinstance(value, float) else str(value)
