"""Ctrl-C and SIGTERM: every console script exits 130 (SIGINT) or 143 (SIGTERM) with one line on stderr and no
traceback; a calibration run stopped inside a stage records it, keeps what a rerun resumes from and writes the
traceback to run.log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml
from conftest import ROOT
from support.builders import tiny_config

from loopvq_calib import cli
from loopvq_calib.bundle import hub, reader
from loopvq_calib.config import load
from loopvq_calib.evaluation import evaluate
from loopvq_calib.runtime.files import TMP_PREFIX

SIGNALS = {"SIGINT": (signal.SIGINT, 130, "KeyboardInterrupt"), "SIGTERM": (signal.SIGTERM, 143, "Terminated")}
# each console script's main, the function it calls first that a test can make block, and arguments that reach it
COMMANDS = {
    "calibrate": (cli.calibrate_main, load, "load_config", ["--config", "c.yaml"]),
    "eval": (cli.eval_main, evaluate, "evaluate", ["--bundle", "b"]),
    "inspect": (cli.inspect_main, reader, "inspect_bundle", ["b"]),
    "push": (cli.push_main, hub, "push_bundle", ["b", "--repo-id", "org/name", "--dry-run"]),
}


# quick equivalent of SIGTERM's: SIGINT's, with test_every_console_script_maps_sigterm_to_143_and_restores_the_handler
@pytest.mark.parametrize("name", ["SIGINT", pytest.param("SIGTERM", marks=pytest.mark.slow)])
def test_a_signal_during_the_capture_exits_with_its_status_one_line_and_the_traceback_in_run_log(
        tiny_ouro_dir, calib_corpus, tmp_path, name):
    sig, status, exception = SIGNALS[name]
    run = tmp_path / "run"
    cfg = tmp_path / "c.yaml"  # a capture of many sequences: it is still running when the signal comes
    cfg.write_text(yaml.safe_dump(tiny_config(tiny_ouro_dir, calib_corpus, run,
                                              data={"num_sequences": 400, "sequence_length": 128})))
    env = {"PYTHONPATH": str(ROOT), "PATH": "", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "loopvq_calib", "--config", str(cfg)], stdout=out, stderr=err,
                                cwd=ROOT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not _logged(run, "stage capture: running"):
            time.sleep(0.05)
        assert proc.poll() is None, (tmp_path / "stderr").read_text()[-2000:]
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == status
    stderr = (tmp_path / "stderr").read_text()
    errors = [line for line in stderr.replace("\r", "\n").splitlines() if line.startswith("error:")]
    assert errors == [f"error: interrupted ({name}) in stage capture; the same command resumes it (traceback in "
                      f"{run / 'run.log'})"]
    assert "Traceback" not in stderr and stderr.replace("\r", "\n").rstrip().splitlines()[-1] == errors[0]  # last
    log = (run / "run.log").read_text()
    assert "Traceback (most recent call last)" in log and exception in log
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stages"]["capture"]["status"] == "failed"  # the stage's cleanup ran
    assert (run / f"{TMP_PREFIX}capture").is_dir()  # the disk capture's shards, kept for the rerun to resume


def _logged(run, text: str) -> bool:
    log = run / "run.log"
    return log.is_file() and text in log.read_text()


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_console_script_maps_ctrl_c_to_130_with_one_line(command, monkeypatch, capsys):
    main, module, name, argv = COMMANDS[command]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, name, interrupted)
    assert main(argv) == 130
    assert capsys.readouterr().err == "error: interrupted (SIGINT)\n"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_console_script_maps_sigterm_to_143_and_restores_the_handler(command, monkeypatch, capsys):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed by the main thread only")
    main, module, name, argv = COMMANDS[command]
    reached = []

    def terminated(*args, **kwargs):
        reached.append(signal.getsignal(signal.SIGTERM))
        os.kill(os.getpid(), signal.SIGTERM)  # handled at once, in this thread: the sleep is cut short
        time.sleep(30)

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(module, name, terminated)
    start = time.monotonic()
    assert main(argv) == 143
    assert time.monotonic() - start < 10 and reached and reached[0] is not before
    assert capsys.readouterr().err == "error: interrupted (SIGTERM)\n"
    assert signal.getsignal(signal.SIGTERM) is before
