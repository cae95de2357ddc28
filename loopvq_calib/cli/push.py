"""``loopvq-push``: publish a bundle to the Hugging Face Hub, or write its card of an evaluation report."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from .console import fail
from .exits import BAD_INPUT, OK, RUN_FAILED, console_command

if TYPE_CHECKING:
    from ..bundle.card import EvalAttachment


def parser() -> argparse.ArgumentParser:
    """``loopvq-push``'s options."""
    p = argparse.ArgumentParser(prog="loopvq-push", description="Publish a LoopVQ bundle to the Hugging Face Hub.")
    p.add_argument("bundle")
    p.add_argument("--repo-id", help="ORG/NAME (required, but with --write-card-only)")
    p.add_argument("--private", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="list what would be uploaded, upload nothing")
    p.add_argument("--revision", help="branch to push to")
    p.add_argument(
        "--eval-report",
        help="loopvq-eval report.json (or its folder): the results it measured on this "
        "bundle go into the model card (README.md) as model-index metadata, written only after the push",
    )
    p.add_argument(
        "--write-card-only",
        action="store_true",
        help="with --eval-report: write the new README.md and loopvq.json into the bundle folder, push nothing",
    )
    return p


@console_command
def main(argv: list[str] | None = None) -> int:
    """``loopvq-push``: upload a bundle (with the evaluation report it measured added to its card); returns 0, 2 for
    bad input, 3 when the upload (or the card's write) failed. The card and ``loopvq.json`` are written into the
    folder only after the hub took them, or (``--write-card-only``) instead of a push."""
    argument_parser = parser()
    args = argument_parser.parse_args(argv)
    if args.write_card_only and not args.eval_report:
        return fail("--write-card-only writes the card of an evaluation report: give --eval-report REPORT", BAD_INPUT)
    if not args.write_card_only and args.repo_id is None:
        argument_parser.error("the following arguments are required: --repo-id")
    from ..bundle.card import EvalReportError, prepare_eval_report
    from ..bundle.hub import PushError, RepoIdError, push_bundle
    from ..bundle.reader import BundleError

    try:
        attachment = prepare_eval_report(args.bundle, args.eval_report) if args.eval_report else None
        if args.write_card_only:
            return _write_card(args, attachment)
        files = push_bundle(
            args.bundle, args.repo_id, args.private, dry_run=args.dry_run, revision=args.revision, attachment=attachment
        )
    except (BundleError, RepoIdError, EvalReportError) as err:
        return fail(str(err), BAD_INPUT)
    except PushError as err:
        return fail(str(err), RUN_FAILED)
    if attachment is not None:
        verb = "would add" if args.dry_run else "added"
        print(f"{verb} {len(attachment.results)} evaluation results to {args.bundle}/README.md")
    verb = "would upload" if args.dry_run else "uploaded"
    print(f"{verb} {len(files)} files to {args.repo_id}:")
    for f in files:
        print(f"  {f}")
    return OK


def _write_card(args: argparse.Namespace, attachment: EvalAttachment) -> int:
    """``--write-card-only``: write the prepared README.md and loopvq.json into the bundle folder (``--dry-run``:
    say so, write nothing); 3 when the write failed (the old pair stays)."""
    from ..bundle.card import write_eval_report
    from ..bundle.format import CARD_FILE

    card = Path(args.bundle) / CARD_FILE
    if args.dry_run:
        print(f"would write {len(attachment.results)} evaluation results into {card} (nothing pushed)")
        return OK
    try:
        write_eval_report(args.bundle, attachment)
    except OSError as err:
        return fail(
            f"writing the new README.md and loopvq.json into {args.bundle} failed ({err.strerror or err}); "
            "the folder keeps its old pair",
            RUN_FAILED,
        )
    print(
        f"wrote {len(attachment.results)} evaluation results into {card} and its checksum into loopvq.json "
        "(nothing pushed)"
    )
    return OK
