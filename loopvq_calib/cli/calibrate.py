"""``loopvq-calibrate`` (and ``python -m loopvq_calib``): check everything, then run or resume the stages."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from typing import TYPE_CHECKING, NoReturn

from ..config.source import ConfigError, shown
from .console import fail, quiet_libraries
from .exits import BAD_INPUT, OK, RUN_FAILED, console_command, exit_process, interrupt_name, interrupt_status

if TYPE_CHECKING:
    from ..calibration.pipeline import Pipeline


def parser() -> argparse.ArgumentParser:
    """``loopvq-calibrate``'s options."""
    p = argparse.ArgumentParser(prog="loopvq-calibrate", description="Calibrate LoopVQ KV-cache codebooks.")
    p.add_argument("--config", required=True, help="YAML config (see docs/config.md)")
    p.add_argument("--output", help="run directory (default: output.dir of the config)")
    p.add_argument(
        "--stages",
        help="comma-separated stages to produce (the run's stages: docs/architecture.md; an "
        "unknown name is refused with the list); earlier stages run or are reused as needed, later ones "
        "are skipped",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a config value (YAML syntax), repeatable",
    )
    return p


@console_command
def main(argv: list[str] | None = None) -> int:
    """``loopvq-calibrate``: check everything, then run (or resume) the stages; prints the bundle and the
    selection KL; returns the exit status."""
    args = parser().parse_args(argv)
    quiet_libraries()
    from ..calibration.rundir import RunDirError
    from ..config.load import load_config
    from ..data.files import DataError
    from ..models.loading import ModelLoadError

    try:  # every bad input fails here, before the run directory is created or touched
        cfg = load_config(args.config, args.overrides)
        from ..runtime.warmup import Warmup, warm_device

        warmup = Warmup()  # the device's first CUDA work runs while the pipeline's libraries import
        warmup.submit("device", None, warm_device, cfg.model.device)  # picks its CUDA device itself
        from ..calibration.pipeline import Pipeline

        stages = [s.strip() for s in args.stages.split(",")] if args.stages is not None else None
        pipeline = Pipeline(cfg, args.output, stages, warmup=warmup)
    except ConfigError as err:
        return fail(f"config error: {err}", BAD_INPUT)
    except (ModelLoadError, DataError, ValueError) as err:  # also --stages and the run directory
        return fail(str(err), BAD_INPUT)
    except OSError as err:
        return fail(f"{shown(err.filename) if err.filename else 'input'}: {err.strerror or err}", BAD_INPUT)
    try:
        result = pipeline.run_all()
    except (ConfigError, DataError, ModelLoadError, RunDirError) as err:
        return fail(str(err), BAD_INPUT)
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM: the stage's cleanup ran, a rerun resumes
        return fail(_run_failure(pipeline, err), interrupt_status(err))
    except Exception as err:  # noqa: BLE001 (any stage failure: say which and where the traceback is, exit 3)
        return fail(_run_failure(pipeline, err), RUN_FAILED)
    if pipeline.dist.is_main:
        if result.bundle:
            print(f"bundle: {result.bundle}")
        if result.metrics:
            print(
                "selection KL (calibration selection sequences): k-means {selection_kl_init:.5f} -> fine-tuned "
                "{selection_kl:.5f} (step {best_step}, epoch {best_epoch}); the evaluation KL on unseen text "
                "comes from loopvq-eval".format(**result.metrics)
            )
    return OK


def command() -> int:
    """:func:`main` on ``sys.argv``; the process group is left and the log handlers (run.log) are flushed and
    closed before the status is returned."""
    try:
        return main()
    finally:
        _leave_processes()
        logging.shutdown()


def process() -> NoReturn:
    """The ``loopvq-calibrate`` console script and ``python -m loopvq_calib``: :func:`command`, then
    :func:`~loopvq_calib.cli.exits.exit_process` with its status."""
    exit_process(command())


def _leave_processes() -> None:
    """Leave the process group a run joined under ``accelerate launch``, on every way out (success, exit 2 after
    the processes started, exit 3); nothing when torch was never loaded (``--help``, a config error)."""
    if "torch.distributed" in sys.modules:
        from ..runtime.processes import end_processes

        end_processes()


def _run_failure(pipeline: Pipeline, err: BaseException) -> str:
    """One line for a failed or interrupted run; the traceback goes to run.log (a failed stage's temporary output
    is gone, a resumable stage's kept for the rerun)."""
    where = f"stage {pipeline.failed_stage}" if pipeline.failed_stage else "the run"
    if isinstance(err, KeyboardInterrupt):
        what = f"interrupted ({interrupt_name(err)}) in {where}; the same command resumes it"
    else:
        what = f"{where} failed: {type(err).__name__}: {err}"
    log_file = pipeline.run.root / "run.log"
    if not pipeline.run.root.is_dir():
        return what
    with open(log_file, "a", encoding="utf-8") as f:
        f.write("".join(traceback.format_exception(err)))
    return f"{what} (traceback in {log_file})"
