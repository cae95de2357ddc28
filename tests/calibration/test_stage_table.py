"""The stage table is the one list of stages: preflight's wanted stages, ``--stages``, the fingerprints and the
manifest follow its rows, each row's function takes and gives what the row says, and a row added in this file
alone (a stage after the bundle) is run, fingerprinted, reused and asked for like the others."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import typing
from pathlib import Path

import pytest
from conftest import ROOT
from support.builders import tiny_config, tiny_run_config

from loopvq_calib.calibration.fingerprints import RunFacts, fingerprint, stage_fingerprints
from loopvq_calib.calibration.pipeline import Pipeline
from loopvq_calib.calibration.preflight import wanted_stages
from loopvq_calib.calibration.stage_table import STAGE_NAMES, STAGES, Stage, StageDone, StageRun
from loopvq_calib.config.load import load_config
from loopvq_calib.runtime.files import write_bytes_atomic
from loopvq_calib.version import __version__

ROWS = {stage.name: stage for stage in STAGES}
FACTS = RunFacts(model_identity={"name": "m"}, loop_steps=4, tokenizer_files="tokenizer", data_sources=[])


def test_preflight_and_the_fingerprints_take_the_tables_names():
    tasq, loopvq = tiny_run_config("tasq+loopvq"), tiny_run_config()
    assert STAGE_NAMES == ("data", "capture", "tasq", "kmeans", "finetune", "bundle")
    assert wanted_stages(tasq, None) == list(STAGE_NAMES)
    assert wanted_stages(loopvq, None) == [name for name in STAGE_NAMES if name != "tasq"]
    assert wanted_stages(tasq, ["kmeans", "capture"]) == list(STAGE_NAMES[:4])
    assert list(stage_fingerprints(loopvq, FACTS)) == list(STAGE_NAMES)
    with pytest.raises(ValueError) as err:
        wanted_stages(loopvq, ["bundle", "bogus"])
    assert str(err.value) == f"--stages: unknown stage(s) 'bogus'; stages are {', '.join(STAGE_NAMES)}"
    with pytest.raises(ValueError) as err:
        wanted_stages(loopvq, ["tasq"])
    assert str(err.value) == "--stages: the tasq stage exists only for quant.method tasq or tasq+loopvq, not loopvq"


def test_no_stage_writes_its_results_through_nonlocal():
    """The stages return their outputs; none hands them back through a closure's ``nonlocal``."""
    found = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "loopvq_calib" / "calibration").rglob("*.py"))
        if "nonlocal " in p.read_text()
    ]
    assert found == []


@pytest.mark.parametrize("stage", STAGES, ids=STAGE_NAMES)
def test_each_rows_function_takes_and_gives_what_its_row_says(stage):
    """A row's inputs are earlier rows, passed by name: the function's keyword-only parameters, annotated with those
    rows' output types (or None, for a stage some configs have not); it returns a StageDone of the row's output."""
    earlier = STAGE_NAMES[: STAGE_NAMES.index(stage.name)]
    assert set(stage.inputs) <= set(earlier) and set(stage.after) <= set(earlier)
    hints = typing.get_type_hints(stage.function)
    assert hints.pop("return") == StageDone[stage.output]
    assert list(hints) == ["run", *stage.inputs] and hints.pop("run") is StageRun
    for name, hint in hints.items():
        source = ROWS[name]
        assert hint == (source.output if source.exists is None else source.output | None), name
    params = list(inspect.signature(stage.function).parameters.values())[1:]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)
    upto = STAGES[: STAGE_NAMES.index(stage.name) + 1]  # every name it covers resolves (else this raises)
    assert len(stage_fingerprints(tiny_run_config("tasq+loopvq"), FACTS, upto)[stage.name]) == 16


def digest_stage(run: StageRun, *, bundle: Path) -> StageDone[Path]:
    """The toy stage: the sha256 of every bundle file, one line each, in ``digests.txt``."""
    lines = [f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n" for f in sorted(bundle.iterdir())]
    write_bytes_atomic(run.folder / "digests.txt", "".join(lines).encode())
    return StageDone({"files": len(lines)})


DIGEST = Stage(
    "digest",
    digest_stage,
    Path,
    load=Path,
    inputs=("bundle",),
    after=("bundle",),
    covers=("output.bundle_name",),
    every_process=False,
)
WITH_DIGEST = (*STAGES, DIGEST)


def test_a_row_added_in_a_test_is_run_fingerprinted_reused_and_asked_for(tiny_ouro_dir, calib_corpus, tmp_path):
    out = tmp_path / "run"
    cfg = load_config(tiny_config(tiny_ouro_dir, calib_corpus, out, finetune={"epochs": 1}))
    first = Pipeline(cfg, None, ["bundle"], table=WITH_DIGEST).run_all()
    assert [s["name"] for s in first.stages] == ["data", "capture", "kmeans", "finetune", "bundle"]
    assert not (out / "digest").exists()

    second = Pipeline(cfg, None, None, table=WITH_DIGEST).run_all()
    assert {s["name"]: s["reused"] for s in second.stages} == {
        "data": True,
        "capture": True,
        "kmeans": True,
        "finetune": True,
        "bundle": True,
        "digest": False,
    }
    expected = "".join(
        f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n" for f in sorted((out / "bundle").iterdir())
    )
    assert (out / "digest" / "digests.txt").read_text() == expected
    manifest = json.loads((out / "manifest.json").read_text())
    assert list(manifest["stages"]) == ["data", "capture", "kmeans", "finetune", "bundle", "digest"]
    record = manifest["stages"]["digest"]
    assert record["fingerprint"] == fingerprint(
        "digest", __version__, manifest["stages"]["bundle"]["fingerprint"], cfg.output.bundle_name
    )
    assert record["details"] == {"files": len(expected.splitlines())} and list(record["files"]) == ["digests.txt"]

    third = Pipeline(cfg, None, ["digest"], table=WITH_DIGEST).run_all()
    assert all(s["reused"] for s in third.stages) and len(third.stages) == 6
    renamed = load_config(
        tiny_config(tiny_ouro_dir, calib_corpus, out, finetune={"epochs": 1}, output={"bundle_name": "renamed"})
    )
    fourth = Pipeline(renamed, None, ["digest"], table=WITH_DIGEST).run_all()
    assert [s["name"] for s in fourth.stages if not s["reused"]] == ["bundle", "digest"]
    assert (out / "digest" / "digests.txt").read_text() != expected  # the bundle's loopvq.json names it

    mistyped = (*STAGES, dataclasses.replace(DIGEST, output=int))
    pipeline = Pipeline(renamed, None, None, table=mistyped)
    with pytest.raises(
        TypeError, match="^stage digest gave a PosixPath, not the int its row in the stage table declares$"
    ):
        pipeline.run_all()
    assert pipeline.failed_stage == "digest"
    with pytest.raises(ValueError, match="unknown stage.s. 'digest'"):  # the default table has no such row
        Pipeline(cfg, None, ["digest"])
