"""``loopvq-eval``: bundles against full precision, the report and the quality gates."""

from __future__ import annotations

import argparse
from pathlib import Path

from .console import fail, quiet_libraries
from .exits import BAD_INPUT, GATE_FAILED, OK, console_command


def parser() -> argparse.ArgumentParser:
    """``loopvq-eval``'s options."""
    p = argparse.ArgumentParser(prog="loopvq-eval", description="Evaluate LoopVQ bundles against full precision.")
    p.add_argument(
        "--bundle", action="append", required=True, help="bundle folder or hub id, repeatable (side by side)"
    )
    p.add_argument("--model", help="model folder or hub id (default: the bundle's model)")
    p.add_argument("--data", help="held-out text: local text/json/jsonl/parquet file or hub dataset")
    p.add_argument("--num-sequences", type=int, default=8)
    p.add_argument("--sequence-length", type=int, default=512)
    p.add_argument("--out", help="report folder (report.json, report.md, PNG plots)")
    p.add_argument("--max-kl", type=float, help="exit 1 if any bundle's evaluation KL exceeds this")
    p.add_argument(
        "--max-ppl-increase", type=float, help="exit 1 if any bundle raises perplexity by more than this fraction"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    served = p.add_argument_group("served cache", "accuracy through the quantized cache (docs/evaluation.md)")
    served.add_argument(
        "--tasks",
        type=_names,
        default=[],
        metavar="T1,T2",
        help="lm-eval tasks (e.g. gsm8k,minerva_math,humaneval,mbpp; offline: loopvq_recall)",
    )
    served.add_argument(
        "--baseline",
        type=_names,
        default=[],
        metavar="B1,B2",
        help="uncalibrated baselines side by side: last-step-kv,kivi2,kivi4,fp8",
    )
    served.add_argument("--limit", type=float, help="lm-eval: at most this many items per task (<1: a fraction)")
    served.add_argument("--sink-tokens", type=int, help="override the bundles' serving sink tokens")
    served.add_argument("--recent-window", type=int, help="override the bundles' serving recent window")
    served.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (left-padded)")
    served.add_argument("--include-path", action="append", default=[], help="extra lm-eval task folder, repeatable")
    served.add_argument(
        "--passkey-lengths",
        type=_ints,
        default=[],
        metavar="N1,N2",
        help="passkey retrieval at these prompt lengths (tokens, up to the model's window)",
    )
    served.add_argument("--passkey-trials", type=int, default=5, help="passkey prompts per length")
    served.add_argument(
        "--confirm-run-unsafe-code",
        action="store_true",
        help="let code tasks (humaneval, mbpp) execute generated code (also set HF_ALLOW_CODE_EVAL=1)",
    )
    served.add_argument(
        "--max-accuracy-drop", type=float, help="exit 1 if any entry's task accuracy is this much below full precision"
    )
    return p


@console_command
def main(argv: list[str] | None = None) -> int:
    """``loopvq-eval``: evaluate, print report.md, write the report folder (``--out``), print each failed gate;
    returns 0 (every gate passed), 1 (a gate failed) or 2 (bad input)."""
    args = parser().parse_args(argv)
    quiet_libraries()
    from ..bundle.reader import BundleError
    from ..data.files import DataError
    from ..evaluation.evaluate import evaluate
    from ..evaluation.inputs import EvalInputError
    from ..evaluation.options import Gates, ServedOptions
    from ..evaluation.out_folder import OutFolderError, check_out_folder
    from ..evaluation.report import markdown_report, write_report
    from ..models.loading import ModelLoadError

    served = ServedOptions(
        tasks=args.tasks,
        baselines=args.baseline,
        limit=args.limit,
        sink_tokens=args.sink_tokens,
        recent_window=args.recent_window,
        batch_size=args.batch_size,
        include_path=args.include_path,
        passkey_lengths=args.passkey_lengths,
        passkey_trials=args.passkey_trials,
        confirm_run_unsafe_code=args.confirm_run_unsafe_code,
    )
    gates = Gates(max_kl=args.max_kl, max_ppl_increase=args.max_ppl_increase, max_accuracy_drop=args.max_accuracy_drop)
    try:
        check_out_folder(args.out)
        result = evaluate(
            args.bundle,
            model=args.model,
            data=args.data,
            num_sequences=args.num_sequences,
            sequence_length=args.sequence_length,
            device=args.device,
            dtype=args.dtype,
            served=served,
            gates=gates,
        )
    except (EvalInputError, OutFolderError, BundleError, ModelLoadError, DataError) as err:
        return fail(str(err), BAD_INPUT)
    print(markdown_report(result.report))
    try:  # --out is checked again as it is written (a report file may have been put there meanwhile)
        written = write_report(result.report, Path(args.out)) if args.out is not None else []
    except OutFolderError as err:
        return fail(str(err), BAD_INPUT)
    print("".join(f"wrote {path}\n" for path in written), end="")
    for failure in result.gate_failures:
        print(f"gate failed: {failure}")
    return OK if result.passed else GATE_FAILED


def _names(text: str) -> list[str]:
    """A comma-separated list, blanks dropped."""
    return [t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    """A comma-separated list of integers (an argparse type)."""
    try:
        return [int(t) for t in _names(text)]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err
