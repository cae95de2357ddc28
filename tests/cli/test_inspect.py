"""loopvq-inspect: prints the reader's summary of a bundle; exit 2 and one line for a bundle that does not check out."""

from __future__ import annotations

from conftest import write_tiny_bundle

from loopvq_calib.bundle.reader import inspect_bundle
from loopvq_calib.cli.inspect import main


def test_inspect_prints_the_summary(tiny_ouro_dir, tmp_path, capsys):
    bundle = write_tiny_bundle(tmp_path / "bundle", tiny_ouro_dir)
    assert main([str(bundle)]) == 0
    assert capsys.readouterr().out == inspect_bundle(str(bundle)) + "\n"
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "missing" in err
