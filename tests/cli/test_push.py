"""loopvq-push --dry-run: lists the bundle's files and uploads nothing; a missing --repo-id is a usage error."""

from __future__ import annotations

import pytest
from conftest import write_tiny_bundle

from loopvq_calib.cli.push import main


def test_push_dry_run_lists_the_files(tiny_ouro_dir, tmp_path, capsys):
    bundle = write_tiny_bundle(tmp_path / "bundle", tiny_ouro_dir)
    assert main([str(bundle), "--repo-id", "org/tiny", "--dry-run"]) == 0
    out = capsys.readouterr().out
    files = sorted(p.name for p in bundle.iterdir())
    assert out == f"would upload {len(files)} files to org/tiny:\n" + "".join(f"  {name}\n" for name in files)
    with pytest.raises(SystemExit) as usage:
        main([str(bundle), "--dry-run"])
    assert usage.value.code == 2 and "--repo-id" in capsys.readouterr().err
