"""Train a plan: `lynx train --plan plan.json` or `torchrun --nproc-per-node TP -m lynx.runtime.train --plan ...`.

Builds the plan's model for its TP layout (PP > 1 or DP > 1 plans go to `lynx.runtime.pipeline_train`), runs N
iterations on synthetic tokens (or byte-level tokens of a text file) under stage 0's policy through the
recompute engine, and reports per iteration: time, loss, activation bytes held for backward (peak, per
rank), and seconds of recomputation on demand versus inside communication windows.

Process groups: gloo on CPU, NCCL on CUDA, created with a timeout; any failure on a rank (a dead peer, a
cut link, a timeout) is reported as one line naming the rank and the cause, and the process exits 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lynx.errors import LynxError, PlanFormatError
from lynx.paths import write_text
from lynx.plan import load_plan
from lynx.policy.base import validate_layer_policy
from lynx.runtime.engine import RecomputeEngine
from lynx.runtime.launch import (
    RankFailedError,
    check_train_args,
    default_backend,
    quiet_spawn_logs,
    rank_failure,
    rendezvous_deadline,
    resolve_backend,
    stop_ranks,
)
from lynx.runtime.layers.family import runtime_for
from lynx.runtime.layers.gpt import LayerConfig
from lynx.runtime.layers.gpt_model import synthetic_batch
from lynx.runtime.predict import predicted_activation_bytes, runtime_graph
from lynx.runtime.step import train_step


class TrainError(LynxError):
    """A plan the runtime cannot run, or a failed rank."""


def _config(plan_path: str, dtype: torch.dtype, core_attn: bool) -> tuple[Any, Any, LayerConfig, Any]:
    problem, result = load_plan(plan_path)
    par, model = problem.parallel, problem.model
    if par.pp != 1:
        raise TrainError(f"{plan_path}: PP={par.pp}; lynx train runs PP=1 plans only (the pipeline runtime "
                         "is not built yet) - plan with --pp 1")
    if par.dp != 1:
        raise TrainError(f"{plan_path}: DP={par.dp}; lynx train runs DP=1 plans only")
    rt = runtime_for(model)  # the plan's model family picks the runtime layer
    try:
        cfg = rt.config(model, par, dtype, core_attn)
    except ValueError as e:
        raise TrainError(f"{plan_path}: {e}") from None
    names = rt.op_names(cfg)
    if names != problem.graph.names:
        raise PlanFormatError(f"{plan_path}: the plan's layer ops ({', '.join(problem.graph.names)}) are not "
                              f"this runtime layer's ({', '.join(names)}); check --core-attn")
    policy = result.policies[0]
    if len(policy.layers) != model.num_layers:
        raise PlanFormatError(f"{plan_path}: stage 0 has {len(policy.layers)} layers, model {model.num_layers}")
    for i, lp in enumerate(policy.layers):
        errs = validate_layer_policy(problem.graph, lp, has_fwd_windows=True)
        if errs:
            raise PlanFormatError(f"{plan_path}: layer {i}: " + "; ".join(errs))
    return problem, result, cfg, policy


def _text_batches(path: str, vocab: int, cfg: LayerConfig, n: int, it: int, seed: int) -> list:
    data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long() % vocab
    need = cfg.seq_length + 1
    if data.numel() < need:
        raise TrainError(f"{path}: {data.numel()} bytes, need at least {need}")
    g = torch.Generator().manual_seed(seed * 7 + it)
    out = []
    for _ in range(n):
        starts = torch.randint(0, data.numel() - need + 1, (cfg.micro_batch_size,), generator=g)
        t = torch.stack([data[s: s + need] for s in starts.tolist()])
        out.append((t[:, :-1], t[:, 1:]))
    return out


def run(args: argparse.Namespace, rank: int, world: int, group: Any) -> dict[str, Any] | None:
    """One rank's training loop; returns the report on rank 0."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    problem, result, cfg, policy = _config(args.plan, dtype, args.core_attn)
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if args.device == "cuda" else torch.device("cpu")
    vocab, layers = problem.model.vocab_size, problem.model.num_layers
    m = problem.parallel.num_microbatches
    model = runtime_for(problem.model).model(cfg, layers, vocab, group, device=device, seed=args.seed)
    engine = RecomputeEngine(model.layers, policy)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    iters: list[dict[str, Any]] = []
    for it in range(args.warmup + args.iters):
        if args.die_at is not None and rank == args.die_rank and it == args.die_at:
            os._exit(17)  # fault injection for tests: this rank vanishes mid-run
        engine.stats.reset()
        if args.data:
            batches = [(a.to(device), b.to(device)) for a, b in _text_batches(args.data, vocab, cfg, m, it, args.seed)]
        else:
            batches = [synthetic_batch(vocab, cfg.micro_batch_size, cfg.seq_length, it * m + j, args.seed, device)
                       for j in range(m)]
        if group is not None:
            dist.barrier(group)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = train_step(model, m, engine, in_flight=1, batches=batches)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        st = engine.stats
        rec = {"iter": it, "warmup": it < args.warmup, "time_s": dt, "loss": loss,
               "act_peak_bytes": st.peak_bytes, "act_after_fwd_bytes": max(st.fwd_end_bytes, default=0),
               "recompute_ondemand_s": st.ondemand_s, "recompute_window_s": st.window_s,
               "restored_in_window": st.restored_in_window, "restored_on_demand": st.restored_on_demand}
        if device.type == "cuda":
            rec["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        if group is not None:
            per_rank: list[Any] = [None] * world
            dist.all_gather_object(per_rank, {"peak": st.peak_bytes, "time_s": dt}, group=group)
            rec["act_peak_bytes_per_rank"] = [p["peak"] for p in per_rank]
            rec["time_s"] = max(p["time_s"] for p in per_rank)
        iters.append(rec)
        if rank == 0 and not args.quiet:
            print(f"iter {it:3d}{' (warmup)' if it < args.warmup else '':9s} time {rec['time_s']:7.3f} s  "
                  f"loss {loss:7.4f}  act peak {st.peak_bytes / 2**20:8.2f} MiB  recompute on-demand "
                  f"{st.ondemand_s:6.3f} s  windowed {st.window_s:6.3f} s", flush=True)
    if rank != 0:
        return None
    g_rt = runtime_graph(problem.graph, dtype) if problem.graph.meta.source == "analytic" else problem.graph
    after_fwd, peak = predicted_activation_bytes(g_rt, policy, cfg, in_flight=1)
    timed = [r for r in iters if not r["warmup"]] or iters
    return {
        "plan": str(args.plan), "method": result.method, "tp": cfg.tp, "num_layers": layers,
        "num_microbatches": m, "device": str(device), "dtype": args.dtype,
        "backend": dist.get_backend(group) if group is not None else "none",
        "config": {k: (str(v) if k == "dtype" else v) for k, v in asdict(cfg).items()},
        "iterations": iters,
        "median_time_s": sorted(r["time_s"] for r in timed)[len(timed) // 2],
        "measured_act_after_fwd_bytes": timed[-1]["act_after_fwd_bytes"],
        "measured_act_peak_bytes": max(r["act_peak_bytes"] for r in timed),
        "predicted_act_after_fwd_bytes": after_fwd, "predicted_act_peak_bytes": peak,
        "predicted_iteration_time_s": _predicted_time(args.plan),
    }


def _predicted_time(plan_path: str) -> float | None:
    d = json.loads(Path(plan_path).read_text())
    return d.get("prediction", {}).get("iteration_time_s")


def _finish(report: dict[str, Any] | None, args: argparse.Namespace) -> None:
    if report is None:
        return
    if args.out:
        write_text(args.out, json.dumps(report, indent=2), "--out", TrainError)
    if not args.quiet:
        print(f"median iteration {report['median_time_s']:.3f} s (the plan predicts "
              f"{report['predicted_iteration_time_s']:.4g} s on its hardware); "
              f"activations held after forward {report['measured_act_after_fwd_bytes'] / 2**20:.2f} MiB "
              f"(predicted {report['predicted_act_after_fwd_bytes'] / 2**20:.2f} MiB), peak "
              f"{report['measured_act_peak_bytes'] / 2**20:.2f} MiB", flush=True)


def _init(args: argparse.Namespace, rank: int, world: int, init_method: str) -> Any:
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    backend = getattr(args, "backend", "auto")  # resolved by `launch` (faults.resolve_backend)
    if backend == "auto":
        backend = default_backend(args.device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    return dist.group.WORLD


def _rank_main(rank: int, world: int, init_method: str, args: argparse.Namespace) -> None:
    """Entry of one rank (spawned locally, under torchrun, or inside a testbed namespace)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cpu":
        from lynx.runtime.cpu_alloc import keep_freed_memory

        keep_freed_memory()  # page faults from re-allocation are not recomputation (cpu_alloc.py)

    phase = "rendezvous"
    try:
        with rendezvous_deadline(rank, world, args.timeout):
            group = _init(args, rank, world, init_method) if world > 1 else None
        phase = "training"
        _finish(run(args, rank, world, group), args)
        if group is not None:
            # Tear down together, then leave without running gloo's destructors: a rank whose peer closed
            # its sockets first can otherwise abort in a gloo thread ("terminate called without an active
            # exception") after all the work is done (seen about once in 20 testbed runs).
            dist.barrier(group)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    except LynxError:
        raise
    except KeyboardInterrupt:
        if world == 1:
            raise  # this is the lynx process: `lynx: interrupted`, exit 130
        print(f"lynx train: rank {rank}/{world} interrupted", file=sys.stderr, flush=True)
        os._exit(130)
    except Exception as e:  # a dead peer, a cut link, a timeout: one line, the rank and the cause
        print(rank_failure(e, rank, world, phase, args.timeout), file=sys.stderr, flush=True)
        os._exit(1)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lynx.runtime.train", description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--data", default=None, help="a text file: byte-level tokens instead of synthetic ones")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default=None, help="write the report (JSON) here (rank 0)")
    p.add_argument("--timeout", type=float, default=60.0, help="process-group timeout, seconds")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads per rank (0: default)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="process groups: auto (NCCL on CUDA, gloo on CPU); gloo on CUDA runs the pipeline's "
                        "p2p through host memory (several ranks on one GPU)")
    p.add_argument("--host-staged", action="store_true", help=argparse.SUPPRESS)  # tests: that p2p on the CPU
    p.add_argument("--core-attn", action="store_true", help="scaled_dot_product_attention as core_attn")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--schedule", default=None,
                   help="PP > 1: the action list to run (compute-only CSV, one row per pipeline rank); "
                        "default 1F1B (interleaved with vpp > 1)")
    p.add_argument("--trace", default=None, help="PP > 1: write the last iteration's timeline (Chrome trace)")
    p.add_argument("--compare-trace", action="store_true",
                   help="PP > 1: print the measured timeline beside the simulator's (needs --trace)")
    p.add_argument("--die-at", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--freeze-at", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--die-rank", type=int, default=1, help=argparse.SUPPRESS)
    return p


def launch(args: argparse.Namespace) -> None:
    """Under torchrun (RANK set): this process is one rank. Otherwise TP=1 runs here and TP>1 spawns TP
    local processes on 127.0.0.1."""
    check_train_args(args)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    from lynx.runtime.pipeline_train import is_pipeline_plan

    if is_pipeline_plan(args.plan):  # PP > 1 or DP > 1: the pipeline runtime
        from lynx.runtime.pipeline_train import launch as launch_pipeline

        launch_pipeline(args)
        return
    if args.schedule or args.trace or args.compare_trace:
        raise TrainError(f"{args.plan}: --schedule, --trace and --compare-trace are for PP > 1 or DP > 1 plans")
    _, _, cfg, _ = _config(args.plan, torch.float32, args.core_attn)
    args.backend = resolve_backend(args.device, args.backend, int(os.environ.get("LOCAL_WORLD_SIZE", cfg.tp)),
                                   torch.cuda.device_count() if args.device == "cuda" else 0)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args)
        return
    if args.data and Path(args.data).stat().st_size < cfg.seq_length + 1:
        raise TrainError(f"--data {args.data}: {Path(args.data).stat().st_size} bytes; the plan's sequence "
                         f"length needs at least {cfg.seq_length + 1}")
    if cfg.tp == 1:
        _rank_main(0, 1, "", args)
        return
    spawn_ranks(_rank_main, cfg.tp, args)


def spawn_ranks(entry: Any, world: int, args: argparse.Namespace) -> None:
    """`entry(rank, world, init_method, args)` on `world` local processes (127.0.0.1); a failed rank is one
    line (the ranks print their own cause), Ctrl-C stops them all."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    quiet_spawn_logs()
    ranks = mp.start_processes(entry, args=(world, f"tcp://127.0.0.1:{port}", args), nprocs=world,
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


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        launch(args)
    except LynxError as e:
        print(f"lynx: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
