"""The example CI workflow: valid YAML, only documented loopvq-* flags, publishing on main only, shown in docs/ci.md."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "calibrate.yml"
FLAGS = {
    "loopvq-calibrate": {"--config", "--output", "--stages", "--set"},
    "loopvq-eval": {"--bundle", "--model", "--data", "--max-kl", "--max-ppl-increase", "--out"},
    "loopvq-inspect": set(),
    "loopvq-push": {"--repo-id", "--private", "--dry-run"},
}
REQUIRED = {"loopvq-calibrate": {"--config"}, "loopvq-eval": {"--bundle"}, "loopvq-push": {"--repo-id"}}
SHELL_OPERATORS = {"&&", "||", ";", "|", ">", ">>"}


def _steps() -> list[dict]:
    wf = yaml.safe_load(WORKFLOW.read_text())
    return [step for job in wf["jobs"].values() for step in job.get("steps", [])]


def _commands(run: str) -> list[tuple[str, list[str]]]:
    """(command, flags) of every loopvq-* invocation in a run: script (line continuations joined)."""
    out = []
    for line in run.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        for i, tok in enumerate(tokens):
            if tok in FLAGS:
                args = []
                for arg in tokens[i + 1:]:
                    if arg in SHELL_OPERATORS:
                        break
                    args.append(arg)
                out.append((tok, [a.split("=", 1)[0] for a in args if a.startswith("--")]))
    return out


def test_workflow_parses_and_has_the_pipeline():
    wf = yaml.safe_load(WORKFLOW.read_text())
    triggers = wf.get("on", wf.get(True))  # YAML 1.1 reads the key `on` as True
    assert {"push", "pull_request"} <= set(triggers)
    matrix = wf["jobs"]["calibrate"]["strategy"]["matrix"]
    assert "fromJSON(needs.configs.outputs.configs)" in matrix["config"]
    listing = " ".join(step.get("run", "") for step in wf["jobs"]["configs"]["steps"])
    assert "configs -maxdepth 1 -name '*.yaml'" in listing
    used = [cmd for step in _steps() for cmd, _ in _commands(step.get("run", ""))]
    assert used == ["loopvq-calibrate", "loopvq-inspect", "loopvq-eval", "loopvq-push", "loopvq-push"]


def test_loopvq_commands_use_only_documented_flags():
    seen = 0
    for step in _steps():
        for cmd, flags in _commands(step.get("run", "")):
            seen += 1
            assert set(flags) <= FLAGS[cmd], f"{cmd} uses undocumented flags {set(flags) - FLAGS[cmd]}"
            assert REQUIRED.get(cmd, set()) <= set(flags), f"{cmd} misses {REQUIRED[cmd] - set(flags)}"
    assert seen == 5


def test_eval_gates_and_push_only_from_main():
    for step in _steps():
        for cmd, flags in _commands(step.get("run", "")):
            if cmd == "loopvq-eval":
                assert {"--max-kl", "--max-ppl-increase"} <= set(flags)
            if cmd == "loopvq-push" and "--dry-run" not in flags:
                assert "refs/heads/main" in step.get("if", "") and "github.event_name == 'push'" in step["if"]
                assert "secrets.HF_TOKEN" in str(step.get("env"))


def test_docs_show_the_workflow_verbatim():
    doc = (ROOT / "docs" / "ci.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", doc, flags=re.S)
    assert WORKFLOW.read_text() in blocks
