"""Launching ranks and their faults as one line: local spawning (`spawn_ranks`), the rendezvous with a
deadline (`init_group`), argument checks before any process group, torch's C++ logs kept out of the
terminal, and a failure on a rank described by what it was doing (joining the rendezvous, a collective) and
the timeout that bounded it. `lynx train` and `lynx profile` launch through here. No module-level torch
import: this runs before torch is loaded.

`--debug` (LYNX_DEBUG=1) keeps torch's own logs and prints the traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lynx.errors import LynxError
from lynx.paths import check_output
from lynx.validate import Range, check_option

if TYPE_CHECKING:
    from lynx.runtime.config import TrainConfig

TIMEOUT_RANGE = Range(gt=0, le=86400)
"""A process-group timeout: positive, at most a day (torch turns it into milliseconds)."""


class RuntimeArgError(LynxError):
    """A runtime argument that cannot work (checked before any process starts)."""


class TrainError(LynxError):
    """A plan the runtime cannot run."""


class RankFailedError(LynxError):
    """A local rank died or timed out (its own line is already on stderr): a fault, not bad input."""

    exit_code = 1


def debug() -> bool:
    return os.environ.get("LYNX_DEBUG", "") not in ("", "0", "false", "no")


def quiet_torch_logs() -> None:
    """Keep c10's warning and error logs (with their C++ frames) off stderr unless --debug: the failure
    is reported as one line by `rank_failure`. Must run before torch is imported; spawned ranks inherit it."""
    if not debug():
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
        os.environ.setdefault("TORCH_SHOW_CPP_STACKTRACES", "0")


def quiet_spawn_logs() -> None:
    """torch.multiprocessing.spawn logs a warning per surviving rank it terminates after one failed; the
    failure itself is lynx's one line. Kept with --debug."""
    if not debug():
        import logging

        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)


def quiet_pipelining_logs() -> None:
    """torch's pipeline schedule logs the failing action and the whole schedule before re-raising; the failure
    itself is lynx's one line (`rank_failure`). Kept with --debug. Call after torch is imported."""
    if not debug():
        import logging

        for name in ("torch.distributed.pipelining", "torch.distributed.pipelining.schedules"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def stop_ranks(processes: list[Any], grace_s: float = 5.0) -> None:
    """Terminate local rank processes still running (SIGTERM, then SIGKILL after `grace_s`)."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(grace_s)
        if p.is_alive():
            p.kill()
            p.join()


def check_train_args(args: TrainConfig) -> None:
    """Everything about `lynx train`'s arguments that can be checked before a process group exists."""
    check_option("--iters", args.iters, Range(gt=0, le=MAX_ITERS), integer=True)
    check_option("--warmup", args.warmup, Range(ge=0, le=MAX_ITERS), integer=True)
    check_option("--timeout", args.timeout, TIMEOUT_RANGE)
    check_option("--threads", args.threads, Range(ge=0, le=MAX_THREADS), integer=True)
    check_option("--lr", args.lr, Range(gt=0, le=1e3))
    if args.out:
        check_output(args.out, "--out", (".json",), RuntimeArgError)
    if args.trace:
        check_output(args.trace, "--trace", (".json",), RuntimeArgError)  # Chrome-trace JSON
    check_launch_env()
    if args.data:
        p = Path(args.data)
        if not p.is_file():
            raise RuntimeArgError(f"--data {args.data}: no such file (a text file of training bytes)")
        if not os.access(p, os.R_OK):
            raise RuntimeArgError(f"--data {args.data}: not readable (permission denied)")
        if p.stat().st_size == 0:
            raise RuntimeArgError(f"--data {args.data}: empty file; give a text file of training bytes")


MAX_ITERS = 1_000_000
"""Iterations of a measurement run: a million is days of training on this runtime; more is a typo."""
MAX_THREADS = 1024
"""torch threads per rank; beyond a machine's cores torch's pool creation aborts the process."""


def check_launch_env() -> None:
    """torchrun's variables, when set, are integers that make sense together (RANK below WORLD_SIZE, a
    master address to meet at): one line naming the variable, before any process group."""
    env = os.environ
    ints = {}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        if var in env:
            try:
                ints[var] = int(env[var])
            except ValueError:
                raise RuntimeArgError(f"environment variable {var}={env[var]!r}: expected an integer "
                                      "(torchrun sets it)") from None
            if ints[var] < 0:
                raise RuntimeArgError(f"environment variable {var}={ints[var]}: expected >= 0")
    if ("RANK" in ints) != ("WORLD_SIZE" in ints):
        raise RuntimeArgError("environment: RANK and WORLD_SIZE go together (launch with torchrun, or set neither)")
    if "RANK" in ints:
        if not ints["RANK"] < ints["WORLD_SIZE"]:
            raise RuntimeArgError(f"environment: RANK {ints['RANK']} must be below WORLD_SIZE {ints['WORLD_SIZE']}")
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not env.get(v)]
        if ints["WORLD_SIZE"] > 1 and missing:
            raise RuntimeArgError(f"environment: {' and '.join(missing)} not set; RANK/WORLD_SIZE ranks meet at "
                                  "MASTER_ADDR:MASTER_PORT (torchrun sets them)")
    if "MASTER_PORT" in ints and not 0 < ints["MASTER_PORT"] < 65536:
        raise RuntimeArgError(f"environment variable MASTER_PORT={ints['MASTER_PORT']}: expected 1-65535")
    if "LOCAL_WORLD_SIZE" in ints and ints["LOCAL_WORLD_SIZE"] == 0:
        raise RuntimeArgError("environment variable LOCAL_WORLD_SIZE=0: expected >= 1")


