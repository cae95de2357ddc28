"""Publishing a validated bundle folder to the hub (``loopvq-push``); the model card is
:mod:`loopvq_calib.bundle.card`."""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import HfApi
from huggingface_hub.errors import (
    HfHubHTTPError,
    HFValidationError,
    OfflineModeIsEnabled,
)
from huggingface_hub.utils import validate_repo_id

from ..models.loading import hub_offline
from .format import META_FILE
from .reader import Bundle, load_bundle


class PushError(RuntimeError):
    """The bundle could not be pushed (offline, no network, authentication, bad repo id)."""


class RepoIdError(PushError):
    """``--repo-id`` is not ORG/NAME (bad input, not a failed push)."""


def bundle_files(bundle: Bundle) -> list[str]:
    """The files the bundle format lists: ``loopvq.json`` and every file under its ``files`` (sorted POSIX
    paths). Nothing else in the folder (``.env``, ``.git/``, notes) is ever uploaded."""
    return sorted({META_FILE, *bundle.meta["files"]})


def push_bundle(path: str | Path, repo_id: str, private: bool = False, *, dry_run: bool = False,
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
    if hub_offline():
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
