"""The CI workflow, the documented command lines and the docs' own rules: valid YAML, every loopvq-* command of
the workflow and of the docs' bash blocks accepted by the real argparse parser of its console script, the quality
gate on, publishing on main only, tests run as the README says, docs/ci.md showing the workflow verbatim; and the
pages (README.md, docs/*.md): every link and backticked repository path or ``loopvq_calib`` name resolving, no
page over 300 lines but the bundle-format spec, no run logs outside the results pages, every page in README's map.
The docs checker is itself run on a small tree that breaks each rule, so that it cannot pass by finding nothing."""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from loopvq_calib.cli import PARSERS

WORKFLOW = ROOT / ".github" / "workflows" / "calibrate.yml"
SHELL_OPERATORS = {"&&", "||", ";", "|", ">", ">>"}
MAX_LINES = 300
LONG_PAGES = {"bundle-format.md"}  # the format specification: exact, whole, on one page
# measured numbers live here
RESULTS_PAGES = {
    "performance.md",
    "quality.md",
    "quality-models.md",
    "decode-speed.md",
    "reference-model.md",
    "tasq-grouping.md",
}
REPO_DIRS = {"loopvq_calib", "docs", "tests", "scripts", "benchmarks", "configs", "artifacts", ".github", ".ci"}
# run-by-run history belongs in git and the issue notes, not in the guide pages
HISTORY = [
    re.compile(p)
    for p in (
        r"\b[Rr]un \d+\b",
        r"\b[Ii]ssue \d+\b",
        r"before this work",
        r"measured in session",
        r"`(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}`",
    )
]


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
                for arg in tokens[i + 1 :]:
                    if arg in SHELL_OPERATORS:
                        break
                    args.append(arg)
                out.append((name, args))
    return out


def _parse(name: str, args: list[str]) -> argparse.Namespace:
    """Parse with the console script's own parser; an unknown or malformed argument fails the test with argparse's
    message."""
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
        ("runs/tiny-ouro/bundle", "loopvq/tiny-ouro", True),
        ("runs/tiny-ouro/bundle", "loopvq/tiny-ouro", False),
    ]


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
    ci = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert ci == ["scripts/test.sh"]
    runs = [step.get("run", "").strip() for step in _steps("tests")]
    assert "scripts/test.sh" in runs


def test_docs_show_the_workflow_verbatim():
    doc = (ROOT / "docs" / "ci.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", doc, flags=re.S)
    assert WORKFLOW.read_text() in blocks


