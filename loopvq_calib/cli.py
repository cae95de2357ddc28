"""Console scripts: loopvq-calibrate, loopvq-eval, loopvq-inspect, loopvq-push. The library raises and returns
reports; these print them and pick the exit status: 0 success, 1 a gate or check failed, 2 bad input (config,
paths, bundle), 3 a run failed, 130 interrupted (Ctrl-C, SIGINT), 143 terminated (SIGTERM); each failure is one
line on stderr, never a traceback (a run's goes to its run.log). Each command imports what it runs on demand, so
``--help`` loads neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import errno
import functools
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .config.source import ConfigError, shown

if TYPE_CHECKING:
    from .bundle.card import EvalAttachment

INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C
TERMINATED = 143  # 128 + SIGTERM: what a shell reports for a command killed by SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so that every cleanup runs
    (stage records, temporary folders, the run lock) and a rerun resumes as after Ctrl-C."""


def _raise_terminated(signum: int, frame: Any) -> None:
    """The SIGTERM handler of a running command."""
    raise Terminated()


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """While the block runs (in the main thread: only there can Python handle signals), SIGTERM raises
    :class:`Terminated`; the previous handler comes back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _interrupt_status(err: KeyboardInterrupt) -> int:
    """130 for Ctrl-C (SIGINT), 143 for SIGTERM."""
    return TERMINATED if isinstance(err, Terminated) else INTERRUPTED


def _interrupt_name(err: KeyboardInterrupt) -> str:
    """The signal that stopped the command."""
    return "SIGTERM" if isinstance(err, Terminated) else "SIGINT"


def _command(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """A console script's ``main(argv) -> status`` that also maps Ctrl-C and SIGTERM to one line and exit 130 /
    143 (where ``main`` did not already say more, as a calibration run does), and input nested too deeply for
    Python to read or a path too long for any file system to one line and exit 2."""
    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            with _sigterm_interrupts():
                return main(argv)
        except KeyboardInterrupt as err:
            return _fail(f"interrupted ({_interrupt_name(err)})", _interrupt_status(err))
        except RecursionError as err:  # only input nested deeper than Python recurses (a JSON file, say) gets here
            return _fail(f"an input is nested too deeply to read ({err})", 2)
        except OSError as err:  # a path given or read that no file system takes is bad input; any other is not
            if err.errno != errno.ENAMETOOLONG:
                raise
            return _fail(f"{shown(err.filename) if err.filename else 'a path'}: {err.strerror} (no file system takes a "
                         "name that long)", 2)

    return run


def _fail(message: str, status: int) -> int:
    """Print ``error: message`` on a line of its own, the last one: any progress bar still drawn (a stage that
    raised never closed its own) is closed first, at the state it reached. Returns ``status``."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    tqdm.write(f"error: {message}", file=sys.stderr)
    return status


def _quiet_libraries() -> None:
    """Turn off the libraries' own progress bars (datasets' "Generating train split", transformers' "Loading weights",
    which nests under ours) before they are imported; HF_DATASETS_DISABLE_PROGRESS_BARS=0 still wins, hub bars stay."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


def calibrate_parser() -> argparse.ArgumentParser:
    """``loopvq-calibrate``'s options."""
    p = argparse.ArgumentParser(prog="loopvq-calibrate", description="Calibrate LoopVQ KV-cache codebooks.")
    p.add_argument("--config", required=True, help="YAML config (see docs/config.md)")
    p.add_argument("--output", help="run directory (default: output.dir of the config)")
    p.add_argument("--stages", help="comma-separated stages to produce (data,capture,tasq,kmeans,finetune,bundle); "
                   "earlier stages run or are reused as needed, later ones are skipped")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a config value (YAML syntax), repeatable")
    return p


