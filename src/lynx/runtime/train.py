"""Train a plan: `lynx train --plan plan.json`, or `torchrun --nproc-per-node N -m lynx.runtime.train --plan ...`.

One training loop for every plan: the plan's TP x PP x DP (x VPP) layout runs as a pipeline (PP = 1 is a
one-stage pipeline) executing the plan's schedule, each stage's layers through the recompute engine under
that stage's policy, AdamW after each iteration. Tokens are synthetic (or byte-level tokens of a text file).
The report (`lynx.runtime.report`) gives per iteration the time, the loss and recomputation counts, and per
stage the activation bytes held against the plan's prediction; `--trace FILE` writes the last iteration's
timeline as a Chrome trace, `--compare-trace` prints it beside the simulator's.

Process groups: gloo on CPU, NCCL on CUDA, created with a timeout; the layout is checked against the world
before any process group; any failure on a rank (a dead peer, a cut link, a timeout) is one line naming the
rank and the cause, and the rank exits 1 (`lynx.runtime.launch`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lynx.errors import LynxError
from lynx.graph import Graphs, LayerGraph
from lynx.runtime import report as rep
from lynx.runtime.config import NO_PROBES, TrainConfig, TrainProbes, parse
from lynx.runtime.launch import (
    TrainError,
    check_train_args,
    free_port,
    init_group,
    quiet_pipelining_logs,
    rank_failure,
    resolve_backend,
    spawn_ranks,
)
from lynx.runtime.layers import tp as tp_mod
from lynx.runtime.layers.gpt_model import synthetic_batch
from lynx.runtime.pipeline import PipelineLayout, PipelineRunner, check_world, make_groups
from lynx.runtime.pipeline.order import check_executable, layout_schedule, read_schedule
from lynx.runtime.predict import predicted_activation_bytes, predicted_offloaded_bytes, runtime_graph
from lynx.runtime.run_plan import RunPlan, load_run
from lynx.schedule import Schedule

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PRECISIONS = {"fp32": None, "megatron-bf16": torch.bfloat16}
"""`TrainConfig.precision` as torch sees it: the autocast dtype (None: none)."""

__all__ = ["RunPlan", "TrainConfig", "TrainError", "TrainProbes", "launch", "load_run", "main"]


def run_schedule(config: TrainConfig, layout: PipelineLayout) -> Schedule:
    sched = read_schedule(config.schedule) if config.schedule else layout_schedule(layout.pp, layout.vpp,
                                                                                 layout.num_microbatches)
    check_executable(sched, layout.pp, layout.vpp, layout.num_microbatches, config.schedule or "action list")
    return sched


# -- data ------------------------------------------------------------------------------------------------
Batch = tuple[torch.Tensor, torch.Tensor]
"""(tokens [b, s], next-token labels [b, s]) of one micro-batch."""


def text_batches(path: str, vocab: int, cfg: Any, n: int, it: int, seed: int) -> list[Batch]:
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


def batches(config: TrainConfig, rp: RunPlan, it: int, dp_rank: int, device: torch.device) -> list[Batch]:
    """Iteration `it`'s micro-batches of DP rank `dp_rank`: the global batch's micro-batches
    (it * DP + dp_rank) * m .. + m - 1, so a DP run sees the single-process run's data."""
    cfg, m, vocab = rp.cfg, rp.layout.num_microbatches, rp.problem.model.vocab_size
    step = it * rp.layout.dp + dp_rank
    if config.data:
        return [(a.to(device), b.to(device)) for a, b in text_batches(config.data, vocab, cfg, m, step, config.seed)]
    return [synthetic_batch(vocab, cfg.micro_batch_size, cfg.seq_length, step * m + j, config.seed, device)
            for j in range(m)]


# -- the loop --------------------------------------------------------------------------------------------
def _trace_collectives(runner: PipelineRunner) -> None:
    def tracer(kind: str, a: float, b: float, c: float) -> None:
        runner.event("collective", f"{kind} window", a, b)
        runner.event("collective", f"wait {kind}", b, c)

    tp_mod.set_collective_tracer(tracer if runner.tracing else None)


