"""The one report of `lynx train`, for every layout.

Each rank records per iteration its time and per stage what the engine held and restored (`IterRecord`);
rank 0 gathers every rank's `RankRecord` and `build` writes the JSON report:

- ``iterations``: per iteration the time (max over ranks, and per rank), the mean loss (with multi-token
  prediction, the main loss; ``mtp_losses`` each MTP depth's), and rank 0's
  recomputation (``restored_on_demand``, ``restored_in_window``, ``recompute_ondemand_s``,
  ``recompute_window_s``, ``act_peak_bytes``; per rank ``act_peak_bytes_per_rank``);
- ``stages``: per virtual stage the activation bytes held (peak, after forward) against the prediction
  (`lynx.runtime.predict`), the micro-batches in flight, seconds and counts of recomputation per place;
- ``measured_act_*`` / ``predicted_act_*``: stage 0's (the stage with the most micro-batches in flight);
- on CUDA ``cuda_per_rank``: the allocator's peak against the plan's per-stage peak (static included).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from lynx.paths import write_text
from lynx.runtime import trace as trace_mod
from lynx.runtime.launch import TrainError

if TYPE_CHECKING:
    from lynx.runtime.config import TrainConfig
    from lynx.runtime.pipeline import PipelineRunner
    from lynx.runtime.run_plan import RunPlan


@dataclass(frozen=True)
class StageRecord:
    act_peak_bytes: int
    act_after_fwd_bytes: int
    window_s: float
    cooldown_s: float
    ondemand_s: float
    restored: dict[str, int]
    """Ops restored per place (fwd_attn, fwd_mlp, bwd_mlp, bwd_attn, cooldown, fsdp_bwd, on_demand)."""
    offloaded_bytes: int = 0
    """Bytes the engine copied to the host (the policy's offloaded ops); 0 without offloading."""
    host_peak_bytes: int = 0
    restored_by_collective: dict[str, int] = field(default_factory=dict)
    """Ops restored inside each collective's window ("fwd dispatch_a2a", "bwd attn_allreduce", ...)."""


@dataclass(frozen=True)
class IterRecord:
    iter: int
    warmup: bool
    time_s: float
    loss: float | None
    """Mean over this rank's micro-batches (None off the last stage)."""
    stages: dict[int, StageRecord]
    cuda_max_allocated_bytes: int | None
    mtp_losses: tuple[float, ...] = ()
    """With multi-token prediction on this rank's last stage: each depth's loss, the mean over the micro-batches."""


@dataclass(frozen=True)
class StagePrediction:
    act_after_fwd_bytes: float
    act_peak_bytes: float
    in_flight: int
    offloaded_bytes: float = 0.0
    """Per micro-batch: what the planner's memory model says leaves the device (`predict.predicted_offloaded_bytes`)."""


@dataclass(frozen=True)
class RankRecord:
    rank: int
    stages: tuple[int, ...]
    records: tuple[IterRecord, ...]
    events: tuple[Any, ...]
    predicted: dict[int, StagePrediction]
    master_dtypes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """After the last step: the dtypes of this rank's parameters, gradients and AdamW state ("params",
    "grads", "optimizer"); fp32 under mixed precision (master weights)."""


def iter_record(it: int, warmup: bool, dt: float, runner: PipelineRunner, cuda: int | None) -> IterRecord:
    stages = {}
    for s, mod in runner.modules.items():
        st = mod.engine.stats if mod.engine is not None else None
        if st is None:
            continue
        stages[s] = StageRecord(st.peak_bytes, max(st.fwd_end_bytes, default=0), st.window_s, st.cooldown_s,
                                st.ondemand_s, dict(st.by_window), st.offloaded_bytes, st.host_peak_bytes,
                                dict(st.by_collective))
    loss = sum(runner.losses) / len(runner.losses) if runner.losses else None
    per_mb = next((list(m.mtp.losses) for m in runner.modules.values() if m.mtp is not None), [])
    mtp = tuple(sum(row[d] for row in per_mb) / len(per_mb) for d in range(len(per_mb[0]))) if per_mb else ()
    return IterRecord(it, warmup, dt, loss, stages, cuda, mtp)


def _iteration(i: int, ranks: list[RankRecord]) -> dict[str, Any]:
    per = [r.records[i] for r in ranks]
    losses = [p.loss for p in per if p.loss is not None]
    mtps = [p.mtp_losses for p in per if p.mtp_losses]
    mine = per[0].stages.values()  # rank 0's stages
    on_demand = sum(st.restored.get("on_demand", 0) for st in mine)
    return {"iter": i, "warmup": per[0].warmup, "time_s": max(p.time_s for p in per),
            "time_s_per_rank": [p.time_s for p in per], "loss": sum(losses) / len(losses),
            **({"mtp_losses": [sum(d) / len(d) for d in zip(*mtps, strict=True)]} if mtps else {}),
            "act_peak_bytes": sum(st.act_peak_bytes for st in mine),
            "act_peak_bytes_per_rank": [sum(st.act_peak_bytes for st in p.stages.values()) for p in per],
            "restored_on_demand": on_demand,
            "restored_in_window": sum(sum(st.restored.values()) for st in mine) - on_demand,
            "recompute_ondemand_s": sum(st.ondemand_s for st in mine),
            "recompute_window_s": sum(st.window_s + st.cooldown_s for st in mine)}


def _stages(ranks: list[RankRecord], timed: int, microbatches: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in ranks:
        for s, pred in r.predicted.items():
            recs = [rec.stages[s] for rec in r.records[-timed:]]
            n = len(recs)
            out.setdefault(str(s), {
                "rank": r.rank, "measured_act_peak_bytes": max(x.act_peak_bytes for x in recs),
                "predicted_act_peak_bytes": pred.act_peak_bytes,
                "measured_act_after_fwd_bytes": recs[-1].act_after_fwd_bytes,
                "predicted_act_after_fwd_bytes": pred.act_after_fwd_bytes, "in_flight": pred.in_flight,
                "window_s": sum(x.window_s for x in recs) / n, "cooldown_s": sum(x.cooldown_s for x in recs) / n,
                "ondemand_s": sum(x.ondemand_s for x in recs) / n, "restored": recs[-1].restored,
                "restored_by_collective": recs[-1].restored_by_collective,
                "offloaded_bytes": recs[-1].offloaded_bytes,
                "offloaded_bytes_per_microbatch": recs[-1].offloaded_bytes / max(1, microbatches),
                "predicted_offloaded_bytes_per_microbatch": pred.offloaded_bytes,
                "measured_host_peak_bytes": max(x.host_peak_bytes for x in recs)})
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def run_notes(rp: RunPlan) -> list[str]:
    """What this run trains differently from the plan's model, where it changes neither the time nor the memory
    the plan prices (said on every run, never silently)."""
    m = rp.problem.model
    notes = []
    if m.is_moe and m.moe_router_load_balancing_type != "none":
        notes.append(f"the plan's model has moe_router_load_balancing_type {m.moe_router_load_balancing_type}; the "
                     "runtime's router trains on the LM loss alone (no auxiliary load-balancing loss: it changes "
                     "neither the time nor the memory the plan prices)")
    return notes


def build(args: TrainConfig, rp: RunPlan, ranks: list[RankRecord], backend: str,
          host_staged: bool) -> dict[str, Any]:
    L = rp.layout
    iters = [_iteration(i, ranks) for i in range(len(ranks[0].records))]
    timed = [r for r in iters if not r["warmup"]] or iters
    stages = _stages(ranks, len(timed), rp.layout.num_microbatches)
    first = stages.get("0", {})
    report: dict[str, Any] = {
        "plan": str(args.plan), "method": rp.method, "family": rp.problem.model.family,
        "tp": L.tp, "pp": L.pp, "dp": L.dp, "vpp": L.vpp, "num_layers": sum(L.layers_per_stage),
        "num_microbatches": L.num_microbatches, "device": args.device, "dtype": args.dtype, "backend": backend,
        "precision": args.precision,
        "data_parallel": ("torch-fsdp2 (reshard after forward)" if rp.fsdp.reshard_after_forward
                          else "torch-fsdp2") if rp.fsdp is not None else "ddp",
        "master_dtypes": {k: sorted({d for r in ranks for d in r.master_dtypes.get(k, ())})
                          for k in ("params", "grads", "optimizer")},
        "p2p": "host memory" if host_staged else "direct",
        "config": {k: (str(v) if k == "dtype" else v) for k, v in asdict(rp.cfg).items()},
        "iterations": iters, "median_time_s": sorted(r["time_s"] for r in timed)[len(timed) // 2],
        "predicted_iteration_time_s": rp.predicted_time_s, "stages": stages, "notes": run_notes(rp),
        "measured_act_after_fwd_bytes": first.get("measured_act_after_fwd_bytes", 0),
        "predicted_act_after_fwd_bytes": first.get("predicted_act_after_fwd_bytes", 0.0),
        "measured_act_peak_bytes": first.get("measured_act_peak_bytes", 0),
        "predicted_act_peak_bytes": first.get("predicted_act_peak_bytes", 0.0),
    }
    cuda = _cuda(ranks, rp, L.coords, len(timed))
    if cuda:
        report["cuda_per_rank"] = cuda
    if args.trace:
        layout = {"tp": L.tp, "pp": L.pp, "dp": L.dp, "vpp": L.vpp, "num_microbatches": L.num_microbatches,
                  "layers_per_stage": list(L.layers_per_stage)}
        _write_trace(args.trace, ranks, iters[-1]["time_s"], layout)
    return report


def _cuda(ranks: list[RankRecord], rp: RunPlan, coords: Any, timed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in ranks:
        peaks = [rec.cuda_max_allocated_bytes for rec in r.records[-timed:] if rec.cuda_max_allocated_bytes]
        if peaks:
            pp_rank, sim = coords(r.rank)[0], rp.predicted_stage_peaks
            out[str(r.rank)] = {"max_allocated_bytes": max(peaks),
                                "predicted_peak_memory_bytes": sim[pp_rank] if pp_rank < len(sim) else None}
    return out


def _write_trace(path: str, ranks: list[RankRecord], iteration_s: float, layout: dict[str, Any]) -> None:
    """The Chrome trace, with the plan's layout in `otherData` so a comparison can refuse another plan's."""
    evs: list[dict[str, Any]] = []
    for r in ranks:
        evs += trace_mod.chrome_events(r.rank, f"rank {r.rank} (stages {list(r.stages)})", r.events, 0.0)
    trace_mod.write_chrome(path, evs, {"iteration_time_s": iteration_s, "layout": layout,
                                       "stages_of_rank": {str(r.rank): list(r.stages) for r in ranks}})


def finish(report: dict[str, Any] | None, args: TrainConfig) -> None:
    """Rank 0: write the report (--out), print the losses, each stage's peaks and the median iteration."""
    if report is None:
        return
    if args.out:
        write_text(args.out, json.dumps(report, indent=2), "--out", TrainError)
    if not args.quiet:
        print("losses " + " ".join(f"{it['loss']:.4f}" for it in report["iterations"]), flush=True)
        if any("mtp_losses" in it for it in report["iterations"]):  # Megatron's "mtp_1 loss", ...
            print("mtp losses " + " ".join("/".join(f"{v:.4f}" for v in it.get("mtp_losses", ()))
                                           for it in report["iterations"]), flush=True)
        for s, st in report["stages"].items():
            print(f"stage {s}: act peak {st['measured_act_peak_bytes'] / 2**20:8.2f} MiB (predicted "
                  f"{st['predicted_act_peak_bytes'] / 2**20:8.2f}), after forward "
                  f"{st['measured_act_after_fwd_bytes'] / 2**20:.2f} MiB (predicted "
                  f"{st['predicted_act_after_fwd_bytes'] / 2**20:.2f}), recompute windows {st['window_s']:.4f} s "
                  f"(cool-down {st['cooldown_s']:.4f}) on demand {st['ondemand_s']:.4f} s", flush=True)
            if st["restored_by_collective"]:  # which collective hosted how many restorations (last iteration)
                print(f"stage {s}: restored in windows " + ", ".join(
                    f"{k} {n}" for k, n in sorted(st["restored_by_collective"].items())), flush=True)
        for n in report["notes"]:
            print(f"note: {n}", flush=True)
        if report["precision"] != "fp32":  # docs/runtime.md, "Mixed precision" (docs/decisions/0225)
            print("note: the predictions are Megatron's bf16 model's; bf16 autocast over fp32 weights also holds "
                  "fp32 activations and bf16 casts of inputs and weights (--dtype bfloat16 runs the priced model)",
                  flush=True)
        print(f"median iteration {report['median_time_s']:.3f} s (the plan predicts "
              f"{report['predicted_iteration_time_s']:.4g} s on its hardware)", flush=True)
    if args.trace and args.compare_trace:
        lines, _ = trace_mod.compare(args.plan, args.trace)
        print("\n".join(lines), flush=True)
