"""`lynx train` for plans with PP > 1 or DP > 1: TP x PP x DP on torch.distributed, launched by torchrun
(one process per rank) or spawned locally; `lynx.runtime.train` dispatches here.

The layout is checked against the world size before any process group exists. Per iteration: AdamW step,
time per rank, loss, and per stage the activation bytes held (peak) and the seconds and op counts of
recomputation per place (forward windows, backward windows, cool-down stalls, on demand); the report
compares peaks with the plan's prediction. `--trace FILE` writes the last iteration's timeline as a
Chrome trace; `--compare-trace` then prints it beside the simulator's (`lynx.runtime.trace`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lynx.errors import PlanFormatError
from lynx.plan import load_plan
from lynx.policy.base import validate_layer_policy
from lynx.runtime import trace as trace_mod
from lynx.runtime.cpu_alloc import keep_freed_memory
from lynx.runtime.launch import default_backend, rank_failure, rendezvous_deadline, resolve_backend
from lynx.runtime.layers import tp as tp_mod
from lynx.runtime.layers.gpt import LayerConfig, op_names_for
from lynx.runtime.layers.gpt_model import synthetic_batch
from lynx.runtime.pipeline import LayoutError, PipelineLayout, PipelineRunner, check_world, make_groups
from lynx.runtime.pipeline import actions as act
from lynx.runtime.predict import predicted_activation_bytes, runtime_graph


def is_pipeline_plan(path: str) -> bool:
    """PP > 1 or DP > 1 (read without validating: load_plan reports a bad file)."""
    try:
        par = json.loads(Path(path).read_text()).get("parallel", {})
        return int(par.get("pp", 1)) > 1 or int(par.get("dp", 1)) > 1
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def plan_layout(plan_path: str, dtype: torch.dtype, core_attn: bool) -> tuple[Any, PipelineLayout, LayerConfig]:
    problem, result = load_plan(plan_path)
    raw = json.loads(Path(plan_path).read_text())
    par, model = problem.parallel, problem.model
    # vpp: issue 9's plans carry options.vpp and partition.chunks; older ones may carry a top-level vpp
    vpp = int(getattr(problem.options, "vpp", 0) or raw.get("parallel", {}).get("vpp", raw.get("vpp", 1)))
    cfg = LayerConfig(
        hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size, seq_length=par.seq_length, micro_batch_size=par.micro_batch_size,
        tp=par.tp, sequence_parallel=par.sequence_parallel, dropout_p=0.1 if model.dropout else 0.0,
        dtype=dtype, core_attn=core_attn, num_layers=model.num_layers,
    )
    if op_names_for(cfg) != problem.graph.names:
        raise PlanFormatError(f"{plan_path}: the plan's layer ops ({', '.join(problem.graph.names)}) are not "
                              f"this runtime layer's ({', '.join(op_names_for(cfg))}); check --core-attn")
    try:
        virtual = tuple(getattr(result.partition, "chunks", ()) or result.partition.layers_per_stage)
        layout = PipelineLayout(tp=par.tp, pp=par.pp, dp=par.dp, vpp=vpp, layers_per_stage=virtual,
                                policies=_chunk_policies(tuple(result.policies), virtual, par.pp, vpp),
                                num_microbatches=par.num_microbatches)
    except LayoutError as e:
        raise PlanFormatError(f"{plan_path}: {e}") from None
    for s, pol in enumerate(result.policies):
        for i, lp in enumerate(pol.layers):
            errs = validate_layer_policy(problem.graph, lp, has_fwd_windows=True)
            if errs:
                raise PlanFormatError(f"{plan_path}: stage {s} layer {i}: " + "; ".join(errs))
    return problem, layout, cfg


def _chunk_policies(pols: tuple[Any, ...], virtual: tuple[int, ...], pp: int, vpp: int) -> tuple[Any, ...]:
    """One policy per virtual stage. A plan with one policy per rank (issue 9's format: the rank's layers,
    chunk 0 first) is split into its chunks; one per virtual stage is taken as is."""
    if vpp == 1 or len(pols) != pp or len(virtual) != pp * vpp:
        return pols
    from dataclasses import replace

    out: list[Any] = [None] * (pp * vpp)
    for r, pol in enumerate(pols):
        first = 0
        for c in range(vpp):
            k = virtual[c * pp + r]
            out[c * pp + r] = replace(pol, layers=pol.layers[first:first + k])
            first += k
        if first != len(pol.layers):
            raise LayoutError(f"rank {r}: its chunks hold {first} layers, its policy {len(pol.layers)}")
    return tuple(out)


def action_rows(args: argparse.Namespace, layout: PipelineLayout) -> act.Rows:
    if getattr(args, "schedule", None):
        return act.read_csv(args.schedule)
    return act.schedule_rows(layout.pp, layout.vpp, layout.num_microbatches)


def _batches(args: argparse.Namespace, cfg: LayerConfig, vocab: int, m: int, it: int, dp_rank: int,
             dp: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if args.data:
        from lynx.runtime.train import _text_batches

        raw = _text_batches(args.data, vocab, cfg, m, it * dp + dp_rank, args.seed)
        return [(a.to(device), b.to(device)) for a, b in raw]
    return [synthetic_batch(vocab, cfg.micro_batch_size, cfg.seq_length, (it * dp + dp_rank) * m + j, args.seed,
                            device) for j in range(m)]


def _inject_fault(args: argparse.Namespace, runner: PipelineRunner, rank: int, it: int) -> None:
    """Tests: in iteration --die-at (--freeze-at), rank --die-rank exits (stops answering) in the middle of
    its second forward, after its first micro-batch went downstream."""
    die = args.die_at is not None and it == args.die_at
    freeze = getattr(args, "freeze_at", None) is not None and it == args.freeze_at
    if rank != args.die_rank or not (die or freeze):
        return
    orig = runner._before_forward

    def faulty(stage: int, mb: int) -> None:
        if mb == 1:
            if die:
                os._exit(17)
            time.sleep(10 ** 6)
        orig(stage, mb)

    runner._before_forward = faulty  # type: ignore[method-assign]
    runner.schedule_hooks.before_forward = faulty


def _stage_record(runner: PipelineRunner) -> dict[str, Any]:
    out = {}
    for s, mod in runner.modules.items():
        st = mod.engine.stats if mod.engine is not None else None
        out[str(s)] = {} if st is None else {
            "act_peak_bytes": st.peak_bytes, "act_after_fwd_bytes": max(st.fwd_end_bytes, default=0),
            "window_s": st.window_s, "cooldown_s": st.cooldown_s, "ondemand_s": st.ondemand_s,
            "restored": dict(st.by_window)}
    return out


def run(args: argparse.Namespace, rank: int, world: int) -> dict[str, Any] | None:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    problem, layout, cfg = plan_layout(args.plan, dtype, args.core_attn)
    rows = action_rows(args, layout)
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if args.device == "cuda" else torch.device("cpu")
    groups = make_groups(layout, rank)
    runner = PipelineRunner(layout, rows, cfg, problem.model.vocab_size, rank, groups, device, args.seed,
                            timeout_s=args.timeout, host_staged=host_staged(args))
    opt = torch.optim.AdamW(runner.parameters(), lr=args.lr)
    _, dp_rank, _ = layout.coords(rank)
    records: list[dict[str, Any]] = []
    events: list[trace_mod.Event] = []
    total = args.warmup + args.iters
    for it in range(total):
        _inject_fault(args, runner, rank, it)
        for mod in runner.modules.values():
            if mod.engine is not None:
                mod.engine.stats.reset()
        batches = _batches(args, cfg, problem.model.vocab_size, layout.num_microbatches, it, dp_rank, layout.dp,
                           device)
        last = it == total - 1
        runner.tracing, runner.events = last and bool(args.trace), []
        tp_mod.set_collective_tracer(
            (lambda k, a, b, c: (runner._event("collective", f"{k} window", a, b),
                                 runner._event("collective", f"wait {k}", b, c)))
            if runner.tracing else None)
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        runner.step(batches)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if runner.tracing:
            events = [(c, n, a - t0, b - t0, st) for c, n, a, b, st in runner.events]
        rec = {"iter": it, "warmup": it < args.warmup, "time_s": dt,
               "loss": sum(runner.losses) / len(runner.losses) if runner.losses else None,
               "stages": _stage_record(runner)}
        if device.type == "cuda":
            rec["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        records.append(rec)
        if rank == 0 and not args.quiet:
            print(f"iter {it:3d}{' (warmup)' if it < args.warmup else '':9s} time {dt:7.3f} s (rank 0)", flush=True)
    tp_mod.set_collective_tracer(None)
    mine = {"rank": rank, "stages": sorted(runner.modules), "records": records, "events": events,
            "predicted": _predicted(problem, layout, cfg, runner, dtype)}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return _report(args, problem, layout, everyone) if rank == 0 else None


def _predicted(problem: Any, layout: PipelineLayout, cfg: LayerConfig, runner: PipelineRunner,
               dtype: torch.dtype) -> dict[str, Any]:
    g = runtime_graph(problem.graph, dtype) if problem.graph.meta.source == "analytic" else problem.graph
    out = {}
    for s, mod in runner.modules.items():
        if mod.spec.policy is None:
            continue
        after, peak = predicted_activation_bytes(g, mod.spec.policy, cfg, in_flight=runner.in_flight.get(s, 1))
        out[str(s)] = {"act_after_fwd_bytes": after, "act_peak_bytes": peak, "in_flight": runner.in_flight.get(s, 1)}
    return out


def _report(args: argparse.Namespace, problem: Any, layout: PipelineLayout, ranks: list[Any]) -> dict[str, Any]:
    n = len(ranks[0]["records"])
    iters = []
    for i in range(n):
        per = [r["records"][i] for r in ranks]
        losses = [p["loss"] for p in per if p["loss"] is not None]
        iters.append({"iter": i, "warmup": per[0]["warmup"], "time_s": max(p["time_s"] for p in per),
                      "time_s_per_rank": [p["time_s"] for p in per], "loss": sum(losses) / len(losses)})
    timed = [r for r in iters if not r["warmup"]] or iters
    stages: dict[str, Any] = {}
    for r in ranks:
        for s, pred in r["predicted"].items():
            recs = [rec["stages"][s] for rec in r["records"][-len(timed):]]
            meas = max((x.get("act_peak_bytes", 0) for x in recs), default=0)
            stages.setdefault(s, {"rank": r["rank"], "measured_act_peak_bytes": meas,
                                  "predicted_act_peak_bytes": pred["act_peak_bytes"],
                                  "measured_act_after_fwd_bytes": recs[-1].get("act_after_fwd_bytes", 0),
                                  "predicted_act_after_fwd_bytes": pred["act_after_fwd_bytes"],
                                  "in_flight": pred["in_flight"],
                                  "window_s": sum(x.get("window_s", 0.0) for x in recs) / len(recs),
                                  "cooldown_s": sum(x.get("cooldown_s", 0.0) for x in recs) / len(recs),
                                  "ondemand_s": sum(x.get("ondemand_s", 0.0) for x in recs) / len(recs),
                                  "restored": recs[-1].get("restored", {})})
    prediction = json.loads(Path(args.plan).read_text()).get("prediction", {})
    pred_t = prediction.get("iteration_time_s")
    cuda: dict[str, Any] = {}
    for r in ranks:  # on CUDA: the allocator's peak per rank against the plan's per-stage peak (static included)
        peaks = [rec.get("cuda_max_allocated_bytes") for rec in r["records"][-len(timed):]]
        if peaks and peaks[0] is not None:
            pp_rank, sim = layout.coords(r["rank"])[0], prediction.get("stages", [])
            cuda[str(r["rank"])] = {"max_allocated_bytes": max(peaks), "predicted_peak_memory_bytes":
                                    sim[pp_rank]["peak_memory_bytes"] if pp_rank < len(sim) else None}
    report = {"plan": str(args.plan), "tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "vpp": layout.vpp,
              "device": args.device, "backend": _backend(args),
              "p2p": "host memory" if host_staged(args) else "direct",
              "num_microbatches": layout.num_microbatches, "iterations": iters,
              "median_time_s": sorted(r["time_s"] for r in timed)[len(timed) // 2],
              "predicted_iteration_time_s": pred_t, "stages": dict(sorted(stages.items(), key=lambda kv: int(kv[0])))}
    if cuda:
        report["cuda_per_rank"] = cuda
    if args.trace:
        evs: list[dict[str, Any]] = []
        for r in ranks:
            evs += trace_mod.chrome_events(r["rank"], f"rank {r['rank']} (stages {r['stages']})", r["events"], 0.0)
        trace_mod.write_chrome(args.trace, evs, {"iteration_time_s": iters[-1]["time_s"],
                                                 "stages_of_rank": {str(r["rank"]): r["stages"] for r in ranks}})
    return report


def _finish(report: dict[str, Any] | None, args: argparse.Namespace) -> None:
    if report is None:
        return
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    if not args.quiet:
        print("losses " + " ".join(f"{it['loss']:.4f}" for it in report["iterations"]), flush=True)
        for s, st in report["stages"].items():
            print(f"stage {s}: act peak {st['measured_act_peak_bytes'] / 2**20:8.2f} MiB (predicted "
                  f"{st['predicted_act_peak_bytes'] / 2**20:8.2f}), recompute windows {st['window_s']:.4f} s "
                  f"(cool-down {st['cooldown_s']:.4f}) on demand {st['ondemand_s']:.4f} s", flush=True)
        print(f"median iteration {report['median_time_s']:.3f} s (the plan predicts "
              f"{report['predicted_iteration_time_s']:.4g} s on its hardware)", flush=True)
    if args.trace and getattr(args, "compare_trace", False):
        lines, _ = trace_mod.compare(args.plan, args.trace)
        print("\n".join(lines), flush=True)


def _backend(args: argparse.Namespace) -> str:
    b = getattr(args, "backend", "auto")  # resolved by `launch`
    return b if b != "auto" else default_backend(args.device)


def host_staged(args: argparse.Namespace) -> bool:
    """p2p through host memory: gloo on CUDA (gloo sends CPU tensors only), or forced by the hidden
    `--host-staged` (the CPU tests of that path)."""
    return (args.device == "cuda" and _backend(args) == "gloo") or bool(getattr(args, "host_staged", False))


def rank_main(rank: int, world: int, init_method: str, args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cpu":
        keep_freed_memory()  # page faults from re-allocation are not recomputation (cpu_alloc.py)
    phase = "rendezvous"
    try:
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        with rendezvous_deadline(rank, world, args.timeout):
            dist.init_process_group(_backend(args), init_method=init_method,
                                    rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
        phase = "training"
        _finish(run(args, rank, world), args)
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # as lynx.runtime.train: gloo's destructors can abort after a peer closed its sockets
    except KeyboardInterrupt:
        print(f"lynx train: rank {rank}/{world} interrupted", file=sys.stderr, flush=True)
        os._exit(130)
    except Exception as e:  # a dead or frozen peer, a cut link: one line, this rank and the cause
        print(rank_failure(e, rank, world, phase, args.timeout), file=sys.stderr, flush=True)
        os._exit(1)


def launch(args: argparse.Namespace) -> None:
    """Under torchrun (RANK set) this process is one rank; otherwise spawn the layout's ranks locally."""
    from lynx.runtime.train import TrainError, spawn_ranks

    if getattr(args, "compare_trace", False) and not args.trace:
        raise TrainError("--compare-trace needs --trace FILE (the measured timeline to compare)")
    for opt, path in (("--trace", args.trace), ("--out", args.out)):
        if path and not Path(path).resolve().parent.is_dir():
            raise TrainError(f"{opt} {path}: directory {Path(path).resolve().parent} does not exist")
    _, layout, _ = plan_layout(args.plan, torch.float32, args.core_attn)
    act.validate(action_rows(args, layout), layout.pp, layout.num_stages, layout.num_microbatches,
                 getattr(args, "schedule", None) or "action list")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size))
    args.backend = resolve_backend(args.device, getattr(args, "backend", "auto"), local,
                                   torch.cuda.device_count() if args.device == "cuda" else 0)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        check_world(layout, int(os.environ["WORLD_SIZE"]), args.plan)
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args)
        return
    spawn_ranks(rank_main, layout.world_size, args)
