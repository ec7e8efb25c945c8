"""Run a function on two gloo ranks (TP = 2 on one machine) and collect each rank's JSON result."""

from __future__ import annotations

import datetime
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

RankFn = Callable[[Any], dict[str, Any]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, port: int, fn: RankFn, outdir: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(fn(dist.group.WORLD), f)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # As `lynx train` does: gloo's destructors abort a rank now and then (SIGABRT, "terminate called without
    # an active exception") after a clean run; the results are on disk and both ranks passed the barrier.
    os._exit(0)


def run_two_ranks(fn: RankFn, tmp_path: Path) -> list[dict[str, Any]]:
    """`fn(group)` on ranks 0 and 1 (a module-level function or a functools.partial of one, so that it
    pickles); returns what each rank returned."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(free_port(), fn, str(tmp_path)), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
