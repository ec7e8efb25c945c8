"""benchmarks/readme_search.py: the configuration search's pick for a Megatron-LM README row is predicted at
least as fast as the published layout under its best stock flag (issue 19), on the rows that search in about a
second (the benchmark runs all nine); and an unknown row is one clear line with exit 2."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
rs = importlib.import_module("readme_search")


@pytest.mark.parametrize("name", ["7.1B", "16B"])
def test_pick_is_at_least_as_fast_as_the_published_layout(name: str) -> None:
    row = next(r for r in rs.ROWS if r.name == name)
    holds, line = rs.run_row(row)
    assert holds, line
    published_s = float(line.split("|")[3].split()[-2])
    pick_s = float(line.split("|")[4].split()[-2])
    assert 0 < pick_s <= published_s


def test_unknown_row_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["readme_search.py", "--rows", "9B"])
    assert rs.main() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--rows" in err[0] and "9B" in err[0] and "1.7B" in err[0]