def run(config: TrainConfig, rank: int, world: int) -> dict[str, Any] | None:
    """One rank's training loop; returns the report on rank 0."""
    dtype = DTYPES[config.dtype]
    amp = PRECISIONS[config.precision]
    rp = load_run(config.plan, dtype, config.core_attn)
    layout = rp.layout
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if config.device == "cuda" else torch.device("cpu")
    runner = PipelineRunner(layout, run_schedule(config, layout), rp.cfg, rp.problem.model.vocab_size, rank,
                            make_groups(layout, rank, config.timeout), device, config.seed, timeout_s=config.timeout,
                            host_staged=host_staged(config), autocast=amp,
                            fsdp=rp.fsdp)
    opt = torch.optim.AdamW(runner.parameters(), lr=config.lr)
    dp_rank = layout.coords(rank)[1]
    records: list[rep.IterRecord] = []
    events: list[Any] = []
    total = config.warmup + config.iters
    for it in range(total):
        if config.probes.before_iteration is not None:
            config.probes.before_iteration(runner, rank, it)
        runner.reset_stats()
        data = batches(config, rp, it, dp_rank, device)
        runner.tracing, runner.events = it == total - 1 and bool(config.trace), []
        _trace_collectives(runner)
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        runner.step(data)
        if config.probes.after_backward is not None:
            config.probes.after_backward(runner, rank, it)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if runner.tracing:
            events = [(c, n, a - t0, b - t0, st) for c, n, a, b, st in runner.events]
        cuda = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
        records.append(rep.iter_record(it, it < config.warmup, dt, runner, cuda))
        if rank == 0 and not config.quiet:
            print(f"iter {it:3d}{' (warmup)' if it < config.warmup else '':9s} time {dt:7.3f} s (rank 0)", flush=True)
    tp_mod.set_collective_tracer(None)
    mine = rep.RankRecord(rank, tuple(sorted(runner.modules)), tuple(records), tuple(events),
                          _predicted(rp, runner, amp or dtype), _master_dtypes(runner, opt))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return rep.build(config, rp, everyone, _backend(config), host_staged(config)) if rank == 0 else None


def _master_dtypes(runner: PipelineRunner, opt: torch.optim.Optimizer) -> dict[str, tuple[str, ...]]:
    params = list(runner.parameters())
    state = [t for p in params for t in opt.state.get(p, {}).values() if isinstance(t, torch.Tensor) and t.dim()]
    return {"params": tuple(sorted({str(p.dtype) for p in params})),
            "grads": tuple(sorted({str(p.grad.dtype) for p in params if p.grad is not None})),
            "optimizer": tuple(sorted({str(t.dtype) for t in state}))}


def _predicted(rp: RunPlan, runner: PipelineRunner, dtype: torch.dtype) -> dict[int, rep.StagePrediction]:
    scaled: dict[int, LayerGraph] = {}

    def rt(g: LayerGraph) -> LayerGraph:
        if id(g) not in scaled:
            scaled[id(g)] = runtime_graph(g, dtype) if g.meta.source == "analytic" else g
        return scaled[id(g)]

    out = {}
    for s, mod in runner.modules.items():
        pol = mod.spec.policy
        if pol is None:
            continue
        # the stage's layers' graphs: one, or one per layer by its kind (a stack of dense and MoE layers)
        gs = rp.problem.range_graphs(mod.spec.first_layer, mod.spec.num_layers)
        g: Graphs = rt(gs) if isinstance(gs, LayerGraph) else tuple(rt(x) for x in gs)
        k = runner.in_flight.get(s, 1)
        after, peak = predicted_activation_bytes(g, pol, rp.cfg, in_flight=k)
        out[s] = rep.StagePrediction(after, peak, k, predicted_offloaded_bytes(g, pol, rp.cfg))
    return out


# -- ranks -----------------------------------------------------------------------------------------------
def _backend(config: TrainConfig) -> str:
    b: str = config.backend  # resolved by `launch`
    return b if b != "auto" else ("nccl" if config.device == "cuda" else "gloo")


