"""The pipeline: runs (or reuses) the wanted rows of the stage table (``stage_table.py``) in order, after the checks
of :func:`~loopvq_calib.calibration.preflight.plan_run`; it only wires the stages' outputs into later stages and
caches them in the run directory (``rundir.py``).

Each stage's fingerprint covers what its row says (``fingerprints.py``), so a change invalidates that stage and
every later one; an unchanged stage is reused from the run directory. Under ``accelerate launch`` a row runs on
every process or on the main one alone (``Stage.every_process``), with one
:class:`~loopvq_calib.runtime.processes.DistContext` per run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config.load import dump_config, load_config
from ..config.schema import Config
from ..runtime.clock import seconds_since_process_start
from ..runtime.files import write_bytes_atomic
from ..runtime.processes import DistContext
from ..runtime.warmup import Warmup
from ..version import __version__
from .capture.store import StoreChoice
from .fingerprints import fingerprint
from .plan import RunModel
from .preflight import gpu_sized, plan_run
from .rundir import CONFIG_FILE, LOG_FILE
from .stage_table import STAGES, Stage, StageDone, StageRun
from .stages import selection_metrics

log = logging.getLogger("loopvq_calib")


@dataclass
class RunResult:
    """What a run produced: its folder, the bundle (None when the bundle stage was not asked for), each stage's
    record and the fine-tuning's selection metrics."""

    run_dir: Path
    bundle: Path | None
    stages: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    is_main: bool = True  # the run's main process (under accelerate launch every process gets a result)


