"""Publishing a validated bundle folder to the hub (``loopvq-push``): exactly ``loopvq.json`` and the files it
lists, as one commit; the model card is :mod:`loopvq_calib.bundle.card`."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled
from huggingface_hub.utils import validate_repo_id

from ..models.loading import hub_offline
from .card import EvalAttachment, EvalReportError, write_eval_report
from .format import CARD_FILE, META_FILE, BundleError, read_bundle_file, strict_json
from .reader import load_bundle


class PushError(RuntimeError):
    """The bundle could not be pushed (offline, no network, authentication, bad repo id)."""


class RepoIdError(PushError):
    """``--repo-id`` is not ORG/NAME (bad input, not a failed push)."""


@dataclass(frozen=True)
class Upload:
    """One file of a push: its path in the repo and the bytes sent."""

    name: str
    data: bytes


def upload_plan(path: str | Path, attachment: EvalAttachment | None = None) -> list[Upload]:
    """What a push sends, and all it sends: ``loopvq.json`` and each file its ``files`` lists, sorted by name.

    The bundle is validated first (:func:`load_bundle`); each file is then read as a regular file inside the
    folder reached through no symlink (a name with glob characters, ``.`` or ``..`` components, a backslash
    or a leading ``/``, a symlink or anything not a regular file is a BundleError naming the entry) and its
    bytes must still match the listed size and sha256. With ``attachment`` (:func:`card.prepare_eval_report`
    of this folder), its README.md and loopvq.json replace the folder's. Nothing else in the folder (``.env``,
    ``.git/``, notes) is ever part of the plan.
    """
    path = Path(path)
    load_bundle(path)
    meta_data = read_bundle_file(path, META_FILE)
    replaced: dict[str, bytes] = {}
    if attachment is not None:
        if meta_data != attachment.replaces:
            raise EvalReportError(
                f"{path / META_FILE}: changed since the evaluation report was prepared; attach it again"
            )
        meta_data, replaced = attachment.meta, {CARD_FILE: attachment.card}
    files = strict_json(meta_data, path / META_FILE)["files"]
    uploads = [Upload(META_FILE, meta_data)]
    for name in sorted(files):
        data = replaced[name] if name in replaced else read_bundle_file(path, name)
        if len(data) != files[name]["bytes"] or hashlib.sha256(data).hexdigest() != files[name]["sha256"]:
            raise BundleError(
                f"{path / name}: changed while the push read it (size or sha256 differs from {META_FILE})"
            )
        uploads.append(Upload(name, data))
    return sorted(uploads, key=lambda u: u.name)


def push_bundle(
    path: str | Path,
    repo_id: str,
    private: bool = False,
    *,
    dry_run: bool = False,
    token: str | None = None,
    revision: str | None = None,
    attachment: EvalAttachment | None = None,
) -> list[str]:
    """Validate the bundle, then send exactly :func:`upload_plan`'s files to the model repo ``repo_id``
    (created if needed) as one commit (``HfApi.create_commit``, one ``CommitOperationAdd`` per file).

    ``dry_run`` returns the same list without touching the network or the folder. With ``attachment`` (an
    evaluation report prepared by :func:`card.prepare_eval_report`) the new README.md and loopvq.json are
    pushed and written into the folder only after the hub accepted the commit; a failed push leaves the
    folder as it was. Returns the files (relative paths, sorted). Raises BundleError for an invalid bundle or a
    refused file entry, EvalReportError for a stale attachment, and :class:`PushError` for a bad repo id,
    offline mode (HF_HUB_OFFLINE) or any hub/network failure.
    """
    path = Path(path)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise RepoIdError(f"--repo-id {repo_id!r} is not a valid hub repo id (ORG/NAME): {err}") from err
    if "/" not in repo_id:
        raise RepoIdError(f"--repo-id {repo_id!r}: give the namespace too (ORG/NAME)")
    uploads = upload_plan(path, attachment)
    files = [u.name for u in uploads]
    if dry_run:
        return files
    if hub_offline():
        raise PushError(
            f"cannot push {path} to {repo_id}: offline mode is on (HF_HUB_OFFLINE="
            f"{os.environ['HF_HUB_OFFLINE']}); unset it on a machine with network access"
        )
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        api.create_commit(
            repo_id,
            [CommitOperationAdd(path_in_repo=u.name, path_or_fileobj=u.data) for u in uploads],
            commit_message=f"Upload LoopVQ bundle {path.name}",
            revision=revision,
        )
    except Exception as err:  # hub, HTTP and connection errors all end the push the same way
        raise PushError(_explain(err, path, repo_id)) from err
    if attachment is not None:
        try:
            write_eval_report(path, attachment)
        except (OSError, BundleError, EvalReportError) as err:
            raise PushError(
                f"pushed {path} to {repo_id}, but writing the new {CARD_FILE} and {META_FILE} into the "
                f"folder failed ({err})"
            ) from err
    return files


def _explain(err: Exception, path: Path, repo_id: str) -> str:
    base = f"cannot push {path} to {repo_id}"
    if isinstance(err, OfflineModeIsEnabled):
        return f"{base}: huggingface_hub is in offline mode (HF_HUB_OFFLINE); unset it on a machine with network access"
    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, HfHubHTTPError) and status in (401, 403):
        return (
            f"{base}: not authorised (HTTP {status}); set HF_TOKEN or run `hf auth login` with a token that "
            f"can write to {repo_id.split('/')[0]}"
        )
    if isinstance(err, HfHubHTTPError) and status is not None:
        return f"{base}: the hub answered HTTP {status}: {err}"
    return f"{base}: could not reach the Hugging Face Hub ({type(err).__name__}: {err})"