@_command
def calibrate_main(argv: list[str] | None = None) -> int:
    """``loopvq-calibrate``: check everything, then run (or resume) the stages; prints the bundle and the
    selection KL; returns the exit status."""
    args = calibrate_parser().parse_args(argv)
    _quiet_libraries()
    from .calibration.rundir import RunDirError
    from .config.load import load_config
    from .data.files import DataError
    from .models.loading import ModelLoadError

    try:  # every bad input fails here, before the run directory is created or touched
        cfg = load_config(args.config, args.overrides)
        from .runtime.warmup import Warmup, warm_device

        warmup = Warmup()  # the device's first CUDA work runs while the pipeline's libraries import
        warmup.submit("device", None, warm_device, cfg.model.device)  # picks its CUDA device itself
        from .calibration.pipeline import Pipeline

        stages = [s.strip() for s in args.stages.split(",")] if args.stages is not None else None
        pipeline = Pipeline(cfg, args.output, stages, warmup=warmup)
    except ConfigError as err:
        return _fail(f"config error: {err}", 2)
    except (ModelLoadError, DataError, ValueError) as err:  # also --stages and the run directory
        return _fail(str(err), 2)
    except OSError as err:
        return _fail(f"{shown(err.filename) if err.filename else 'input'}: {err.strerror or err}", 2)
    try:
        result = pipeline.run_all()
    except (ConfigError, DataError, ModelLoadError, RunDirError) as err:
        return _fail(str(err), 2)
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM: the stage's cleanup ran, a rerun resumes
        return _fail(_run_failure(pipeline, err), _interrupt_status(err))
    except Exception as err:  # a stage failed: say which and where the traceback is, exit 3
        return _fail(_run_failure(pipeline, err), 3)
    if pipeline.dist.is_main:
        if result.bundle:
            print(f"bundle: {result.bundle}")
        if result.metrics:
            print("selection KL (calibration selection sequences): k-means {selection_kl_init:.5f} -> fine-tuned "
                  "{selection_kl:.5f} (step {best_step}, epoch {best_epoch}); the evaluation KL on unseen text "
                  "comes from loopvq-eval".format(**result.metrics))
    return 0


def calibrate_command() -> int:
    """:func:`calibrate_main` on ``sys.argv``; the process group is left and the log handlers (run.log) are
    flushed and closed before the status is returned."""
    try:
        return calibrate_main()
    finally:
        _leave_processes()
        logging.shutdown()


def calibrate_process() -> NoReturn:
    """The ``loopvq-calibrate`` console script and ``python -m loopvq_calib``: :func:`calibrate_command`, then
    :func:`exit_process` with its status."""
    exit_process(calibrate_command())


