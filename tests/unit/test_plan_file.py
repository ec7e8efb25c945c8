from __future__ import annotations

import json
from pathlib import Path

import pytest

from lynx.api import plan
from lynx.errors import LynxError, PlanFormatError
from lynx.plan import Plan, load_plan
from lynx.problem import PlanProblem


def test_plan_roundtrip_reproduces_prediction(tmp_path: Path, gpt7b_problem: PlanProblem) -> None:
    for method in ("selective", "block", "uniform"):
        p = plan(gpt7b_problem, method)
        f = tmp_path / f"{method}.json"
        p.save(f)
        d = json.loads(f.read_text())
        assert d["schema_version"] == 2
        assert set(d["prediction"]) >= {"iteration_time_s", "samples_per_s", "stages"}
        assert set(d["prediction"]["stages"][0]) >= {"peak_memory_bytes", "budget_bytes", "recompute_critical_s",
                                                     "recompute_overlapped_s"}
        problem, result = load_plan(f)
        again = Plan.evaluate(problem, result)
        assert again.prediction == p.prediction


def test_bad_plan_files(tmp_path: Path) -> None:
    with pytest.raises(PlanFormatError, match="no such plan file"):
        load_plan(tmp_path / "missing.json")
    f = tmp_path / "garbage.json"
    f.write_text("{not json")
    with pytest.raises(PlanFormatError, match="not a JSON plan"):
        load_plan(f)
    f.write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(PlanFormatError, match="schema_version 99"):
        load_plan(f)
    f.write_text(json.dumps({"schema_version": 1, "model": {}}))
    with pytest.raises(LynxError, match="garbage.json: model: missing required field.s. name, num_layers"):
        load_plan(f)
    f.write_text(json.dumps({"schema_version": 1}))
    with pytest.raises(PlanFormatError, match="missing or malformed field"):
        load_plan(f)
