"""How a command ends: the exit statuses the docs list; Ctrl-C and SIGTERM, where every console script exits 130
(SIGINT) or 143 (SIGTERM) with one line on stderr and no traceback, and a calibration run stopped inside a stage
records it, keeps what a rerun resumes from and writes the traceback to run.log; the process's short exit."""

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
from conftest import ROOT, calibrate_child
from support.builders import tiny_config

from loopvq_calib.bundle import hub, reader
from loopvq_calib.cli import calibrate_main, eval_main, exits, inspect_main, push_main
from loopvq_calib.config import load
from loopvq_calib.evaluation import evaluate
from loopvq_calib.runtime.files import TMP_PREFIX

SIGNALS = {"SIGINT": (signal.SIGINT, 130, "KeyboardInterrupt"), "SIGTERM": (signal.SIGTERM, 143, "Terminated")}
# each console script's main, the function it calls first that a test can make block, and arguments that reach it
COMMANDS = {
    "calibrate": (calibrate_main, load, "load_config", ["--config", "c.yaml"]),
    "eval": (eval_main, evaluate, "evaluate", ["--bundle", "b"]),
    "inspect": (inspect_main, reader, "inspect_bundle", ["b"]),
    "push": (push_main, hub, "push_bundle", ["b", "--repo-id", "org/name", "--dry-run"]),
}


@pytest.mark.parametrize("page", ["reliability.md", "ci.md"])
def test_the_docs_list_every_exit_status_and_no_other(page):
    """Each page's table of exit statuses has one row per status declared in cli/exits.py; a signal's status is
    what a shell reports for a process it killed (128 + the signal)."""
    assert (exits.INTERRUPTED, exits.TERMINATED) == (128 + signal.SIGINT, 128 + signal.SIGTERM)
    declared = sorted(value for name, value in vars(exits).items() if name.isupper() and isinstance(value, int))
    text = (ROOT / "docs" / page).read_text()
    table = text[text.index("| status | meaning |") :].split("\n\n")[0]
    assert [int(row.split("|")[1]) for row in table.splitlines()[2:]] == declared == [0, 1, 2, 3, 130, 143]


# quick equivalent of SIGTERM's: SIGINT's, with test_every_console_script_maps_sigterm_to_143_and_restores_the_handler
@pytest.mark.parametrize("name", ["SIGINT", pytest.param("SIGTERM", marks=pytest.mark.slow)])
def test_a_signal_during_the_capture_exits_with_its_status_one_line_and_the_traceback_in_run_log(
    tiny_ouro_dir, calib_corpus, tmp_path, name
):
    sig, status, exception = SIGNALS[name]
    run = tmp_path / "run"
    cfg = tmp_path / "c.yaml"  # a capture of many sequences: it is still running when the signal comes
    cfg.write_text(
        yaml.safe_dump(
            tiny_config(tiny_ouro_dir, calib_corpus, run, data={"num_sequences": 400, "sequence_length": 128})
        )
    )
    child = calibrate_child(cfg, OMP_NUM_THREADS="1")
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(**child, stdout=out, stderr=err, preexec_fn=_signals_as_from_a_shell)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not _logged(run, "stage capture: running"):
            time.sleep(0.05)
        assert proc.poll() is None, (tmp_path / "stderr").read_text()[-2000:]
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == status, _tails(tmp_path / "stderr", run / "run.log")
    stderr = (tmp_path / "stderr").read_text()
    errors = [line for line in stderr.replace("\r", "\n").splitlines() if line.startswith("error:")]
    assert errors == [
        (f"error: interrupted ({name}) in stage capture; the same command resumes it (traceback in {run / 'run.log'})")
    ]
    assert "Traceback" not in stderr and stderr.replace("\r", "\n").rstrip().splitlines()[-1] == errors[0]  # last
    log = (run / "run.log").read_text()
    assert "Traceback (most recent call last)" in log and exception in log
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stages"]["capture"]["status"] == "failed"  # the stage's cleanup ran
    assert (run / f"{TMP_PREFIX}capture").is_dir()  # the disk capture's shards, kept for the rerun to resume


def _signals_as_from_a_shell() -> None:
    """In the child, before it runs: SIGINT and SIGTERM unblocked and at their default disposition, as a shell's
    foreground command gets them (a test worker's signal mask and ignored signals would otherwise carry over)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _tails(*paths) -> str:
    """The last lines of each file that exists, for an assertion's message."""
    return "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in paths if p.is_file())


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


def test_exit_process_flushes_the_streams_and_skips_the_teardown():
    """exits.exit_process: buffered output on both streams arrives, the status is the process's, and the
    interpreter's teardown (here an atexit handler that would print) does not run."""
    code = (
        "import atexit, sys\nfrom loopvq_calib.cli.exits import exit_process\n"
        "atexit.register(lambda: print('teardown ran'))\n"
        "print('out', end=''); print('err', end='', file=sys.stderr)\nexit_process(7)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (7, "out", "err")
