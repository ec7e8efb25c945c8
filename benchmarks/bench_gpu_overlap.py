"""How much of a recomputation window one GPU hides behind a collective on the side stream.

Two processes share GPU 0 and all-reduce 128 MB over gloo (CUDA tensors) while the window runs 20 matmuls
of 4096 x 4096 on the compute stream (`lynx.runtime.layers.tp.run_collective`). Target: both together take
clearly less than the sum, overlapped < all-reduce + compute - half the shorter of the two.
Run: python benchmarks/bench_gpu_overlap.py (needs CUDA; the lead runs it on a GPU machine).
"""

from __future__ import annotations

import datetime
import json
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from _markdown import Out
from _targets import Targets
from rich.table import Table


def worker(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from lynx.runtime.layers.tp import run_collective

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    x = torch.ones(32 * 2**20, device="cuda")  # 128 MB: gloo stages it through host memory
    a = torch.randn(4096, 4096, device="cuda")

    def compute() -> None:
        for _ in range(20):
            a.matmul(a)

    def timed(fn: Any) -> float:
        dist.barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    timed(lambda: run_collective("allreduce", x, dist.group.WORLD))
    timed(compute)
    res = {"allreduce_s": timed(lambda: run_collective("allreduce", x, dist.group.WORLD)),
           "compute_s": timed(compute),
           "overlapped_s": timed(lambda: run_collective("allreduce", x, dist.group.WORLD, compute))}
    y = run_collective("allreduce", x, dist.group.WORLD, compute)
    res["correct"] = bool(torch.all(y == 2))  # the window ran and the sum is right (the GPU test reads this)
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def main() -> None:
    import argparse

    import _results

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    _results.add_option(ap, "bench_gpu_overlap")
    args = ap.parse_args()
    run = _results.Run()
    import torch
    import torch.multiprocessing as mp

    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_overlap: needs a CUDA device")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.json"
        mp.spawn(worker, args=(port, str(out)), nprocs=2, join=True)
        r = json.loads(out.read_text())
    serial = r["allreduce_s"] + r["compute_s"]
    bound = serial - 0.5 * min(r["allreduce_s"], r["compute_s"])
    targets = Targets()
    t = Table(title="all-reduce 128 MB (gloo, CUDA tensors) and a 20-matmul window on one GPU")
    for c in ("all-reduce s", "window s", "sum s", "overlapped s", "target", "holds"):
        t.add_column(c, justify="right")
    t.add_row(f"{r['allreduce_s']:.3f}", f"{r['compute_s']:.3f}", f"{serial:.3f}", f"{r['overlapped_s']:.3f}",
              f"< {bound:.3f}", targets.at_most("overlap hides half the shorter", r["overlapped_s"], bound))
    con = Out(args.markdown)
    con.print(t)
    con.print(targets.summary())
    run.write(args.results, "bench_gpu_overlap", "measurement", "One GPU hides a recomputation window behind a "
              "collective on the side stream", _results.figures_of(targets), targets.summary())


if __name__ == "__main__":
    main()
