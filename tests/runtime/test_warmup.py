"""Background warm-up: jobs run in order on one thread, a stage gets the result or the error where it waits,
and the pipeline waits for each job before the stage that needs it (on CUDA: the k-means probe, linear algebra);
the command submits the device's first CUDA work before its pipeline imports."""

from __future__ import annotations

import json
import threading

import pytest
import torch
import yaml
from support.builders import tiny_config

import loopvq_calib.calibration.pipeline as pipeline_module
import loopvq_calib.calibration.stage_table as stage_table
from loopvq_calib.calibration.pipeline import calibrate
from loopvq_calib.cli import calibrate_main
from loopvq_calib.kernels import kmeans as kmeans_triton
from loopvq_calib.runtime.warmup import Warmup, warm_device, warm_linalg

CPU = torch.device("cpu")


def test_jobs_run_in_order_on_one_background_thread():
    seen, release = [], threading.Event()

    def job(tag: str) -> str:
        release.wait(10)  # the caller goes on while the job runs
        seen.append((tag, threading.current_thread().name))
        return tag * 2

    warm = Warmup()
    warm.submit("a", CPU, job, "x")
    warm.submit("b", CPU, job, "y")
    assert seen == []
    release.set()
    assert warm.wait("b") == "yy" and warm.wait("a") == "xx"
    assert [tag for tag, _ in seen] == ["x", "y"]
    assert len({name for _, name in seen}) == 1 and seen[0][1].startswith("loopvq-warmup")
    report = warm.report()
    assert set(report) == {"a", "b"} and all(r["ran_s"] >= 0 and r["waited_s"] >= 0 for r in report.values())
    warm.close()


def test_a_jobs_error_is_raised_where_a_stage_waits():
    def fails() -> None:
        raise ValueError("the probe did not compile")

    warm = Warmup()
    warm.submit("probe", CPU, fails)  # nothing raised here
    with pytest.raises(ValueError, match="the probe did not compile"):
        warm.wait("probe")
    assert "probe" in warm.waited and warm.wait("probe") is None  # asked once; a job is not kept after its wait
    warm.close()


def test_nothing_submitted_starts_no_thread():
    before = {t.name for t in threading.enumerate()}
    warm = Warmup()
    assert warm.wait("kmeans_backend") is None and warm.report() == {} and warm.waited == {}
    warm.close()
    assert not any(t.name.startswith("loopvq-warmup") for t in threading.enumerate() if t.name not in before)


def test_a_device_named_by_a_string_is_the_jobs_device():
    warm = Warmup()
    warm.submit("cpu job", "cpu", lambda scale=1: threading.current_thread().name * scale, scale=2)
    assert warm.wait("cpu job").startswith("loopvq-warmup") and warm.report()["cpu job"]["ran_s"] >= 0
    warm.close()


@pytest.mark.gpu
def test_a_cuda_job_without_an_index_runs_on_the_submitting_threads_current_device():
    last = torch.cuda.device_count() - 1
    warm = Warmup()
    with torch.cuda.device(last):
        warm.submit("where", "cuda", torch.cuda.current_device)
    assert warm.wait("where") == last
    warm.close()


def test_each_stage_waits_for_its_job_first(tiny_ouro_dir, calib_corpus, tmp_path, monkeypatch):
    """The pipeline's wiring, on the CPU (where no job is submitted): TaSQ waits for ``linalg``, k-means for
    ``kmeans_backend`` and fine-tuning for ``codec_kernels`` before their stage functions run; the manifest keeps
    the warm-up report."""
    events = []
    monkeypatch.setattr(Warmup, "wait", lambda self, name: events.append(f"wait {name}"))
    for name in ("run_tasq", "run_kmeans", "run_finetune"):
        real = getattr(stage_table, name)
        monkeypatch.setattr(
            stage_table, name, lambda *a, _real=real, _name=name, **k: events.append(_name) or _real(*a, **k)
        )
    cfg = tiny_config(
        tiny_ouro_dir,
        calib_corpus,
        tmp_path / "run",
        quant={"method": "tasq+loopvq"},
        model={"device": "cpu"},
        finetune={"epochs": 1},
    )
    result = calibrate(cfg, stages=["finetune"])
    assert events == [
        "wait linalg",
        "run_tasq",
        "wait kmeans_backend",
        "run_kmeans",
        "wait codec_kernels",
        "run_finetune",
    ]
    assert json.loads((result.run_dir / "manifest.json").read_text())["warmup"] == {}


