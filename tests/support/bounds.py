"""The hostile inputs of tests/test_fuzz_bounds.py (every file read with a bound): numbers too long to convert,
model folders whose config.json the weights contradict, FIFOs and links to /dev/zero where files are read, and the
runner of the cases that would hang or eat the machine on a reader without bounds (a child process, with a
deadline and a memory ceiling)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from conftest import ROOT, write_tiny_bundle
from safetensors.torch import load_file, save_file

from loopvq_calib.cli import calibrate_main, eval_main, inspect_main, push_main
from support.fuzz import Workspace, model_copy, report_push, reseal

HUGE = 10**400  # 401 digits: past a float64 (about 1.8e308)
# a hang guard, not a timing: a runaway input runs for minutes or forever; each case is refused within a few
# seconds on an idle 2-core machine, but CI's parallel workers and a busy machine stretch imports several-fold
DEADLINE_S = 120
MEMORY_CEILING = 4 << 30  # a child's address space: a reader without bounds hits it instead of the machine's
CHILD = """
import contextlib, io, json, resource, sys, time
from loopvq_calib import cli
for name, argv in json.loads(sys.argv[1]):
    err, start = io.StringIO(), time.monotonic()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = getattr(cli, name)(argv)
    print(json.dumps({"status": status, "err": err.getvalue(), "seconds": time.monotonic() - start,
                      "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}), flush=True)
"""


def bundle_with(ws: Workspace, *path: str, value: object) -> str:
    """The golden bundle with the field at ``path`` set to ``value``, its checksum resealed."""

    def edit(meta: dict) -> None:
        node = meta
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return ws.bundle(reseal(edit))


def config_field(name: str, value: object) -> Callable[[Path], None]:
    """config.json of a model folder with ``name`` set to ``value``."""

    def edit(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, name: value}))

    return edit


def transposed_shard(folder: Path) -> str:
    """The weights rewritten with the first non-square matrix stored transposed -> its name."""
    tensors = load_file(folder / "model.safetensors")
    name = next(k for k, t in sorted(tensors.items()) if t.dim() == 2 and t.shape[0] != t.shape[1])
    tensors[name] = tensors[name].t().contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return name


def fifo(path: Path) -> Path:
    """A FIFO (named pipe) at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def zero_link(path: Path) -> Path:
    """A symbolic link at ``path`` to /dev/zero (endless bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to("/dev/zero")
    return path


@contextmanager
def unblocked_after(fifos: list[Path], seconds: float) -> Iterator[None]:
    """Within the block, once ``seconds`` passed, each FIFO of ``fifos`` is opened for writing and closed again and
    again, so a reader waiting on one sees end of file: a reader without bounds fails the test's clock instead of
    hanging it."""
    stop = threading.Event()

    def release() -> None:
        if stop.wait(seconds):
            return
        while not stop.is_set():
            for path in list(fifos):
                try:
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:  # no reader yet
                    pass
            stop.wait(0.05)

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def run_in_child(cases: list[tuple[str, list[str]]], timeout: float) -> list[dict]:
    """Each (console script function name, argv) run in one child process in turn, under MEMORY_CEILING -> per case
    its status, stderr, seconds and the child's peak resident bytes so far; raises TimeoutExpired past
    ``timeout``."""

    def ceiling() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CEILING, MEMORY_CEILING))

    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        preexec_fn=ceiling,
    )
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases), done.stderr[-3000:]
    return results


# -- the cases: (ws) -> (console script, argv) ------------------------------------------------------------------
def widened_model(ws: Workspace) -> tuple[Callable, list[str]]:
    """config.json says hidden_size 128 over the tiny model's 64-wide weights."""
    return model_copy(ws, config_field("hidden_size", 128))


def model_at(ws: Workspace, name: str, edit: Callable[[Path], object]) -> tuple[Callable, list[str]]:
    """A copy of the tiny model at ``ws.root / name`` with ``edit`` applied, named by the config."""
    folder = Path(shutil.copytree(ws.model, ws.root / name))
    edit(folder)
    return ws.run_with("--set", f"model.name_or_path={folder}")


def finished_run_widened(ws: Workspace) -> tuple[Callable, list[str]]:
    """A run directory with its data stage done, then the same run on a model whose config.json the weights
    contradict."""
    ws.run_dir()
    return widened_model(ws)


def score_of(report: dict, value: object) -> None:
    """The bundle's task score in a report set to ``value``."""
    name = report["bundles"][0]["name"]
    report["served"]["tasks"]["scores"][name]["loopvq_recall"]["exact_match,answer"] = value


def report_through(ws: Workspace, make: Callable[[Path], Path]) -> tuple[Callable, list[str]]:
    """loopvq-push --dry-run of the golden bundle with --eval-report naming what ``make`` puts at report.json."""
    main, argv = report_push(ws)
    report = Path(argv[-1])
    report.unlink()
    make(report)
    return main, argv


def eval_out(ws: Workspace, make: Callable[[Path], None]) -> tuple[Callable, list[str]]:
    """loopvq-eval of a tiny bundle with --out a folder whose report.md ``make`` puts there."""
    out = ws.root / "eval"
    out.mkdir()
    make(out / "report.md")
    return eval_main, [*tiny_eval_args(ws), "--out", str(out)]


def tiny_eval_args(ws: Workspace) -> list[str]:
    """loopvq-eval's arguments for a tiny bundle of the tiny model, on two short windows."""
    bundle = write_tiny_bundle(ws.root / "tb", ws.model)
    return [
        "--bundle",
        str(bundle),
        "--model",
        str(ws.model),
        "--device",
        "cpu",
        "--num-sequences",
        "2",
        "--sequence-length",
        "32",
    ]


MAINS = {calibrate_main: "calibrate_main", eval_main: "eval_main", inspect_main: "inspect_main", push_main: "push_main"}