def host_staged(config: TrainConfig) -> bool:
    """p2p through host memory: gloo on CUDA (gloo sends CPU tensors only), or forced by the hidden
    `--host-staged` (the CPU tests of that path)."""
    return (config.device == "cuda" and _backend(config) == "gloo") or bool(config.host_staged)


def rank_main(rank: int, world: int, init_method: str, config: TrainConfig) -> None:
    """Entry of one rank (spawned locally, under torchrun, in this process, or inside a testbed namespace).
    A rank of a multi-process run leaves with `os._exit`; the only rank of an in-process run returns."""
    if config.threads:
        torch.set_num_threads(config.threads)
    if config.device == "cpu":
        from lynx.runtime.cpu_alloc import keep_freed_memory

        keep_freed_memory()  # page faults from re-allocation are not recomputation (cpu_alloc.py)
    quiet_pipelining_logs()
    alone = world == 1 and "RANK" not in os.environ
    phase = "rendezvous"
    try:
        if config.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        init_group(_backend(config), init_method, rank, world, config.timeout)
        phase = "training"
        rep.finish(run(config, rank, world), config)
        if alone:
            dist.destroy_process_group()
            return
        # Tear down together, then leave without running gloo's destructors: a rank whose peer closed its
        # sockets first can otherwise abort in a gloo thread ("terminate called without an active exception")
        # after all the work is done (seen about once in 20 testbed runs).
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except LynxError:
        if alone and dist.is_initialized():
            dist.destroy_process_group()
        raise
    except KeyboardInterrupt:
        if alone:
            raise  # this is the lynx process: `lynx: interrupted`, exit 130
        print(f"lynx train: rank {rank}/{world} interrupted", file=sys.stderr, flush=True)
        os._exit(130)
    except Exception as e:  # a dead or frozen peer, a cut link, a timeout: one line, the rank and the cause
        print(rank_failure(e, rank, world, phase, config.timeout), file=sys.stderr, flush=True)
        os._exit(1)


def launch(config: TrainConfig) -> None:
    """Under torchrun (RANK set) this process is one rank; a one-rank layout runs in this process; otherwise
    the layout's ranks are spawned locally on 127.0.0.1. Everything checkable is checked first."""
    check_train_args(config)
    if config.device == "auto":
        config = config.but(device="cuda" if torch.cuda.is_available() else "cpu")
    check_precision(config)
    if config.compare_trace and not config.trace:
        raise TrainError("--compare-trace needs --trace FILE (the measured timeline to compare)")
    rp = load_run(config.plan, torch.float32, config.core_attn)
    layout = rp.layout
    run_schedule(config, layout)
    if config.data and Path(config.data).stat().st_size < rp.cfg.seq_length + 1:
        raise TrainError(f"--data {config.data}: {Path(config.data).stat().st_size} bytes; the plan's sequence "
                         f"length needs at least {rp.cfg.seq_length + 1}")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size))
    config = config.but(backend=resolve_backend(config.device, config.backend, local,
                                            torch.cuda.device_count() if config.device == "cuda" else 0))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        check_world(layout, int(os.environ["WORLD_SIZE"]), config.plan)
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", config)
        return
    if layout.world_size == 1:
        rank_main(0, 1, f"tcp://127.0.0.1:{free_port()}", config)
        return
    spawn_ranks(rank_main, layout.world_size, config)


def check_precision(config: TrainConfig) -> None:
    """`--precision megatron-bf16` needs fp32 parameters (the master weights) and a device that computes in bf16."""
    if config.precision == "fp32":
        return
    if config.dtype != "float32":
        raise TrainError(f"--precision {config.precision} keeps fp32 master weights: use it with --dtype float32 "
                         f"(got --dtype {config.dtype})")
    if config.device == "cuda" and not torch.cuda.is_bf16_supported():
        raise TrainError(f"--precision {config.precision}: this GPU does not support bf16 "
                         f"(torch.cuda.is_bf16_supported() is False); use --precision fp32")


def main(argv: list[str] | None = None, probes: TrainProbes = NO_PROBES) -> None:
    """The torchrun entry: `python -m lynx.runtime.train --plan ...` (`probes`: tests only)."""
    try:
        launch(parse(argv, probes))
    except LynxError as e:
        print(f"lynx: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
