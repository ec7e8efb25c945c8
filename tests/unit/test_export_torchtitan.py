"""torchtitan pieces: module FQNs per model part, the schedule CSV, and the config fields checked by
torchtitan 0.3.0's own config classes (skipped when torchtitan is absent)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lynx.api import plan as plan_with
from lynx.export.layout import ChunkLayout
from lynx.export.schedule_csv import schedule_rows
from lynx.export.source import source_from
from lynx.export.torchtitan import build_torchtitan, module_fqns, write_torchtitan
from lynx.schedule import one_f_one_b
from tests.conftest import problem_for


def test_module_fqns_follow_the_layout() -> None:
    parts = module_fqns(ChunkLayout(4, 1, (9, 8, 8, 7)))
    assert parts[0][:2] == ["tok_embeddings", "layers.0"] and parts[0][-1] == "layers.8"
    assert parts[1] == [f"layers.{i}" for i in range(9, 17)]
    assert parts[3][-3:] == ["layers.31", "norm", "lm_head"]
    inter = module_fqns(ChunkLayout(2, 2, (1, 2, 3, 4)))
    assert inter == [["tok_embeddings", "layers.0"], ["layers.1", "layers.2"], ["layers.3", "layers.4", "layers.5"],
                     ["layers.6", "layers.7", "layers.8", "layers.9", "norm", "lm_head"]]


def _run_rows(rows: list[list[str]], num_stages: int) -> None:
    """Execute the per-rank action lists with pipeline dependencies; fail on a deadlock or a repeat."""
    done: set[tuple[int, str, int]] = set()
    pos = [0] * len(rows)
    while any(p < len(r) for p, r in zip(pos, rows, strict=True)):
        progressed = False
        for rank, row in enumerate(rows):
            if pos[rank] == len(row):
                continue
            cell = row[pos[rank]]
            kind = "F" if "F" in cell else "B"
            s, j = (int(x) for x in cell.split(kind))
            assert s % len(rows) == rank, f"stage {s} on rank {rank}"
            need = ((s - 1, "F", j) if s > 0 else None) if kind == "F" else (
                (s + 1, "B", j) if s < num_stages - 1 else (s, "F", j))
            if kind == "B" and (s, "F", j) not in done:
                continue
            if need is None or need in done:
                assert (s, kind, j) not in done
                done.add((s, kind, j))
                pos[rank] += 1
                progressed = True
        assert progressed, f"deadlock at {pos}"


@pytest.mark.parametrize("pp, vpp, m", [(4, 1, 16), (4, 2, 16), (2, 3, 4), (4, 2, 4)])
def test_schedule_rows_are_complete_and_deadlock_free(pp: int, vpp: int, m: int) -> None:
    rows = schedule_rows(pp, vpp, m)
    assert all(len(r) == 2 * m * vpp for r in rows)
    _run_rows(rows, pp * vpp)
    if vpp == 1:
        assert rows == [[str(a) for a in one_f_one_b(s, pp, m)] for s in range(pp)]
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    actions = {r: [sched._Action.from_str(c) for c in row] for r, row in enumerate(rows)}
    sched._validate_schedule(actions, pp, pp * vpp, m)


def test_config_pieces_validate_against_torchtitan(tmp_path: Path) -> None:
    configs = pytest.importorskip("torchtitan.config.configs")
    p = plan_with(problem_for(mb=16), "lynx", record=False)
    exp = build_torchtitan(source_from(p.problem, p.result))
    paths = write_torchtitan(exp, tmp_path)
    cfg = json.loads(paths[0].read_text())
    par = configs.ParallelismConfig(**cfg["parallelism"])
    tr = configs.TrainingConfig(**cfg["training"])
    assert par.pipeline_parallel_degree == 4 and par.tensor_parallel_degree == 4
    assert len(par.module_fqns_per_model_part) == 4
    n_mb = tr.local_batch_size // par.pipeline_parallel_microbatch_size
    assert n_mb == p.problem.parallel.num_microbatches
    layers = [f for part in par.module_fqns_per_model_part for f in part if f.startswith("layers.")]
    assert layers == [f"layers.{i}" for i in range(p.problem.model.num_layers)]
    rows = [ln.split(",") for ln in paths[1].read_text().splitlines()]
    assert len(rows) == 4 and rows[0][0] == "0F0"
