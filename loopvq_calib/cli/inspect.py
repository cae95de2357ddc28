"""``loopvq-inspect``: a bundle's summary."""

from __future__ import annotations

import argparse

from .console import fail
from .exits import BAD_INPUT, OK, console_command


def parser() -> argparse.ArgumentParser:
    """``loopvq-inspect``'s options."""
    p = argparse.ArgumentParser(prog="loopvq-inspect", description="Summarise a LoopVQ bundle.")
    p.add_argument("bundle")
    return p


@console_command
def main(argv: list[str] | None = None) -> int:
    """``loopvq-inspect``: print a bundle's summary; returns 0, or 2 for a bundle that does not check out."""
    args = parser().parse_args(argv)
    from ..bundle.reader import BundleError, inspect_bundle

    try:
        print(inspect_bundle(args.bundle))
    except BundleError as err:
        return fail(str(err), BAD_INPUT)
    return OK
