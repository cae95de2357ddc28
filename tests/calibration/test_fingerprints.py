"""Stage fingerprints: each hashes what its row of the stage table covers, so a change invalidates its stage and the
later ones; the values equal those of the toolkit before the stage table (run folders stay reusable)."""

from __future__ import annotations

import dataclasses

import pytest
from support.builders import tiny_run_config

import loopvq_calib.calibration.fingerprints as fingerprints_module
from loopvq_calib.calibration.fingerprints import RunFacts, covered, stage_fingerprints
from loopvq_calib.calibration.stage_table import STAGES
from loopvq_calib.config.schema import TasqConfig

FACTS = RunFacts(
    model_identity={"name": "m"}, loop_steps=4, tokenizer_files="tokenizer", data_sources=[["corpus.jsonl", 10, "sha"]]
)


# computed by the toolkit before the stage table (its stage_fingerprints and data_fingerprint), at version 0.0.0
BEFORE = {
    "loopvq": {
        "data": "5796fa16b1755133",
        "capture": "df66f90fed08a100",
        "tasq": None,
        "kmeans": "7ee076ebb39f534f",
        "finetune": "0fab1822bf649500",
        "bundle": "dc85f3e307f8879c",
    },
    "tasq+loopvq": {
        "data": "5796fa16b1755133",
        "capture": "5d38d1d74e29ecbd",
        "tasq": "6c0cc16f3e20b3e5",
        "kmeans": "e68fe99e0c480f09",
        "finetune": "db7e202c1ae95c67",
        "bundle": "48e2a37829f79f44",
    },
    "channels": {
        "data": "5796fa16b1755133",
        "capture": "5d38d1d74e29ecbd",
        "tasq": "90c6b76d0acd45a9",
        "kmeans": "0b0cbfa63a433f50",
        "finetune": "1ec2547a77fb8110",
        "bundle": "4dd9a1cc536469a8",
    },
}


@pytest.mark.parametrize("name", list(BEFORE))
def test_the_fingerprints_are_those_of_earlier_runs(name, monkeypatch):
    """A changed value here means run folders made before no longer reuse their stages: change it deliberately."""
    monkeypatch.setattr(fingerprints_module, "__version__", "0.0.0")
    cfg = {
        "loopvq": tiny_run_config(),
        "tasq+loopvq": tiny_run_config("tasq+loopvq"),
        "channels": dataclasses.replace(tiny_run_config("tasq+loopvq"), tasq=TasqConfig(grouping="channels")),
    }[name]
    assert stage_fingerprints(cfg, FACTS) == BEFORE[name]


def test_fingerprints_chain_from_the_changed_section():
    cfg = tiny_run_config()
    base = stage_fingerprints(cfg, FACTS)
    assert list(base) == [s.name for s in STAGES] and base["tasq"] is None  # loopvq has no TaSQ stage
    more = stage_fingerprints(dataclasses.replace(cfg, kmeans=dataclasses.replace(cfg.kmeans, iterations=6)), FACTS)
    assert [s for s in base if base[s] != more[s]] == ["kmeans", "finetune", "bundle"]
    stored = stage_fingerprints(dataclasses.replace(cfg, capture=dataclasses.replace(cfg.capture, store="disk")), FACTS)
    assert stored == base  # where the capture lives is not what it holds
    other_data = stage_fingerprints(cfg, dataclasses.replace(FACTS, data_sources=[["corpus.jsonl", 11, "other"]]))
    assert all(other_data[s] != base[s] for s in ("data", "capture", "kmeans", "finetune", "bundle"))
    other_model = stage_fingerprints(cfg, dataclasses.replace(FACTS, model_identity={"name": "other"}))
    assert [s for s in base if base[s] == other_model[s]] == ["data", "tasq"]


def test_covered_names_are_run_facts_views_or_config_paths():
    loopvq = tiny_run_config()
    tasq = dataclasses.replace(tiny_run_config("tasq+loopvq"), tasq=TasqConfig(grouping="channels"))
    assert covered("loop_steps", loopvq, FACTS) == 4 and covered("tokenizer_files", loopvq, FACTS) == "tokenizer"
    assert covered("model.dtype", loopvq, FACTS) == loopvq.model.dtype
    assert covered("kmeans", loopvq, FACTS) == dataclasses.asdict(loopvq.kmeans)
    assert covered("capture", loopvq, FACTS) == {
        k: v for k, v in dataclasses.asdict(loopvq.capture).items() if k != "store"
    }
    assert "grouping" not in covered("tasq", loopvq, FACTS)  # "free": the settings of runs made before the option
    assert covered("tasq", tasq, FACTS)["grouping"] == "channels"
    assert covered("tasq.weight_floor", loopvq, FACTS) is None
    assert covered("tasq.weight_floor", tasq, FACTS) == tasq.tasq.weight_floor
    with pytest.raises(AttributeError):
        covered("kmeans.no_such_setting", loopvq, FACTS)
