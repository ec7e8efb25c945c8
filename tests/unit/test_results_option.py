"""Every benchmark's `--results PATH` (`benchmarks/_results.add_option`) is checked when the arguments are read,
before minutes of work: a missing folder, a directory or a place that takes no file is one argparse error (exit 2),
and the check leaves no file behind."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _results  # noqa: E402


def _parse(value: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench")
    _results.add_option(ap, "bench")
    return ap.parse_args(["--results", value])


@pytest.mark.parametrize(("value", "said"), [
    ("{tmp}/missing/x.json", "does not exist"),
    ("{tmp}", "is a directory"),
])
def test_a_results_path_that_cannot_be_written_is_refused_before_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, said: str) -> None:
    with pytest.raises(SystemExit) as e:
        _parse(value.format(tmp=tmp_path))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("bench: error: argument --results:") and said in err


def test_a_writable_results_path_is_taken_and_nothing_is_left(tmp_path: Path) -> None:
    target = tmp_path / "r.json"
    assert _parse(str(target)).results == target
    assert not target.exists()
