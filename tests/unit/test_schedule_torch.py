"""lynx's schedule CSV loads in torch.distributed.pipelining, and torch's dumps load in lynx (compute-only
format: one row per rank, cells such as ``0F0`` with torch's global stage index). Needs torch; no
process group: the schedules are built on stand-in stages that carry only their indices."""

from __future__ import annotations

from pathlib import Path

import pytest

from lynx.schedule import load_csv, make_schedule, save_csv

torch = pytest.importorskip("torch")
S = pytest.importorskip("torch.distributed.pipelining.schedules")


class _Stage:
    """What the schedule classes read from a stage, nothing more."""

    def __init__(self, index: int, num_stages: int, rank: int, world: int) -> None:
        self.stage_index, self.num_stages = index, num_stages
        self.group_rank, self.group_size = rank, world
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = torch.nn.Linear(1, 1)


def _stages(rank: int, pp: int, v: int) -> list[_Stage]:
    return [_Stage(rank + c * pp, pp * v, rank, pp) for c in range(v)]


CASES = [(2, 4, 1), (4, 8, 1), (4, 8, 2), (2, 6, 3), (4, 4, 2)]


@pytest.mark.parametrize(("pp", "m", "v"), CASES)
def test_lynx_csv_loads_in_torch(tmp_path: Path, pp: int, m: int, v: int) -> None:
    sched = make_schedule(pp, m, v)
    path = tmp_path / "lynx.csv"
    save_csv(sched, path)
    rt = S._PipelineScheduleRuntime(_stages(0, pp, v), m)
    rt._load_csv(str(path), format="compute_only")  # torch validates it (_validate_and_set_stage_mapping)
    assert {r: [str(a) for a in acts] for r, acts in rt.pipeline_order.items()} == dict(enumerate(sched.rows()))
    # torch infers the Megatron layout: global stage k on rank k % pp
    assert rt.stage_index_to_group_rank == {k: k % pp for k in range(pp * v)}


@pytest.mark.parametrize(("pp", "m", "v"), CASES)
def test_torch_dump_loads_in_lynx(tmp_path: Path, pp: int, m: int, v: int) -> None:
    path = tmp_path / "torch.csv"
    torch_sched = S.ScheduleInterleaved1F1B(_stages(0, pp, v), m)  # one stage per rank: torch's 1F1B order
    torch_sched._dump_csv(str(path), format="compute_only")
    order = torch_sched.pipeline_order
    sched = load_csv(path)  # lynx validates it
    assert sched.pp == pp and sched.num_chunks == v
    got = [[a.text(pp) for a in acts] for acts in sched]
    want = [[str(a) for a in order[r] if a is not None] for r in range(pp)]
    assert got == want
    if v > 1 and m > pp:
        # torch's interleaved 1F1B follows Megatron's order: lynx generates the same action lists (with
        # exactly pp micro-batches Megatron warms up with every forward, torch does not)
        assert sched.ranks == make_schedule(pp, m, v).ranks
