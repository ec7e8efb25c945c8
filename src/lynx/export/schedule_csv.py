"""Pipeline schedules as CSV in torch.distributed.pipelining's format: one row per rank, one cell per
compute action (``"2F0"``: stage 2, forward, micro-batch 0; stages are global virtual-stage indices), as
`_PipelineScheduleRuntime._load_csv` and torchtitan's `pipeline_parallel_schedule_csv` read it.

`schedule_rows` uses lynx.schedule's own generator and CSV writer when they exist (issue 9:
`make_schedule`, `dumps`); until then 1F1B comes from lynx.schedule's `one_f_one_b` and interleaved 1F1B
from `interleaved_rows` below, a TEMPORARY stand-in (its rows equal issue 9's generator's for PP 4, VPP 2,
8 micro-batches; delete it once issue 9 is merged).
"""

from __future__ import annotations

import importlib

from lynx.errors import SpecError
from lynx.schedule import one_f_one_b


def one_f_one_b_rows(pp: int, m: int) -> list[list[str]]:
    return [[str(a) for a in one_f_one_b(s, pp, m)] for s in range(pp)]


def interleaved_rows(pp: int, vpp: int, m: int) -> list[list[str]]:
    """Megatron's interleaved 1F1B order (megatron/core/pipeline_parallel/schedules.py): micro-batches go
    through the chunks in groups of `pp`; rank r warms up with 2 (pp - r - 1) + (vpp - 1) pp forwards."""
    if m % pp:
        raise SpecError(f"interleaved 1F1B needs the micro-batches ({m}) to be a multiple of PP ({pp})")
    total = m * vpp
    rows: list[list[str]] = []
    for r in range(pp):
        def fwd(k: int, r: int = r) -> str:
            return f"{((k // pp) % vpp) * pp + r}F{(k // (pp * vpp)) * pp + k % pp}"

        def bwd(k: int, r: int = r) -> str:
            return f"{(vpp - 1 - (k // pp) % vpp) * pp + r}B{(k // (pp * vpp)) * pp + k % pp}"

        # Megatron runs every forward first when there are exactly pp micro-batches
        warm = total if m == pp else min(2 * (pp - r - 1) + (vpp - 1) * pp, total)
        row = [fwd(k) for k in range(warm)]
        for i in range(total - warm):
            row += [fwd(warm + i), bwd(i)]
        row += [bwd(k) for k in range(total - warm, total)]
        rows.append(row)
    return rows


def schedule_rows(pp: int, vpp: int, m: int) -> list[list[str]]:
    sched = importlib.import_module("lynx.schedule")
    if hasattr(sched, "make_schedule") and hasattr(sched, "dumps"):  # issue 9's generator and writer
        return [line.split(",") for line in sched.dumps(sched.make_schedule(pp, m, vpp)).splitlines()]
    return one_f_one_b_rows(pp, m) if vpp == 1 else interleaved_rows(pp, vpp, m)


def to_csv(rows: list[list[str]]) -> str:
    return "".join(",".join(r) + "\n" for r in rows)