def _bash_commands(page: Path) -> list[tuple[str, list[str]]]:
    """(console script, arguments) of every loopvq-* line in a page's bash blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
    return [c for block in blocks for c in _commands(block)]


def test_every_documented_command_parses():
    """Every loopvq-* line in a bash block of README.md or docs/*.md is accepted by its console script's parser."""
    found = 0
    for page in _pages(ROOT):
        for name, args in _bash_commands(page):
            _parse(name, args)
            found += 1
    assert found >= len(PARSERS)


def _pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _top_level_names(path: Path) -> dict[str, ast.AST]:
    """Names a module defines or imports at its top level (a package face's lazy names too) -> their node."""
    tree = ast.parse(path.read_text(), str(path))
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update({t.id: node for t in targets if isinstance(t, ast.Name)})
            if isinstance(node.value, ast.Dict):  # loopvq_calib/__init__.py's _LAZY: public name -> module
                names.update({k.value: node for k in node.value.keys if isinstance(k, ast.Constant)})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
    return names


def _python_name_problem(root: Path, dotted: str) -> str | None:
    """Why ``loopvq_calib.x.y`` names nothing in the source (None when it names a module, or a name defined in
    one, or a method or attribute of a class defined in one)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:cut])
        module = base / "__init__.py" if (base / "__init__.py").is_file() else base.with_suffix(".py")
        if module.is_file():
            break
    else:
        return "no such module"
    rest = parts[cut:]
    if not rest:
        return None
    names = _top_level_names(module)
    if rest[0] not in names:
        return f"{module.relative_to(root)} defines no {rest[0]}"
    node = names[rest[0]]
    if len(rest) > 1 and isinstance(node, ast.ClassDef):
        members = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        members |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        members |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        if rest[1] not in members:
            return f"{rest[0]} in {module.relative_to(root)} has no {rest[1]}"
    return None


def doc_problems(root: Path) -> list[str]:
    """Every broken docs rule under ``root``, one line each (empty: the rules hold)."""
    out = []
    readme = (root / "README.md").read_text()
    for page in _pages(root):
        text, name = page.read_text(), page.relative_to(root).as_posix()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" not in target and not target.startswith("mailto:") and not (page.parent / target).exists():
                out.append(f"{name} links to missing {target}")
        for span in re.findall(r"`([^`\n]+)`", text):
            path = span.split("::")[0].rstrip("/")
            if re.fullmatch(r"[\w.\-/]+", path) and "/" in path and path.split("/")[0] in REPO_DIRS:
                if not (root / path).exists():
                    out.append(f"{name} names missing {path}")
            dotted = re.match(r"(loopvq_calib(?:\.\w+)+)(?:\(|$)", span)
            if dotted and (problem := _python_name_problem(root, dotted.group(1))):
                out.append(f"{name} names {dotted.group(1)}: {problem}")
        if "../shared" in text or "looped-architectures" in text:
            out.append(f"{name} cites the team's notes")
        lines = len(text.splitlines())
        if page.parent.name == "docs" and page.name not in LONG_PAGES and lines > MAX_LINES:
            out.append(f"{name} has {lines} lines (at most {MAX_LINES})")
        if page.name not in RESULTS_PAGES:
            for pattern in HISTORY:
                for hit in pattern.finditer(text):
                    out.append(f"{name} tells history: {hit.group(0)!r} (results pages and git hold it)")
        if page.parent.name == "docs" and f"](docs/{page.name})" not in readme:
            out.append(f"{name} is not in README.md's documentation map")
    return out


def test_the_docs_keep_their_rules():
    assert doc_problems(ROOT) == []


def test_the_docs_checker_reports_each_kind_of_broken_rule(tmp_path):
    """A tree whose pages break every rule once is reported line by line; what is right is not."""
    (tmp_path / "docs").mkdir()
    pkg = tmp_path / "loopvq_calib" / "codes"
    pkg.mkdir(parents=True)
    (tmp_path / "loopvq_calib" / "__init__.py").write_text('_LAZY = {"load_bundle": "bundle.reader"}\n')
    (pkg / "__init__.py").write_text("")
    (pkg / "codec.py").write_text(
        "class BlockCodec:\n    def encode(self):\n        pass\n\n\ndef nearest():\n    pass\n"
    )
    (tmp_path / "README.md").write_text("[guide](docs/guide.md), [spec](docs/bundle-format.md)\n")
    (tmp_path / "docs" / "bundle-format.md").write_text("spec line\n" * (MAX_LINES + 1))
    (tmp_path / "docs" / "guide.md").write_text(
        "[spec](bundle-format.md) [gone](gone.md) [web](https://example.org/x.md) `loopvq_calib/codes/codec.py`\n"
        "`loopvq_calib/codes/old.py` `tests/golden*/` `runs/x/bundle` `loopvq_calib.codes.codec.nearest`\n"
        "`loopvq_calib.codes.codec.BlockCodec.encode` `loopvq_calib.load_bundle(path)` `loopvq_calib.qcache`\n"
        "`loopvq_calib.codes.codec.farthest` `loopvq_calib.codes.codec.BlockCodec.fit` see ../shared/notes\n"
        "in run 36 (issue 16), at `0f03392`\n" + "line\n" * MAX_LINES
    )
    (tmp_path / "docs" / "performance.md").write_text("run 36 at `0f03392`: 51 s\n")
    found = doc_problems(tmp_path)
    assert found == [
        "docs/guide.md links to missing gone.md",
        "docs/guide.md names missing loopvq_calib/codes/old.py",
        "docs/guide.md names loopvq_calib.qcache: loopvq_calib/__init__.py defines no qcache",
        "docs/guide.md names loopvq_calib.codes.codec.farthest: loopvq_calib/codes/codec.py defines no farthest",
        (
            "docs/guide.md names loopvq_calib.codes.codec.BlockCodec.fit: "
            "BlockCodec in loopvq_calib/codes/codec.py has no fit"
        ),
        "docs/guide.md cites the team's notes",
        f"docs/guide.md has {MAX_LINES + 5} lines (at most {MAX_LINES})",
        "docs/guide.md tells history: 'run 36' (results pages and git hold it)",
        "docs/guide.md tells history: 'issue 16' (results pages and git hold it)",
        "docs/guide.md tells history: '`0f03392`' (results pages and git hold it)",
        "docs/performance.md is not in README.md's documentation map",
    ]