def test_warm_linalg_gives_the_log_determinants_tasq_takes():
    """The warm-up's calls are the grouping's (batched and single float64 slogdet) and leave no state behind:
    a later log-determinant is the independent product of the LU pivots."""
    warm_linalg(CPU)
    a = torch.tensor([[4.0, 1.0], [2.0, 3.0]], dtype=torch.float64)
    assert torch.linalg.slogdet(a).logabsdet.item() == pytest.approx(torch.log(torch.tensor(10.0)).item())


@pytest.mark.gpu
def test_on_cuda_the_probe_and_linalg_run_in_the_background(tiny_ouro_dir, calib_corpus, tmp_path, monkeypatch):
    """A TaSQ run with ``kmeans.backend: auto`` on CUDA: both jobs ran on the warm-up thread in the order of their
    stages, the k-means stage used the fused kernels, and every k-means probe the run made ran on the warm-up
    thread (the stage found the probe's outcome instead of probing again)."""
    probes, real = [], kmeans_triton.probe

    def noted(*args, **kwargs):
        probes.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(kmeans_triton, "probe", noted)
    cfg = tiny_config(
        tiny_ouro_dir,
        calib_corpus,
        tmp_path / "run",
        quant={"method": "tasq+loopvq"},
        kmeans={"backend": "auto"},
        model={"device": "cuda"},
    )
    result = calibrate(cfg, stages=["kmeans"])
    warmup = json.loads((result.run_dir / "manifest.json").read_text())["warmup"]
    assert list(warmup) == ["linalg", "kmeans_backend"]  # in stage order: TaSQ comes first
    assert all(j["ran_s"] > 0 for j in warmup.values())
    report = json.loads((result.run_dir / "kmeans" / "report.json").read_text())["totals"]
    assert (report[0] if isinstance(report, list) else report)["backend"] == "triton"
    assert all(name.startswith("loopvq-warmup") for name in probes)


def test_the_command_starts_the_device_job_before_its_pipeline_and_the_pipeline_keeps_it(
    tiny_ouro_dir, calib_corpus, tmp_path, monkeypatch
):
    """``loopvq-calibrate`` submits ``warm_device`` (with ``model.device``) before it imports the pipeline, and the
    pipeline adds its jobs to that same warm-up: the manifest reports the job."""
    import sys

    seen = []
    real = Warmup.submit
    monkeypatch.setattr(
        Warmup,
        "submit",
        lambda self, name, device, fn, *args: (
            seen.append((name, fn, args, "loopvq_calib.calibration.pipeline" in sys.modules))
            or real(self, name, device, fn, *args)
        ),
    )
    import loopvq_calib.calibration

    monkeypatch.setattr(loopvq_calib.calibration, "pipeline", pipeline_module)  # put back after the re-import below
    monkeypatch.delitem(sys.modules, "loopvq_calib.calibration.pipeline")  # as in a fresh process
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run", model={"device": "cpu"})))
    assert calibrate_main(["--config", str(cfg), "--stages", "capture"]) == 0
    assert seen == [("device", warm_device, ("cpu",), False)]
    warmup = json.loads((tmp_path / "run" / "manifest.json").read_text())["warmup"]
    assert list(warmup) == ["device"] and warmup["device"]["waited_s"] == 0.0


@pytest.mark.parametrize("setting, world", [("cpu", "1"), ("auto", "2"), ("cuda", "4")])
def test_the_device_job_touches_no_device_on_a_cpu_setting_or_under_accelerate_launch(monkeypatch, setting, world):
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("asked for CUDA"))
    warm_device(setting)


@pytest.mark.gpu
def test_the_device_job_initialises_cuda_and_runs_a_forward_and_backward(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    warm_device("auto")
    assert torch.cuda.is_initialized()
