"""The fuzz table (tests/test_fuzz.py), pushes: bundles edited or listing names that could upload the wrong files
(globs, '..', absolute paths, links), bad repo ids, evaluation reports of another bundle or malformed in a field the
card reads. Each case exits 2 (3 for a real push while offline), naming it in one short line, and writes and deletes
nothing (support/fuzz.py)."""

from __future__ import annotations

import pytest
from support.fuzz import (
    DEEP,
    Case,
    assert_refused,
    case_ids,
    edit_meta,
    listed,
    offline_push,
    report_push,
    symlinked_card,
    through_linked_folder,
    ws,  # noqa: F401 (the fixture)
)

from loopvq_calib.cli import push_main

CASES: list[Case] = [
    # -- bundles: push ---------------------------------------------------------------------------------
    (
        "push-edited-bundle",
        lambda ws: (push_main, [ws.bundle(edit_meta(("name",), "x")), "--repo-id", "org/x", "--dry-run"]),
        2,
        "metadata checksum mismatch",
    ),
    (
        "push-bad-repo-id",
        lambda ws: (push_main, [ws.bundle(), "--repo-id", "not a repo", "--dry-run"]),
        2,
        "is not a valid hub repo id",
    ),
    # -- files that must not make the toolkit delete, upload or compute the wrong thing (issue: file contents) --
    ("push-glob-name", lambda ws: listed(ws, "*"), 2, "files entry '*' contains a glob character"),
    ("push-bracket-name", lambda ws: listed(ws, "card[1].md"), 2, "files entry 'card[1].md' contains a glob character"),
    (
        "push-dot-slash-name",
        lambda ws: listed(ws, "./README.md"),
        2,
        "files entry './README.md' has an empty, '.' or '..' component",
    ),
    (
        "push-dotdot-name",
        lambda ws: listed(ws, "../secret.txt"),
        2,
        "files entry '../secret.txt' has an empty, '.' or '..' component",
    ),
    ("push-absolute-name", lambda ws: listed(ws, "/etc/passwd"), 2, "files entry '/etc/passwd' is an absolute path"),
    ("push-symlinked-card", symlinked_card, 2, "files entry 'README.md' is or passes through a symbolic link"),
    (
        "push-report-of-another-bundle",
        lambda ws: report_push(ws, lambda r: r["bundles"][0].update(codebooks_sha256="0" * 64)),
        2,
        "the report measured another bundle named",
    ),
    # -- what a file can say: evaluation reports -------------------------------------------------------
    (
        "report-two-rows-of-the-bundle",
        lambda ws: report_push(ws, lambda r: r["bundles"].append({**r["bundles"][0], "ppl_quantized": 99.0})),
        2,
        "--eval-report {}/report.json: 2 rows (bundles[0], bundles[2]) measured a bundle named 'ouro_loopvq'",
    ),
    (
        "report-row-without-ppl",
        lambda ws: report_push(ws, lambda r: r["bundles"][0].pop("ppl_quantized")),
        2,
        "--eval-report {}/report.json: field bundles[0].ppl_quantized is missing",
    ),
    (
        "report-eval-kl-not-a-number",
        lambda ws: report_push(ws, lambda r: r["bundles"][0].update(eval_kl="abc")),
        2,
        "{}/report.json: field bundles[0].eval_kl is 'abc', not a finite number",
    ),
    (
        "report-row-not-an-object",
        lambda ws: report_push(ws, lambda r: r["bundles"].insert(0, 5)),
        2,
        "{}/report.json: field bundles[0] is 5, not an object",
    ),
    (
        "report-serving-not-an-object",
        lambda ws: report_push(ws, lambda r: r["served"]["entries"][1].update(serving=5)),
        2,
        "{}/report.json: field served.entries[1].serving is 5, not an object or null",
    ),
    (
        "report-too-deep",
        lambda ws: report_push(ws, text=DEEP),
        2,
        "--eval-report: cannot read an evaluation report: {}/report.json: nested too deeply to read",
    ),
    (
        "report-duplicate-key",
        lambda ws: report_push(ws, text='{"bundles": [], "bundles": []}'),
        2,
        "{}/report.json: field bundles appears more than once",
    ),
    (
        "report-row-without-codebooks-sha",
        lambda ws: report_push(ws, lambda r: r["bundles"][0].pop("codebooks_sha256")),
        2,
        (
            "the row of bundle 'ouro_loopvq' records no codebooks_sha256, so it cannot be matched to this bundle; "
            "run loopvq-eval on it again"
        ),
    ),
    (
        "push-write-card-only-without-report",
        lambda ws: (push_main, [ws.bundle(), "--write-card-only"]),
        2,
        "--write-card-only writes the card of an evaluation report: give --eval-report",
    ),
    ("push-offline-writes-no-card", offline_push, 3, "offline mode is on (HF_HUB_OFFLINE=1)"),
    # -- what a file can say: bundles ------------------------------------------------------------------
    (
        "push-meta-too-deep",
        lambda ws: (
            push_main,
            [ws.bundle(lambda p: (p / "loopvq.json").write_text(DEEP)), "--repo-id", "org/x", "--dry-run"],
        ),
        2,
        "{}/bundle/loopvq.json: nested too deeply to read",
    ),
    ("push-overlong-name", lambda ws: listed(ws, "a" * 300), 2, "files entry 'aaaaaaaa"),
    (
        "push-through-a-linked-folder",
        through_linked_folder,
        2,
        "{}/bundle/docs: files entry 'docs/card.md' is or passes through a symbolic link",
    ),
]


@pytest.mark.parametrize("name,setup,status,fragment", CASES, ids=case_ids(CASES))
def test_bad_input_exits_2_names_it_and_changes_nothing(ws, capsys, name, setup, status, fragment):
    assert_refused(ws, capsys, setup, status, fragment)
