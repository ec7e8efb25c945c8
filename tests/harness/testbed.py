"""A two-rank testbed on one machine: each rank in its own network namespace, joined by a veth pair whose
ends are rate-limited with `tc qdisc ... tbf`. Collectives then take wire time while the CPU is free, as
on a GPU waiting for a slow interconnect, so overlapping recomputation with communication can show on a
2-core machine where a loopback all-reduce would compete with compute for the same cores.

It creates namespaces with unique names, uses addresses only inside them (10.77.N.1 and 10.77.N.2 on the
veth ends), pins rank r to CPU r, and removes everything on exit (context manager; `finally`). Needs root
and iproute2; `unavailable()` says why not, so tests and the benchmark skip with a clear message.

`python -m tests.harness.testbed probe` (run inside the testbed by `Testbed.run`) measures an all-reduce,
a compute burst, and both overlapped (the compute inside the all-reduce window).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
"""The repository root: ranks run `python -m tests.harness.testbed` with it on their path."""


def unavailable() -> str | None:
    """None when the testbed can run here, else the reason."""
    if not sys.platform.startswith("linux"):
        return "the testbed needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the testbed needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc", "taskset"):
        if shutil.which(tool) is None:
            return f"the testbed needs `{tool}` (iproute2 / util-linux)"
    name = f"lynxprobe{os.getpid() % 100000}"
    p = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if p.returncode != 0:
        return f"cannot create a network namespace: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _sh(*args: str) -> None:
    p = subprocess.run(list(args), capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {p.stderr.strip()}")


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str
    wall_s: float


class Testbed:
    """Two namespaces joined by a veth pair, each end shaped to `rate_mbit` (tbf)."""

    __test__ = False  # not a pytest test class, despite its name

    def __init__(self, rate_mbit: float, cpus: Sequence[int] = (0, 1)) -> None:
        self.rate_mbit = rate_mbit
        self.cpus = tuple(cpus)
        tag = f"{os.getpid() % 10000}{random.randrange(100):02d}"
        self.ns = (f"lynxa{tag}", f"lynxb{tag}")
        self.dev = (f"lxa{tag}", f"lxb{tag}")
        self.subnet = 10 + random.randrange(240)
        self.addr = (f"10.77.{self.subnet}.1", f"10.77.{self.subnet}.2")
        self._up = False

    def __enter__(self) -> Testbed:
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def create(self) -> None:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        for ns in self.ns:
            _sh("ip", "netns", "add", ns)
        self._up = True
        _sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
        rate_bps = self.rate_mbit * 1e6
        burst = max(32 * 1024, int(rate_bps / 8 / 250))  # at least one timer tick of bytes
        for i in (0, 1):
            ns, dev = self.ns[i], self.dev[i]
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{self.addr[i]}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
                "burst", str(burst), "latency", "100ms")

    def destroy(self) -> None:
        if not self._up:
            return
        for ns in self.ns:  # deleting a namespace deletes the veth end inside it, and with it the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._up = False

    def cut_link(self) -> None:
        """Take the link down (both ends) to emulate a cut cable."""
        for i in (0, 1):
            _sh("ip", "-n", self.ns[i], "link", "set", self.dev[i], "down")

    def popen(self, rank: int, argv: Sequence[str], port: int, env: dict[str, str] | None = None,
              world: int = 2) -> subprocess.Popen:
        """Rank r runs in namespace r % 2 on CPU r % 2: with 4 ranks, ranks 0 and 2 share namespace a and
        talk over its local address (unshaped), ranks 0 and 1 cross the shaped link."""
        slot = rank % 2
        e = dict(os.environ, **(env or {}))
        e.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank // 2), MASTER_ADDR=self.addr[0],
                 MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                 GLOO_SOCKET_IFNAME=self.dev[slot])  # gloo would pick the interface of the host name
        # `python -m tests.harness.testbed` from any directory: the repository root on the path
        e["PYTHONPATH"] = os.pathsep.join(filter(None, (str(_REPO), e.get("PYTHONPATH"))))
        cmd = ["ip", "netns", "exec", self.ns[slot], "taskset", "-c", str(self.cpus[slot % len(self.cpus)]),
               *argv]
        return subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, argv: Sequence[str] | Sequence[Sequence[str]], timeout: float = 600.0,
            env: dict[str, str] | None = None, world: int = 2) -> list[RankResult]:
        """Run one command per rank (the same for all, or a list of `world`) and wait for all."""
        per_rank = [list(argv)] * world if isinstance(argv[0], str) else [list(a) for a in argv]
        port = 20000 + random.randrange(20000)
        t0 = time.monotonic()
        procs = [self.popen(r, per_rank[r], port, env, world) for r in range(world)]
        out: list[RankResult] = []
        try:
            for r, p in enumerate(procs):
                left = max(1.0, timeout - (time.monotonic() - t0))
                so, se = p.communicate(timeout=left)
                out.append(RankResult(r, p.returncode, so, se, time.monotonic() - t0))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return out


def probe(mbytes: float, matmul_n: int, reps: int) -> dict[str, float]:
    """Inside a rank: time an all-reduce of `mbytes` MB, `reps` matmuls of n x n, and the two together with
    the matmuls inside the all-reduce's window (launched async, computed, then waited for); each the best of three
    (two ranks share two cores with whatever else runs: one sample was as noisy as the overlap it measures)."""
    import torch
    import torch.distributed as dist

    from lynx.runtime.layers.tp import run_collective

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=__import__("datetime").timedelta(seconds=60))
    x = torch.ones(int(mbytes * 1e6 / 4))
    a = torch.randn(matmul_n, matmul_n)

    def compute() -> None:
        for _ in range(reps):
            a.matmul(a)

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(3):
            dist.barrier()
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    timed(lambda: run_collective("allreduce", x, dist.group.WORLD))  # warm up the connection
    res = {
        "allreduce_s": timed(lambda: run_collective("allreduce", x, dist.group.WORLD)),
        "compute_s": timed(compute),
        "overlapped_s": timed(lambda: run_collective("allreduce", x, dist.group.WORLD, compute)),
    }
    dist.destroy_process_group()
    return res


def probe_p2p(mbytes: float, reps: int, both_ways: bool = False) -> dict[str, float]:
    """Inside a rank (world 2): one-way time of a `mbytes` MB send from rank 0 to rank 1 and back, as the
    pipeline's p2p sends activations and gradients over the link (gloo send/recv, fp32 tensors). Returns the
    median one-way time (half a round trip) and the effective bandwidth it implies. `both_ways`: both ranks
    send to each other at once (as a 1F1B pipeline sends an activation one way while a gradient comes back),
    and the time of one such exchange is reported."""
    import statistics

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=__import__("datetime").timedelta(seconds=60))
    x = torch.ones(int(mbytes * 1e6 / 4))
    y = torch.empty_like(x)
    peer = 1 - dist.get_rank()
    trips = []
    for k in range(reps + 1):  # the first round trip opens the connection
        dist.barrier()
        t = time.perf_counter()
        if both_ways:
            for w in (dist.isend(x, peer), dist.irecv(y, peer)):
                if w is not None:
                    w.wait()
        elif dist.get_rank() == 0:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)
        if k:
            trips.append(time.perf_counter() - t)
    dist.destroy_process_group()
    one_way = statistics.median(trips) / (1 if both_ways else 2)
    return {"bytes": float(x.numel() * 4), "one_way_s": one_way, "bandwidth_Bps": x.numel() * 4 / one_way}


def probe_pipeline_order(mbytes: float, reps: int, busy_s: float = 0.07) -> dict[str, float]:
    """Inside a rank (world 2), the order a 1F1B pipeline posts its p2p in (decision 0060):
    rank 1 sends a gradient at once, then waits for an activation; rank 0 is busy for `busy_s` (a forward),
    then sends its activation and only then posts the receive for the gradient, as torch lowers the list.
    Reports (on rank 0) when the gradient arrived after it was sent: over gloo it waits for the receive to be
    posted and then for the activation to cross first."""
    import statistics

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=__import__("datetime").timedelta(seconds=60))
    x, y = torch.ones(int(mbytes * 1e6 / 4)), torch.empty(int(mbytes * 1e6 / 4))
    arrived = []
    for k in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if dist.get_rank() == 1:
            works = [dist.isend(x, 0), dist.irecv(y, 0)]
        else:
            time.sleep(busy_s)
            works = [dist.isend(x, 1), dist.irecv(y, 1)]
        for w in works:
            if w is not None:
                w.wait()
        if k:
            arrived.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return {"bytes": float(x.numel() * 4), "busy_s": busy_s, "exchange_done_s": statistics.median(arrived)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="tests.harness.testbed")
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("probe", help="(inside the testbed) all-reduce vs compute vs both overlapped")
    pr.add_argument("--mbytes", type=float, default=16.0)
    pr.add_argument("--matmul-n", type=int, default=512)
    pr.add_argument("--reps", type=int, default=20)
    pp = sub.add_parser("p2p", help="(inside the testbed) one-way send/recv time of a message over the link")
    pp.add_argument("--mbytes", type=float, default=1.0)
    pp.add_argument("--reps", type=int, default=10)
    pp.add_argument("--both-ways", action="store_true", help="both ranks send at once")
    pp.add_argument("--pipeline-order", action="store_true",
                    help="rank 1 sends at once; rank 0 is busy 70 ms, sends, then receives (torch's 1F1B order)")
    args = p.parse_args(argv)
    if args.cmd == "p2p":
        if not (math.isfinite(args.mbytes) and args.mbytes > 0) or args.reps < 1:
            p.error("p2p: --mbytes must be a positive number and --reps at least 1")
        out = (probe_pipeline_order(args.mbytes, args.reps) if args.pipeline_order
               else probe_p2p(args.mbytes, args.reps, args.both_ways))
        print(json.dumps(out))
        return
    print(json.dumps(probe(args.mbytes, args.matmul_n, args.reps)))


if __name__ == "__main__":
    main()