def exit_process(status: int) -> NoReturn:
    """End the process with ``status`` once stdout and stderr are flushed, without the interpreter's teardown.

    By then a command has finished everything it owes (run directory and lock released, run.log flushed and
    closed, process group left); what the teardown would add is a garbage collection over every object torch,
    transformers and triton created: about 1 s on a CPU, more after a GPU run (docs/decisions.md, "How a
    command ends"). Library calls and :func:`calibrate_command` return normally."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(status)


def _leave_processes() -> None:
    """Leave the process group a run joined under ``accelerate launch``, on every way out (success, exit 2 after
    the processes started, exit 3); nothing when torch was never loaded (``--help``, a config error)."""
    if "torch.distributed" in sys.modules:
        from .runtime.processes import end_processes

        end_processes()


def _run_failure(pipeline: Any, err: BaseException) -> str:
    """One line for a failed or interrupted run; the traceback goes to run.log (a failed stage's temporary output
    is gone, a resumable stage's kept for the rerun)."""
    where = f"stage {pipeline.failed_stage}" if pipeline.failed_stage else "the run"
    if isinstance(err, KeyboardInterrupt):
        what = f"interrupted ({_interrupt_name(err)}) in {where}; the same command resumes it"
    else:
        what = f"{where} failed: {type(err).__name__}: {err}"
    log_file = pipeline.run.root / "run.log"
    if not pipeline.run.root.is_dir():
        return what
    with open(log_file, "a", encoding="utf-8") as f:
        f.write("".join(traceback.format_exception(err)))
    return f"{what} (traceback in {log_file})"


def eval_parser() -> argparse.ArgumentParser:
    """``loopvq-eval``'s options."""
    p = argparse.ArgumentParser(prog="loopvq-eval", description="Evaluate LoopVQ bundles against full precision.")
    p.add_argument("--bundle", action="append", required=True,
                   help="bundle folder or hub id, repeatable (side by side)")
    p.add_argument("--model", help="model folder or hub id (default: the bundle's model)")
    p.add_argument("--data", help="held-out text: local text/json/jsonl/parquet file or hub dataset")
    p.add_argument("--num-sequences", type=int, default=8)
    p.add_argument("--sequence-length", type=int, default=512)
    p.add_argument("--out", help="report folder (report.json, report.md, PNG plots)")
    p.add_argument("--max-kl", type=float, help="exit 1 if any bundle's evaluation KL exceeds this")
    p.add_argument("--max-ppl-increase", type=float,
                   help="exit 1 if any bundle raises perplexity by more than this fraction")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    served = p.add_argument_group("served cache", "accuracy through the quantized cache (docs/evaluation.md)")
    served.add_argument("--tasks", type=_names, default=[], metavar="T1,T2",
                        help="lm-eval tasks (e.g. gsm8k,minerva_math,humaneval,mbpp; offline: loopvq_recall)")
    served.add_argument("--baseline", type=_names, default=[], metavar="B1,B2",
                        help="uncalibrated baselines side by side: last-step-kv,kivi2,kivi4,fp8")
    served.add_argument("--limit", type=float, help="lm-eval: at most this many items per task (<1: a fraction)")
    served.add_argument("--sink-tokens", type=int, help="override the bundles' serving sink tokens")
    served.add_argument("--recent-window", type=int, help="override the bundles' serving recent window")
    served.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (left-padded)")
    served.add_argument("--include-path", action="append", default=[], help="extra lm-eval task folder, repeatable")
    served.add_argument("--passkey-lengths", type=_ints, default=[], metavar="N1,N2",
                        help="passkey retrieval at these prompt lengths (tokens, up to the model's window)")
    served.add_argument("--passkey-trials", type=int, default=5, help="passkey prompts per length")
    served.add_argument("--confirm-run-unsafe-code", action="store_true",
                        help="let code tasks (humaneval, mbpp) execute generated code (also set HF_ALLOW_CODE_EVAL=1)")
    served.add_argument("--max-accuracy-drop", type=float,
                        help="exit 1 if any entry's task accuracy is this much below full precision")
    return p


@_command
def eval_main(argv: list[str] | None = None) -> int:
    """``loopvq-eval``: evaluate, print report.md, write the report folder (``--out``), print each failed gate;
    returns 0 (every gate passed), 1 (a gate failed) or 2 (bad input)."""
    args = eval_parser().parse_args(argv)
    _quiet_libraries()
    from .bundle.reader import BundleError
    from .data.files import DataError
    from .evaluation.evaluate import evaluate
    from .evaluation.inputs import EvalInputError
    from .evaluation.options import Gates, ServedOptions
    from .evaluation.out_folder import OutFolderError, check_out_folder
    from .evaluation.report import markdown_report, write_report
    from .models.loading import ModelLoadError

    served = ServedOptions(tasks=args.tasks, baselines=args.baseline, limit=args.limit, sink_tokens=args.sink_tokens,
                           recent_window=args.recent_window, batch_size=args.batch_size, include_path=args.include_path,
                           passkey_lengths=args.passkey_lengths, passkey_trials=args.passkey_trials,
                           confirm_run_unsafe_code=args.confirm_run_unsafe_code)
    gates = Gates(max_kl=args.max_kl, max_ppl_increase=args.max_ppl_increase, max_accuracy_drop=args.max_accuracy_drop)
    try:
        check_out_folder(args.out)
        result = evaluate(args.bundle, model=args.model, data=args.data, num_sequences=args.num_sequences,
                          sequence_length=args.sequence_length, device=args.device, dtype=args.dtype, served=served,
                          gates=gates)
    except (EvalInputError, OutFolderError, BundleError, ModelLoadError, DataError) as err:
        return _fail(str(err), 2)
    print(markdown_report(result.report))
    try:  # --out is checked again as it is written (a report file may have been put there meanwhile)
        written = write_report(result.report, Path(args.out)) if args.out is not None else []
    except OutFolderError as err:
        return _fail(str(err), 2)
    print("".join(f"wrote {path}\n" for path in written), end="")
    for failure in result.gate_failures:
        print(f"gate failed: {failure}")
    return 0 if result.passed else 1


def _names(text: str) -> list[str]:
    """A comma-separated list, blanks dropped."""
    return [t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    """A comma-separated list of integers (an argparse type)."""
    try:
        return [int(t) for t in _names(text)]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err


def inspect_parser() -> argparse.ArgumentParser:
    """``loopvq-inspect``'s options."""
    p = argparse.ArgumentParser(prog="loopvq-inspect", description="Summarise a LoopVQ bundle.")
    p.add_argument("bundle")
    return p


@_command
def inspect_main(argv: list[str] | None = None) -> int:
    """``loopvq-inspect``: print a bundle's summary; returns 0, or 2 for a bundle that does not check out."""
    args = inspect_parser().parse_args(argv)
    from .bundle.reader import BundleError, inspect_bundle

    try:
        print(inspect_bundle(args.bundle))
    except BundleError as err:
        return _fail(str(err), 2)
    return 0


def push_parser() -> argparse.ArgumentParser:
    """``loopvq-push``'s options."""
    p = argparse.ArgumentParser(prog="loopvq-push", description="Publish a LoopVQ bundle to the Hugging Face Hub.")
    p.add_argument("bundle")
    p.add_argument("--repo-id", help="ORG/NAME (required, but with --write-card-only)")
    p.add_argument("--private", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="list what would be uploaded, upload nothing")
    p.add_argument("--revision", help="branch to push to")
    p.add_argument("--eval-report", help="loopvq-eval report.json (or its folder): the results it measured on this "
                   "bundle go into the model card (README.md) as model-index metadata, written only after the push")
    p.add_argument("--write-card-only", action="store_true", help="with --eval-report: write the new README.md and "
                   "loopvq.json into the bundle folder, push nothing")
    return p


@_command
def push_main(argv: list[str] | None = None) -> int:
    """``loopvq-push``: upload a bundle (with the evaluation report it measured added to its card); returns 0, 2 for
    bad input, 3 when the upload (or the card's write) failed. The card and ``loopvq.json`` are written into the
    folder only after the hub took them, or (``--write-card-only``) instead of a push."""
    parser = push_parser()
    args = parser.parse_args(argv)
    if args.write_card_only and not args.eval_report:
        return _fail("--write-card-only writes the card of an evaluation report: give --eval-report REPORT", 2)
    if not args.write_card_only and args.repo_id is None:
        parser.error("the following arguments are required: --repo-id")
    from .bundle.card import EvalReportError, prepare_eval_report
    from .bundle.hub import PushError, RepoIdError, push_bundle
    from .bundle.reader import BundleError

    try:
        attachment = prepare_eval_report(args.bundle, args.eval_report) if args.eval_report else None
        if args.write_card_only:
            return _write_card(args, attachment)
        files = push_bundle(args.bundle, args.repo_id, args.private, dry_run=args.dry_run, revision=args.revision,
                            attachment=attachment)
    except (BundleError, RepoIdError, EvalReportError) as err:
        return _fail(str(err), 2)
    except PushError as err:
        return _fail(str(err), 3)
    if attachment is not None:
        verb = "would add" if args.dry_run else "added"
        print(f"{verb} {len(attachment.results)} evaluation results to {args.bundle}/README.md")
    verb = "would upload" if args.dry_run else "uploaded"
    print(f"{verb} {len(files)} files to {args.repo_id}:")
    for f in files:
        print(f"  {f}")
    return 0


def _write_card(args: argparse.Namespace, attachment: EvalAttachment) -> int:
    """``--write-card-only``: write the prepared README.md and loopvq.json into the bundle folder (``--dry-run``:
    say so, write nothing); 3 when the write failed (the old pair stays)."""
    from .bundle.card import write_eval_report
    from .bundle.format import CARD_FILE

    card = Path(args.bundle) / CARD_FILE
    if args.dry_run:
        print(f"would write {len(attachment.results)} evaluation results into {card} (nothing pushed)")
        return 0
    try:
        write_eval_report(args.bundle, attachment)
    except OSError as err:
        return _fail(f"writing the new README.md and loopvq.json into {args.bundle} failed ({err.strerror or err}); "
                     "the folder keeps its old pair", 3)
    print(f"wrote {len(attachment.results)} evaluation results into {card} and its checksum into loopvq.json "
          "(nothing pushed)")
    return 0


# console script name -> its argument parser (tests check docs and CI against them)
PARSERS = {"loopvq-calibrate": calibrate_parser, "loopvq-eval": eval_parser, "loopvq-inspect": inspect_parser,
           "loopvq-push": push_parser}
