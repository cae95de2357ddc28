"""The CI workflow and the documented command lines: valid YAML, every loopvq-* command accepted by the real
argparse parser of its console script, the quality gate on, publishing on main only, tests run as the README
says, docs/ci.md showing the workflow verbatim, and every relative link of the docs resolving."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex

import pytest
import yaml
from conftest import ROOT

from loopvq_calib.cli import PARSERS

WORKFLOW = ROOT / ".github" / "workflows" / "calibrate.yml"
SHELL_OPERATORS = {"&&", "||", ";", "|", ">", ">>"}


def _steps(job: str | None = None) -> list[dict]:
    wf = yaml.safe_load(WORKFLOW.read_text())
    jobs = [wf["jobs"][job]] if job else wf["jobs"].values()
    return [step for j in jobs for step in j.get("steps", [])]


def _example_env() -> dict[str, str]:
    """The calibrate job's variables as a run would see them: each repository variable at its default
    (``${{ vars.X || 'default' }}``), the matrix entry a shipped config, NAME derived from it."""
    env = {}
    for key, value in yaml.safe_load(WORKFLOW.read_text())["jobs"]["calibrate"]["env"].items():
        default = re.search(r"\|\|\s*'([^']*)'", value)
        env[key] = default.group(1) if default else value
    env["CONFIG"] = "configs/tiny-ouro.yaml"
    env["NAME"] = "tiny-ouro"
    return env


def _expand(script: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{?([A-Z_]+)\}?", lambda m: env.get(m.group(1), m.group(0)), script)


def _commands(script: str) -> list[tuple[str, list[str]]]:
    """(console script, its arguments) of every loopvq-* invocation in a shell script (continuations joined)."""
    out = []
    for line in script.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        for i, tok in enumerate(tokens):
            name = tok.rsplit("/", 1)[-1]
            if name in PARSERS:
                args = []
                for arg in tokens[i + 1:]:
                    if arg in SHELL_OPERATORS:
                        break
                    args.append(arg)
                out.append((name, args))
    return out


def _parse(name: str, args: list[str]) -> argparse.Namespace:
    """Parse with the console script's own parser; an unknown or malformed argument fails the test with argparse's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return PARSERS[name]().parse_args(args)
    except SystemExit:
        pytest.fail(f"{name} {shlex.join(args)}: {err.getvalue().strip()}")


def test_workflow_parses_and_has_the_pipeline():
    wf = yaml.safe_load(WORKFLOW.read_text())
    triggers = wf.get("on", wf.get(True))  # YAML 1.1 reads the key `on` as True
    assert {"push", "pull_request"} <= set(triggers)
    matrix = wf["jobs"]["calibrate"]["strategy"]["matrix"]
    assert "fromJSON(needs.configs.outputs.configs)" in matrix["config"]
    listing = " ".join(step.get("run", "") for step in wf["jobs"]["configs"]["steps"])
    assert "configs -maxdepth 1 -name '*.yaml'" in listing
    used = [name for step in _steps() for name, _ in _commands(step.get("run", ""))]
    assert used == ["loopvq-calibrate", "loopvq-inspect", "loopvq-eval", "loopvq-push", "loopvq-push"]


def test_workflow_commands_parse_with_the_real_parsers():
    """Each command, with the job's variables at their defaults, parses (types included: --max-kl is a float)."""
    env = _example_env()
    parsed = {}
    for step in _steps():
        for name, args in _commands(_expand(step.get("run", ""), env)):
            parsed.setdefault(name, []).append(_parse(name, args))
    (calibrate,) = parsed["loopvq-calibrate"]
    assert calibrate.config == "configs/tiny-ouro.yaml" and calibrate.output == "runs/tiny-ouro"
    (inspect,) = parsed["loopvq-inspect"]
    assert inspect.bundle == "runs/tiny-ouro/bundle"
    (gate,) = parsed["loopvq-eval"]
    assert gate.bundle == ["runs/tiny-ouro/bundle"] and gate.out == "runs/tiny-ouro/eval"
    assert gate.max_kl == float(env["MAX_KL"]) and gate.max_ppl_increase == float(env["MAX_PPL_INCREASE"])
    assert [(p.bundle, p.repo_id, p.dry_run) for p in parsed["loopvq-push"]] == [
        ("runs/tiny-ouro/bundle", "loopvq/tiny-ouro", True), ("runs/tiny-ouro/bundle", "loopvq/tiny-ouro", False)]


def test_eval_gates_and_push_only_from_main():
    pushes = 0
    for step in _steps():
        for name, args in _commands(step.get("run", "")):
            if name == "loopvq-eval":
                assert "--max-kl" in args and "--max-ppl-increase" in args
            if name == "loopvq-push":
                pushes += 1
                if "--dry-run" not in args:
                    assert "refs/heads/main" in step.get("if", "") and "github.event_name == 'push'" in step["if"]
                    assert "secrets.HF_TOKEN" in str(step.get("env"))
    assert pushes == 2


def test_a_flag_the_parser_does_not_know_fails():
    """The check above is real: argparse rejects what the console script does not define."""
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments: --max-kll"):
        _parse("loopvq-eval", ["--bundle", "b", "--max-kll", "0.1"])
    with pytest.raises(pytest.fail.Exception, match="required: --config"):
        _parse("loopvq-calibrate", ["--output", "runs/x"])


def test_documented_local_commands_parse():
    """Every loopvq-* line of docs/ci.md's bash blocks (placeholders such as <name> are plain strings to argparse)."""
    doc = (ROOT / "docs" / "ci.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", doc, flags=re.S)
    commands = [c for block in blocks for c in _commands(block)]
    assert {name for name, _ in commands} == set(PARSERS)
    for name, args in commands:
        _parse(name, args)


def test_ci_runs_the_readme_test_command():
    """README's second quick-start command is what .ci/run and the workflow's test job run."""
    readme = (ROOT / "README.md").read_text()
    quick = re.search(r"## Quick start.*?```bash\n(.*?)```", readme, flags=re.S).group(1)
    commands = [line.split("#", 1)[0].strip() for line in quick.splitlines() if line.strip()]
    assert commands == ["scripts/demo.sh", "scripts/test.sh"]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == ["scripts/test.sh"]
    runs = [step.get("run", "").strip() for step in _steps("tests")]
    assert "scripts/test.sh" in runs


def test_docs_show_the_workflow_verbatim():
    doc = (ROOT / "docs" / "ci.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", doc, flags=re.S)
    assert WORKFLOW.read_text() in blocks


def test_doc_links_resolve_inside_the_repo():
    """Relative links of README.md and docs/*.md point at files that exist; nothing cites the team's notes."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"
        assert "../shared" not in text and "looped-architectures" not in text, page.name
