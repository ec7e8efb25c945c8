"""Process groups for profiling with TP > 1: TP local processes (torch.multiprocessing, spawn) that meet at a
TCP rendezvous on 127.0.0.1 (gloo on CPU, NCCL on GPU), or the group of an existing `torchrun` launch.
The rank's work is passed in (`RankFn`, the profiler's `run_rank`): this module never imports its caller;
the local port comes from `lynx.runtime.launch`, which `lynx train` launches through too.

Every process group gets a timeout, and the parent watches its workers, so an unreachable rendezvous, a
crashed rank or a TP larger than the group ends in one clear error instead of a hang.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lynx.errors import LynxError
from lynx.profile.errors import ProfileError
from lynx.runtime.launch import free_port


def resolve_device(name: str, tp: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ProfileError("--device cuda: no CUDA device is available here (use --device cpu)")
        n = torch.cuda.device_count()
        if tp > n and "WORLD_SIZE" not in os.environ:
            raise ProfileError(f"TP {tp} is larger than the {n} CUDA device(s) on this machine")
        return torch.device("cuda", 0)
    if name != "cpu":
        raise ProfileError(f"--device {name!r}: expected cpu, cuda or auto")
    return torch.device("cpu")


RankFn = Callable[..., dict[str, Any]]
"""run_rank(cfg, group, device, progress=None) -> rank 0's raw measurements (plain data)."""


def parse_rendezvous(text: str) -> tuple[str, int]:
    host, sep, port = text.removeprefix("tcp://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ProfileError(f"--rendezvous {text!r}: expected HOST:PORT, e.g. 127.0.0.1:29500")
    return host, int(port)


def _init_group(backend: str, init_method: str, rank: int, world: int, timeout_s: float) -> None:
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # DistNetworkError, DistStoreError, RuntimeError: all mean "no rendezvous"
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ProfileError(f"cannot reach the rendezvous {init_method} within {timeout_s:.0f} s ({first})") from None


def _worker(rank: int, run_rank: RankFn, cfg: Any, device_type: str, init_method: str, timeout_s: float, q: Any,
            logdir: str) -> None:
    # torch's C++ layer prints multi-page warnings while a rendezvous retries: keep them in a log file.
    fd = os.open(os.path.join(logdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    try:
        torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // cfg.tp))
        device = torch.device("cpu")
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        _init_group("nccl" if device_type == "cuda" else "gloo", init_method, rank, cfg.tp, timeout_s)

        def prog(done: int, total: int) -> None:
            q.put(("progress", rank, (done, total)))

        raw = run_rank(cfg, dist.group.WORLD, device, prog if rank == 0 else None)
        q.put(("result", rank, raw if rank == 0 else None))
    except LynxError as e:
        q.put(("error", rank, str(e)))
    except Exception as e:
        q.put(("error", rank, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(run_rank: RankFn, cfg: Any, device: torch.device, progress: Callable[[int, int], None] | None,
                    rendezvous: str | None, timeout_s: float) -> dict[str, Any]:
    """Run `run_rank` on TP ranks; return rank 0's raw measurements."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ and rendezvous is None:
        return _run_in_launch(run_rank, cfg, device, timeout_s)
    host, port = parse_rendezvous(rendezvous) if rendezvous else ("127.0.0.1", free_port())
    init = f"tcp://{host}:{port}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    logdir = tempfile.mkdtemp(prefix="lynx-profile-")
    procs = [ctx.Process(target=_worker, args=(r, run_rank, cfg, device.type, init, timeout_s, q, logdir), daemon=True)
             for r in range(cfg.tp)]
    for p in procs:
        p.start()
    try:
        return _collect(procs, q, progress, timeout_s, logdir)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _collect(procs: list[Any], q: Any, progress: Callable[[int, int], None] | None, timeout_s: float,
             logdir: str) -> dict[str, Any]:
    """Wait for every rank, relaying progress. Silence longer than the group timeout (plus start-up slack)
    or a rank that dies without a word ends it."""
    result: dict[str, Any] | None = None
    done: set[int] = set()
    last = time.monotonic()
    silence = timeout_s + 60.0
    while len(done) < len(procs):
        try:
            kind, rank, payload = q.get(timeout=0.5)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if i not in done and not p.is_alive()]
            if dead:
                raise ProfileError(f"profiling rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                   f"without a result (its log: {logdir}/rank{dead[0]}.log)") from None
            if time.monotonic() - last > silence:
                raise ProfileError(f"profiling ranks were silent for {silence:.0f} s; gave up "
                                   f"(logs in {logdir})") from None
            continue
        last = time.monotonic()
        if kind == "error":
            raise ProfileError(f"rank {rank}: {payload}")
        if kind == "progress":
            if progress is not None:
                progress(*payload)
            continue
        done.add(rank)
        if rank == 0:
            result = payload
    assert result is not None
    return result


def _run_in_launch(run_rank: RankFn, cfg: Any, device: torch.device, timeout_s: float) -> dict[str, Any]:
    """Inside `torchrun`: the TP group is ranks 0..TP-1 of the launched world."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if cfg.tp > world:
        raise ProfileError(f"TP {cfg.tp} is larger than the process group ({world} ranks from the launcher)")
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    _init_group("nccl" if device.type == "cuda" else "gloo", "env://", rank, world, timeout_s)
    try:
        group = dist.new_group(list(range(cfg.tp)))
        if rank >= cfg.tp:
            raise ProfileError(f"rank {rank} is outside the TP group of {cfg.tp}; only ranks < TP profile")
        return run_rank(cfg, group, device)
    finally:
        dist.destroy_process_group()