def default_backend(device: str) -> str:
    """What `--backend auto` means: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device == "cuda" else "gloo"


def resolve_backend(device: str, backend: str, local_ranks: int, gpus: int) -> str:
    """The process-group backend for `--backend` on `--device` (already resolved from auto), checked before
    any process group: auto is NCCL on CUDA and gloo on the CPU; NCCL needs CUDA and one GPU per local rank
    (it refuses two ranks on one GPU); gloo on CUDA runs the pipeline's p2p through host memory."""
    if backend not in ("auto", "nccl", "gloo"):
        raise RuntimeArgError(f"--backend {backend!r}: expected auto, nccl or gloo")
    if device == "cuda" and gpus < 1:
        raise RuntimeArgError("--device cuda: no CUDA device on this machine (torch.cuda.is_available() is "
                              "False); use --device cpu")
    chosen = backend if backend != "auto" else default_backend(device)
    if chosen == "nccl" and device != "cuda":
        raise RuntimeArgError("--backend nccl needs --device cuda; on the CPU use --backend gloo (or auto)")
    if chosen == "nccl" and local_ranks > gpus:
        raise RuntimeArgError(f"--backend nccl: {local_ranks} ranks on this node but {gpus} GPU(s), and NCCL "
                              f"refuses two ranks on one GPU; use --backend gloo (p2p through host memory)")
    return chosen


def rank_failure(e: BaseException, rank: int, world: int, phase: str, timeout_s: float) -> str:
    """One line for a failed rank: its phase, the timeout, torch's first message line."""
    if debug():
        traceback.print_exception(e, file=sys.stderr)
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    if phase == "rendezvous":
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}" \
            if "MASTER_ADDR" in os.environ else "the rendezvous"
        what = f"could not join the process group at {where} within --timeout {timeout_s:g} s"
    else:
        what = f"failed during {phase} (collectives time out after --timeout {timeout_s:g} s)"
    return f"lynx train: rank {rank}/{world} {what}: {type(e).__name__}: {first}"


RENDEZVOUS_GRACE_S = 1.0


@contextlib.contextmanager
def rendezvous_deadline(rank: int, world: int, timeout_s: float) -> Iterator[None]:
    """Bound joining the process group by `timeout_s` (+1 s): torch's TCPStore client retries with
    back-off past its own timeout (11 s for 8 s measured with torch 2.13), so a watchdog ends the rank
    with the same one line if the join outlives the timeout."""
    where = (f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}" if "MASTER_ADDR" in os.environ
             else "the rendezvous")

    def expire() -> None:
        print(f"lynx train: rank {rank}/{world} could not join the process group at {where} within --timeout "
              f"{timeout_s:g} s", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(timeout_s + RENDEZVOUS_GRACE_S, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a local rendezvous."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_group(backend: str, init_method: str, rank: int, world: int, timeout_s: float) -> None:
    """Join the default process group within `timeout_s` (`rendezvous_deadline`); every later collective
    times out after `timeout_s` too."""
    import datetime

    import torch.distributed as dist

    with rendezvous_deadline(rank, world, timeout_s):
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))


def spawn_ranks(entry: Any, world: int, args: Any) -> None:
    """`entry(rank, world, init_method, args)` on `world` local processes (127.0.0.1); a failed rank is one
    line (the ranks print their own cause), Ctrl-C stops them all. `args` must pickle (an
    `TrainConfig` for `lynx train`, a namespace for `lynx profile`)."""
    from torch.multiprocessing.spawn import start_processes

    quiet_spawn_logs()
    ranks = start_processes(entry, args=(world, f"tcp://127.0.0.1:{free_port()}", args), nprocs=world,
                               join=False, start_method="spawn")
    try:
        while not ranks.join():
            pass
    except KeyboardInterrupt:  # interrupted: stop the ranks too (a signal to lynx alone does not reach them)
        stop_ranks(ranks.processes)
        raise
    except Exception as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        # A rank that raised: torch puts its traceback in the message; the last line is the error itself.
        raise RankFailedError(f"training failed: {lines[-1] if 'following error' in lines[0] else lines[0]}") from None


RankFn = Callable[[Any], dict[str, Any]]
"""A function run on every rank with the default group (`torch.distributed.group.WORLD`), returning JSON."""


def run_ranks(fn: RankFn, world: int, outdir: str | Path, timeout_s: float = 60.0, threads: int = 1,
              backend: str = "gloo") -> list[dict[str, Any]]:
    """`fn(group)` on `world` local ranks (spawned and joined as `spawn_ranks` does, each joining the default
    process group through `init_group`), returning what each rank returned, in rank order. `fn` must pickle
    (a module-level function or a `functools.partial` of one). The tests' multi-rank checks run through here,
    so they exercise the same spawning, rendezvous and failure path as `lynx train`."""
    out = Path(outdir)
    spawn_ranks(_collect_entry, world, (fn, str(out), timeout_s, threads, backend))
    import json

    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _collect_entry(rank: int, world: int, init_method: str, payload: tuple[RankFn, str, float, int, str]) -> None:
    import json

    import torch
    import torch.distributed as dist

    fn, outdir, timeout_s, threads, backend = payload
    init_group(backend, init_method, rank, world, timeout_s)
    if threads:
        torch.set_num_threads(threads)
    try:
        result = fn(dist.group.WORLD)
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # As `lynx train` does: gloo's destructors abort a rank now and then ("terminate called without an active
    # exception") after a clean run; the results are on disk and every rank passed the barrier.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
