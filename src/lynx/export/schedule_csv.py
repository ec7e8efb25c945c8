"""Pipeline schedules as CSV in torch.distributed.pipelining's format: one row per rank, one cell per
compute action (``"2F0"``: stage 2, forward, micro-batch 0; stages are global virtual-stage indices), as
`_PipelineScheduleRuntime._load_csv` and torchtitan's `pipeline_parallel_schedule_csv` read it. The rows are
lynx.schedule's own generator and writer: the export ships the very action list the simulator priced."""

from __future__ import annotations

from lynx.schedule import dumps, make_schedule


def schedule_rows(pp: int, vpp: int, m: int) -> list[list[str]]:
    return [line.split(",") for line in dumps(make_schedule(pp, m, vpp)).splitlines()]


def to_csv(rows: list[list[str]]) -> str:
    return "".join(",".join(r) + "\n" for r in rows)