class Pipeline:
    """One calibration run; :meth:`run_all` executes (or reuses) the stages up to the last one asked for.
    :attr:`failed_stage`: the stage that raised in the last :meth:`run_all`, None when none did (the run failed
    elsewhere, or did not fail)."""

    failed_stage: str | None = None

    def __init__(
        self,
        cfg: Config,
        output: str | Path | None = None,
        stages: list[str] | None = None,
        *,
        dist: DistContext | None = None,
        warmup: Warmup | None = None,
        table: Sequence[Stage] = STAGES,
    ) -> None:
        """Check the run (:func:`~loopvq_calib.calibration.preflight.plan_run`: every check that can fail on bad
        input, before anything is written). ``dist``: the run's processes (default: this process under
        ``accelerate launch``). ``warmup``: the background warm-up to add the stages' jobs to (``loopvq-calibrate``
        starts one before its imports; default: a new one). ``table``: the stages (default: the stage table).
        :attr:`startup` holds the seconds of each check and those from the process's start to here."""
        entered = time.perf_counter()
        startup = {"entered_at": time.time(), "process_start_s": seconds_since_process_start()}
        self.warmup = warmup or Warmup()  # first-use costs of the device, in the background; stages wait for theirs
        self.table = tuple(table)
        self.plan = plan_run(cfg, output, stages, dist=dist, warmup=self.warmup, table=self.table)
        self.cfg, self.dist, self.run = self.plan.cfg, self.plan.dist, self.plan.run
        self.model = RunModel(self.plan)
        self.startup = {**startup, **self.plan.timings, "pipeline_init_s": round(time.perf_counter() - entered, 3)}

    def run_all(self) -> RunResult:
        """Open the run directory (lock held until this returns) and run or reuse the wanted stages."""
        self.failed_stage = None
        self.run.open()
        try:
            if self.dist.is_main:
                self._start_record()
            outputs = self._run_stages()
            return self._finish(outputs)
        finally:
            self.warmup.close()
            self.run.close()

    def _start_record(self) -> None:
        """The run's log, warnings, config file and the manifest's description of the run."""
        setup_logging(self.run.root)
        if self.run.lock is not None and self.run.lock.previous:
            log.warning(
                "%s: took over the lock of a run that is no longer running (%s)", self.run.root, self.run.lock.previous
            )
        if (sized := gpu_sized(self.cfg, self.plan.device)) is not None:
            log.warning(sized)
        write_bytes_atomic(self.run.root / CONFIG_FILE, dump_config(self.cfg).encode())
        self.run.update(
            toolkit_version=__version__,
            config=self.cfg.to_dict(),
            model_identity=self.plan.model.identity.to_dict(),
            processes=self.dist.world,
            startup=self.startup,
        )

    def _run_stages(self) -> dict[str, Any]:
        """Every row in order: a wanted one run or reused (its output for the later ones), then its manifest
        entries; an output held in memory is let go once the last stage reading it is done."""
        outputs: dict[str, Any] = {}
        last_readers = self._last_readers()
        for stage in self.table:
            if stage.name in self.plan.wanted:
                try:
                    outputs[stage.name] = self._produce(stage, outputs)
                except BaseException:
                    self.failed_stage = stage.name
                    raise
                for done in (s for s in self.table if last_readers.get(s.name) == stage.name and s.release):
                    if outputs[done.name] is not None:
                        done.release(outputs[done.name])
            if stage.manifest is not None:
                self.run.update(**stage.manifest(outputs.get(stage.name)))
        return outputs

    def _last_readers(self) -> dict[str, str]:
        """Wanted stage -> the last wanted stage that takes its output (itself when none does)."""
        last = {}
        for stage in self.table:
            if stage.name in self.plan.wanted:
                last[stage.name] = stage.name
                last.update({name: stage.name for name in stage.inputs})
        return last

    def _produce(self, stage: Stage, outputs: dict[str, Any]) -> Any:
        """Stage ``stage``'s output: reused from the run directory when its fingerprint matches, else run (on every
        process, or on the main one) with its record written; None for an output held in memory that no stage
        needs (every stage reading it is reused)."""
        fp, held = self._record_fingerprint(stage)
        kept = on_disk(held)
        if not kept and self._readers_reused(stage):
            log.info("stage %s: not needed (the stages after it are reused)", stage.name)
            return None
        if held is not None and self.dist.is_main:
            log.info(held.reason)
        if kept and self.run.reusable(stage.name, fp):
            self.run.mark_reused(stage.name, fp)
            return self._checked(stage, stage.load(self.run.path(stage.name)))
        with self.run.stage(stage.name, fp, stage.resumable and kept) as (tmp, rec):
            done: StageDone = StageDone({})
            if stage.every_process or self.dist.is_main:
                done = stage.function(
                    StageRun(plan=self.plan, folder=tmp, model=self.model, warmup=self.warmup),
                    **{name: outputs.get(name) for name in stage.inputs},
                )
                rec.details = done.details
        output = done.output if done.output is not None else stage.load(self.run.path(stage.name))
        return self._checked(stage, output)

    def _record_fingerprint(self, stage: Stage) -> tuple[str, StoreChoice | None]:
        """The fingerprint the run directory records for ``stage`` (with where its output is held, when its row
        says) and that place (None: on disk)."""
        fp = self.plan.fingerprints[stage.name]
        if stage.held is None:
            return fp, None
        held = stage.held(self.plan)
        return fingerprint(fp, held.store), held

    def _readers_reused(self, stage: Stage) -> bool:
        """Whether the stages that read ``stage``'s output (one at least) are all wanted and would be reused."""
        readers = [s for s in self.table if stage.name in s.inputs and s.applies(self.cfg)]
        return bool(readers) and all(self._reused(reader) for reader in readers)

    def _reused(self, stage: Stage) -> bool:
        """Whether ``stage`` is wanted and would be reused from the run directory."""
        if stage.name not in self.plan.wanted:
            return False
        fp, held = self._record_fingerprint(stage)
        return on_disk(held) and self.run.reusable(stage.name, fp)

    @staticmethod
    def _checked(stage: Stage, output: Any) -> Any:
        """``output``, which must be of the type ``stage``'s row declares."""
        if not isinstance(output, stage.output):
            raise TypeError(
                f"stage {stage.name} gave a {type(output).__name__}, not the {stage.output.__name__} "
                "its row in the stage table declares"
            )
        return output

    def _finish(self, outputs: dict[str, Any]) -> RunResult:
        """The run's result; the main process completes the manifest and logs the stage summary."""
        tuned = outputs.get("finetune")
        result = RunResult(
            self.run.root,
            outputs.get("bundle"),
            [asdict(r) for r in self.run.records],
            selection_metrics(tuned) if tuned is not None else {},
            is_main=self.dist.is_main,
        )
        if self.dist.is_main:
            self.run.update(stages_done_at=time.time(), warmup=self.warmup.report())
            log.info("stage summary\n%s", self.run.summary_table())
        return result


def on_disk(held: StoreChoice | None) -> bool:
    """Whether an output held there (None: a stage whose row says nothing, always on disk) is kept in its folder."""
    return held is None or held.store == "disk"


def setup_logging(root: Path, verbose: bool = True) -> None:
    """Log to ``run.log`` in the run directory and to stderr."""
    log.setLevel(logging.INFO)
    for h in list(log.handlers):
        log.removeHandler(h)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    fh = logging.FileHandler(root / LOG_FILE)
    fh.setFormatter(fmt)
    log.addHandler(fh)
    if verbose:
        sh = logging.StreamHandler()
        sh.setFormatter(fmt)
        log.addHandler(sh)
    log.propagate = False


def calibrate(
    config: Config | str | Path | dict,
    output: str | Path | None = None,
    stages: list[str] | None = None,
    *,
    overrides: list[str] | None = None,
) -> RunResult:
    """Python API of ``loopvq-calibrate``: run (or resume) a calibration and return the run's result; bad input
    raises before anything is written (:func:`~loopvq_calib.calibration.preflight.plan_run`)."""
    cfg = config if isinstance(config, Config) else load_config(config, overrides)  # Pipeline resolves and checks it
    return Pipeline(cfg, output, stages).run_all()
