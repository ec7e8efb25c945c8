"""Held-out published runs: NVIDIA's DGX Cloud benchmarking recipes on H100 (BF16), measured vs predicted.

Nothing in lynx was fitted to these runs (the H100 kernel constants come from the Megatron-LM README table,
benchmarks/megatron_readme.py --fit); they are the issue's "published runs of other recipes held out", target
+-15% of the measured step time.

Source: NVIDIA/dgxc-benchmarking at commit 143b90dd (2025-05-21), each workload's README "Expected Performance"
tables (measured "Training step time (seconds per step)" on DGX H100 clusters, NeMo 24.09 / 24.11 containers)
and the run configuration of the same commit: the model YAML the recipe ships (`nemotron/nemotron4-15b-synth.yaml`,
`nemotron/nemotron4-340b-synth.yaml`, `nemo_megatron/gpt3_175b_hydra.yaml`, `llama3.1/llama3.1_8b.yaml`,
`llama3.1/llama3.1_405b.yaml`) with the overrides of its `configure.sh` (TP, PP, VP, MBS, GBS per scale, the
405B proxy layer counts, `model.ub_tp_comm_overlap=True` for Nemotron, `model.fp8=false` for BF16). The Llama
3.1 70B recipe of the same repository is checked by `benchmarks/cp_long_context.py --only published`.

Every run uses NeMo's `distributed_fused_adam` with `overlap_grad_sync` and `overlap_param_sync` (the YAMLs'
`optim` blocks), TransformerEngine with fused (flash) attention, Megatron-Core models (`mcore_gpt`). How lynx
is told each run, row by row, is in RUNS; what is assumed beyond the recipe is in ASSUMPTIONS.

The optimizer's buffers (docs/decisions/0086-dgxc-optimizer-as-yaml.md): every YAML sets `grad_sync_dtype: bf16` with
`contiguous_grad_buffer: true`, so Apex's DistributedFusedAdam keeps one full bf16 gradient buffer (2 bytes per
parameter, not Megatron-Core's fp32 main_grad); NeMo 24.09's `MegatronBaseModel.setup_optimization` (NeMo
v2.0.0) sets the optimizer dtype fp32 and, for a bf16 model, `store_params=False, store_param_remainders=True`:
the state sharded over DP x CP is Adam's m and v in fp32 (8) and the 16 low bits of each fp32 main weight (2),
10 bytes, not 12 (apex/contrib/optimizers/distributed_fused_adam.py, `StateBucket`, at NeMo's APEX_TAG 810ffae).

Run: PYTHONPATH=src python benchmarks/published_runs.py [--markdown] [--breakdown] [--megatron-buffers]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

import _results
from _markdown import Out
from rich.table import Table

from lynx.api import make_problem, plan
from lynx.breakdown import stage_memories
from lynx.models import load_model
from lynx.plan import Plan
from lynx.problem import PlanOptions
from lynx.spec import Hardware, ModelSpec, ParallelSpec, load_hardware

TARGET = 0.15
"""The issue's target for published runs the constants were not fitted to: +-15% of the measured step."""

G = 2**30

APEX_BF16_BYTES = 2.0 + 2.0 + 8.0 + 2.0
"""Bytes per parameter of NeMo's Apex DistributedFusedAdam as these YAMLs configure it, before sharding: bf16
parameters (2, the contiguous param buffer), bf16 gradients (2, `grad_sync_dtype: bf16`, contiguous grad buffer)
and, sharded over DP x CP, fp32 exp_avg and exp_avg_sq (8) and the int16 remainders of the fp32 main weights (2,
`store_param_remainders`). lynx --precision paper (2-byte parameters and gradients) --bytes-per-param 14."""

ASSUMPTIONS = (
    "NeMo's Apex DistributedFusedAdam as the YAMLs set it (`grad_sync_dtype: bf16`, contiguous grad and param "
    "buffers, NeMo's fp32 optimizer dtype with `store_param_remainders`): 2-byte parameters, 2-byte gradients "
    "reduced in bf16, 10 bytes of state sharded over DP x CP (lynx --precision paper --bytes-per-param 14); "
    "priced as a distributed optimizer (reduce-scatter of the gradients, all-gather of the parameters per "
    "bucket). Not modelled: NeMo's fp32 gradient for the word embedding (`with_fp32_embedding_grads`, default "
    "true: +2 bytes per embedding parameter on the first stage, 0.98 GiB for Llama 3.1 8B at TP 1, 0.49 GiB for "
    "405B at TP 8) and the reduce-scatter's 2-byte gradient shard, alive from the last backward to the next "
    "zero_grad (after the activation peak).",
    "Megatron's even split of the layers over PP x VP chunks, 1F1B (interleaved when VP > 1).",
    "The recipe's deferred embedding weight-gradient GEMM (`defer_embedding_wgrad_compute`) and p2p overlap "
    "are not modelled (lynx charges p2p as exposed).",
    "Nemotron-4 340B's optimizer as its YAML sets it (`grad_sync_dtype: bf16`, `dtype: bf16`, so NeMo stores "
    "no main weights): 2-byte gradients reduced in bf16 and 4 bytes of Adam state (lynx --precision paper "
    "--bytes-per-param 8).",
    "The loss as each YAML sets `cross_entropy_loss_fusion` (Llama 3.1 and Nemotron-4: true, lynx's fused loss; "
    "GPT-3 175B: unset, priced as Megatron-Core's default, off).",
    "GPT-3's vocabulary is GPT-2's 50,257 padded to a multiple of 128 x TP (Megatron's "
    "`make_vocab_size_divisible_by` 128 times TP 4): 50,688; the Llama and Nemotron vocabularies are the "
    "presets' (128,256 and 256,000, both already multiples of 128 x TP).",
)


@dataclass(frozen=True, slots=True)
class Run:
    recipe: str
    """Workload and container as the README's table names it."""
    model: str
    """lynx model preset."""
    tp: int
    pp: int
    cp: int
    vpp: int
    mbs: int
    seq: int
    gpus: int
    gbs: int
    step_s: float
    """Published measured training step time, seconds."""
    method: str = "none"
    """Recomputation as the recipe sets it: none, or Megatron's selective (`activations_checkpoint_granularity:
    selective`, which with TransformerEngine re-runs the fused attention)."""
    sp: bool = True
    tp_comm_overlap: bool = True
    layers: int | None = None
    """The recipe's layer count when it differs from the model's (the 405B proxy configurations)."""
    ce_fusion: bool = False
    """`cross_entropy_loss_fusion` as the recipe's YAML sets it (the Llama 3.1 and Nemotron-4 YAMLs: true; the
    GPT-3 175B YAML leaves it unset: Megatron-Core's default, off). lynx's field of the same name."""
    query_groups: int | None = None
    vocab: int | None = None
    dropout: bool = False
    precision: str = "paper"
    """lynx's name for the gradient dtype: paper (2-byte gradients, reduced in 2 bytes): every YAML here sets
    `grad_sync_dtype: bf16`."""
    bytes_per_param: float | None = APEX_BF16_BYTES
    """Static bytes per parameter before sharding (APEX_BF16_BYTES unless the recipe says otherwise)."""


def _l8(gpus: int, step: float) -> Run:
    # llama3.1/README_8b.md "Llama 3.1 8b 24.09 BF16 (TP=1, PP=1, CP=2, MBS=1, GA=32)"; llama3.1_8b.yaml:
    # sequence_parallel false, ub_tp_comm_overlap false, no recompute, seq 8192; GBS = 128 x GPUs / 8;
    # optim: distributed_fused_adam, grad_sync_dtype bf16, contiguous grad and param buffers (l. 140-157).
    # llama3.1_8b.yaml l. 86: cross_entropy_loss_fusion true.
    return Run("Llama 3.1 8B, NeMo 24.09", "llama3-8b", 1, 1, 2, 1, 1, 8192, gpus, 16 * gpus, step,
               sp=False, tp_comm_overlap=False, ce_fusion=True)


def _l405(gpus: int, layers: int, pp: int, vpp: int, gbs: int, step: float) -> Run:
    # llama3.1/README_405b.md "Llama 3.1 405b 24.09 BF16 (TP=8, PP=9, CP=2, VP=7, MBS=1, GA=63)" with its rows
    # "Layers", "GBS", "PP", "VP" per scale (proxy configurations below 576 GPUs); llama3.1_405b.yaml: SP,
    # ub_tp_comm_overlap true, no recompute, num_query_groups 16 (as the recipe runs, not the released model's 8);
    # optim: distributed_fused_adam, grad_sync_dtype bf16, contiguous grad and param buffers (l. 147-164).
    # llama3.1_405b.yaml l. 107: cross_entropy_loss_fusion true.
    return Run("Llama 3.1 405B, NeMo 24.09", "llama3.1-405b", 8, pp, 2, vpp, 1, 8192, gpus, gbs, step,
               layers=layers, query_groups=16, ce_fusion=True)


def _n15(gpus: int, step: float) -> Run:
    # nemotron/README_15b.md "Nemotron4 15b 24.11 BF16 (TP=4, PP=1, MBS=4, GA=4)"; configure.sh: GBS = 4 x GPUs,
    # SP, ub_tp_comm_overlap True; nemotron4-15b-synth.yaml: no recompute, seq 4096; optim:
    # distributed_fused_adam, grad_sync_dtype bf16, contiguous grad and param buffers (l. 176-193).
    # nemotron4-15b-synth.yaml l. 122: cross_entropy_loss_fusion true.
    return Run("Nemotron-4 15B, NeMo 24.11", "nemotron4-15b", 4, 1, 1, 1, 4, 4096, gpus, 4 * gpus, step,
               ce_fusion=True)


def _n340(gpus: int, step: float) -> Run:
    # nemotron/README_340b.md "Nemotron4 340b 24.11 BF16 (TP=8, PP=8, MBS=1, GA=16, VP=12)"; configure.sh: GBS =
    # 2 x nodes, SP, ub_tp_comm_overlap True; nemotron4-340b-synth.yaml: activations_checkpoint_granularity
    # selective.
    # Its optim block sets `grad_sync_dtype: bf16` and `dtype: bf16`: bf16 gradients reduced in bf16 and bf16
    # Adam state, so the parameters are the main weights: lynx's 2-byte-gradient recipe with 2 + 2 + 4 bytes.
    # nemotron4-340b-synth.yaml l. 216: cross_entropy_loss_fusion true.
    return Run("Nemotron-4 340B, NeMo 24.11", "nemotron4-340b", 8, 8, 1, 12, 1, 4096, gpus, gpus // 4, step,
               method="selective", precision="paper", bytes_per_param=8.0, ce_fusion=True)


def _g175(gpus: int, step: float) -> Run:
    # nemo_megatron/README_175b.md "NeMo Megatron 24.11 BF16 (TP=4,PP=8, MBS=1, VP=12, SEQ=2048)"; configure.sh:
    # GBS = 16 x nodes; gpt3_175b_hydra.yaml: SP, ub_tp_comm_overlap, no recompute, dropout 0.1; optim:
    # distributed_fused_adam, grad_sync_dtype bf16, contiguous grad and param buffers (l. 138-155).
    return Run("GPT-3 175B, NeMo 24.11", "gpt-175b", 4, 8, 1, 12, 1, 2048, gpus, 2 * gpus, step,
               vocab=50688, dropout=True)


RUNS: tuple[Run, ...] = (
    *(_l8(g, s) for g, s in ((8, 12.91), (16, 13.00), (32, 13.05), (64, 13.08), (128, 13.10))),
    _l405(32, 7, 1, 1, 126, 8.85), _l405(96, 21, 3, 7, 126, 8.75), _l405(192, 42, 3, 7, 252, 16.93),
    _l405(576, 126, 9, 7, 252, 17.20), _l405(1152, 126, 9, 7, 504, 17.52), _l405(2304, 126, 9, 7, 1008, 17.62),
    *(_n15(g, s) for g, s in ((16, 2.83), (32, 2.86), (64, 2.86), (128, 2.89), (256, 2.88), (512, 2.92),
                              (1024, 2.92), (2048, 2.96))),
    *(_n340(g, s) for g, s in ((128, 4.61), (256, 4.67), (512, 4.70), (1024, 4.73), (2048, 4.84))),
    *(_g175(g, s) for g, s in ((128, 8.91), (256, 8.95), (512, 9.09), (1024, 9.01), (2048, 9.02))),
)


def model_of(r: Run) -> ModelSpec:
    m = load_model(r.model)
    kw: dict[str, object] = {"attention": "flash", "dropout": r.dropout, "cross_entropy_loss_fusion": r.ce_fusion,
                             "max_position_embeddings": max(m.max_position_embeddings, r.seq)}
    if r.layers is not None:
        kw["num_layers"] = r.layers
    if r.query_groups is not None:
        kw["num_query_groups"] = r.query_groups
    if r.vocab is not None:
        kw["vocab_size"] = r.vocab
    return replace(m, **kw)  # type: ignore[arg-type]


def parallel_of(r: Run) -> ParallelSpec:
    dp = r.gpus // (r.tp * r.pp * r.cp)
    return ParallelSpec(tp=r.tp, pp=r.pp, dp=dp, cp=r.cp, sequence_parallel=r.sp, micro_batch_size=r.mbs,
                        global_batch_size=r.gbs, seq_length=r.seq)


def megatron_buffers(r: Run) -> Run:
    """The run priced as fit4 (decision 0081) did: Megatron-Core's distributed optimizer buffers (fp32 main_grad,
    12 bytes of sharded state) for every recipe but Nemotron-4 340B. For the before/after of mem5."""
    if r.bytes_per_param != APEX_BF16_BYTES:
        return r
    return replace(r, precision="megatron-bf16", bytes_per_param=None)


def plan_of(r: Run, hw: Hardware) -> Plan:
    """lynx's evaluated plan of the run as the recipe sets it."""
    opts = PlanOptions(precision=r.precision, bytes_per_param=r.bytes_per_param,  # type: ignore[arg-type]
                       distributed_optimizer=True,
                       nodes=-(-r.gpus // hw.devices_per_node), vpp=r.vpp, overlap_grad_reduce=True,
                       overlap_param_gather=True, tp_comm_overlap=r.tp_comm_overlap and r.tp > 1,
                       budget_bytes=hw.device.memory_bytes)
    return plan(make_problem(model_of(r), hw, parallel_of(r), opts), r.method, record=False)


def predicted(r: Run, hw: Hardware) -> tuple[float, float]:
    """(iteration s, the largest stage peak in GiB) of lynx's prediction of the run as the recipe sets it."""
    p = plan_of(r, hw)
    return p.sim.iteration_time_s, max(st.peak_memory_bytes for st in p.sim.stages) / 2**30


def errors(hw: Hardware, as_megatron: bool = False) -> list[tuple[Run, float, float]]:
    """(run, predicted step s, peak GiB) for every run (`as_megatron`: priced with Megatron-Core's buffers)."""
    return [(r, *predicted(megatron_buffers(r) if as_megatron else r, hw)) for r in RUNS]


def megatron_activation_estimate(r: Run) -> float:
    """Bytes of activations on the first stage by Megatron-LM's own estimator, re-derived (not copied) from
    megatron/training/theoretical_memory_usage.py (`compute_activation_memory`, Korthikanti et al. 2022 Table 2,
    when SP is on; `compute_activation_memory_without_sp` otherwise), a cross-check of lynx's count. Two
    deviations, both in the estimator's favour: it is given s / CP tokens (it ignores context parallelism), and
    the SP formula is used whenever the run has SP (the estimator takes it only with selective recomputation,
    else the no-SP formula, whose 10 sbh are not divided by TP). It knows neither GQA nor a gated MLP
    (per layer 18 + 4 ffn / h bytes per token and hidden unit)."""
    m = model_of(r)
    s, b, h, t, pp = r.seq // r.cp, r.mbs, m.hidden_size, r.tp, r.pp
    sbh = s * b * h
    if r.sp and t > 1:
        act = sbh * (18 + 4 * m.ffn_hidden_size / h) * m.num_layers
    else:
        act = sbh * (10 + 24 / t) * m.num_layers * t  # divided by t below, like the SP branch
    act += 8 * s * b * pp + sbh * pp  # embedding input and dropout, pp micro-batches in flight
    if r.vpp > 1:
        act *= 1 + (pp - 1) / (pp * r.vpp)  # the interleaved schedule's penalty
    if pp == 1:  # output layer and loss: the SP branch counts 4 sbh (1 + v / h), the other 2 (s b v / t + s b h)
        act += (4 * sbh * (1 + m.vocab_size / h) if r.sp and t > 1
                else 2 * (s * b * m.vocab_size / t + sbh) * t)
    act /= t
    return act if r.sp and t > 1 else act * 1.05  # the no-SP formula adds 5% for temporaries


@dataclass(frozen=True, slots=True)
class PeakRow:
    """The stage with the largest simulated peak, split into lynx's terms (GiB)."""

    run: Run
    stage: int
    chunk_microbatches: float
    """Micro-batch chunks whose activations the stage holds at its peak (interleaved: Megatron's warm-up
    2 (PP - 1 - stage) + (VP - 1) PP plus the steady state's forward, for stage 0)."""
    chunk_gib: float
    """Activations one micro-batch leaves on one chunk of the stage."""
    terms: dict[str, float]
    closed_form: float
    simulated: float
    megatron_activations: float
    """Megatron's estimator for the same stage's activations (`megatron_activation_estimate`), GiB."""


def peak_breakdown(r: Run, hw: Hardware) -> PeakRow:
    """The peak stage of the run and its memory terms (`lynx.breakdown`, what `lynx memory` prints)."""
    p = plan_of(r, hw)
    mems = stage_memories(p)
    sm = max(mems, key=lambda m: m.simulated_peak_bytes or m.peak)
    chunks = max(1, r.vpp)
    per_chunk = sm.act.per_microbatch / chunks
    return PeakRow(r, sm.stage, sm.act.held / per_chunk if per_chunk else 0.0, per_chunk / G,
                   {k: v / G for k, v in sm.terms().items()}, sm.peak / G, (sm.simulated_peak_bytes or 0.0) / G,
                   megatron_activation_estimate(r) / G)



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hardware", default="h100-80g-nvlink")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--breakdown", action="store_true",
                    help="also print each run's peak stage split into parameters, gradients, optimizer state, "
                         "activations, windows, transient and logits")
    ap.add_argument("--megatron-buffers", action="store_true",
                    help="price the optimizer as fit4 (decision 0081) did: Megatron-Core's fp32 main_grad and 12 "
                         "bytes of state instead of the YAMLs' Apex DistributedFusedAdam (the 'before' of mem5)")
    _results.add_option(ap, "published_runs")
    a = ap.parse_args()
    run = _results.Run()
    out = Out(a.markdown)
    hw = load_hardware(a.hardware)
    t0 = time.perf_counter()
    rows = errors(hw, a.megatron_buffers)
    figures: list[_results.Figure] = []
    t = Table(title=f"Held out: NVIDIA DGX Cloud benchmarking recipes (H100, BF16) vs lynx on {hw.name}"
                    + (" (Megatron-Core buffers, as fit4)" if a.megatron_buffers else ""))
    for c in ("recipe", "TP", "PP", "CP", "VP", "MBS", "seq", "GPUs", "GBS", "recompute", "published step s",
              "lynx step s", "peak GiB", "fits", "error", "target", "holds"):
        t.add_column(c, justify="left" if c in ("recipe", "recompute") else "right")
    held, worst = 0, 0.0
    for r, pred, peak in rows:
        err = pred / r.step_s - 1
        ok = abs(err) <= TARGET
        held += ok
        worst = max(worst, abs(err))
        t.add_row(r.recipe + (f" ({r.layers} layers)" if r.layers else ""), str(r.tp), str(r.pp), str(r.cp),
                  str(r.vpp), str(r.mbs), str(r.seq), str(r.gpus), str(r.gbs), r.method, f"{r.step_s:.2f}",
                  f"{pred:.2f}", f"{peak:.1f}", "yes" if peak * 2**30 <= hw.device.usable_bytes else "NO",
                  f"{100 * err:+.1f}%", f"±{100 * TARGET:.0f}%",
                  "yes" if ok else "NO")
        figures.append(_results.Figure(
            f"{r.recipe}{f' ({r.layers} layers)' if r.layers else ''}, {r.gpus} GPUs step", round(pred, 2), "s",
            f"published ± {TARGET:.0%}", ok, r.step_s))
    out.print(t)
    fits = sum(peak * 2**30 <= hw.device.usable_bytes for _, _, peak in rows)
    out.print(f"fits: lynx's peak within the usable {hw.device.usable_bytes / 2**30:.1f} GiB (capacity less "
              f"reserve and fragmentation); every run ran on 80 GB H100s, so a NO is a memory over-estimate: "
              f"{fits} of {len(rows)} fit.")
    out.print(f"{held} of {len(rows)} runs within ±{100 * TARGET:.0f}%; worst |error| {100 * worst:.1f}%; "
              f"{time.perf_counter() - t0:.1f} s")
    figures.append(_results.Figure("runs whose predicted peak fits the usable memory (all ran on 80 GB H100s)", fits,
                                   f"of {len(rows)}", f"= {len(rows)}", fits == len(rows)))
    mean_abs = sum(abs(pred / r.step_s - 1) for r, pred, _ in rows) / len(rows)
    figures.append(_results.Figure("mean |error| of the step times", round(100 * mean_abs, 1), "%"))
    run.write(a.results, "published_runs", "prediction", "NVIDIA's DGX Cloud benchmarking runs on H100 (held out): "
              "published step time vs lynx's prediction", figures)
    if a.breakdown:
        usable = hw.device.usable_bytes / G
        b = Table(title=f"Peak stage of each run, GiB (usable {usable:.1f}, card {hw.device.memory_bytes / G:.1f})")
        for c in ("run", "GPUs", "stage", "chunk micro-batches", "GiB per chunk", "parameters", "gradients",
                  "optimizer state", "activations", "fwd windows", "transient", "embedding / logits",
                  "closed form", "simulated", "fits", "Megatron est. activations + logits"):
            b.add_column(c, justify="left" if c == "run" else "right")
        for r in RUNS:
            pk = peak_breakdown(megatron_buffers(r) if a.megatron_buffers else r, hw)
            b.add_row(r.recipe + (f" ({r.layers} layers)" if r.layers else ""), str(r.gpus), str(pk.stage),
                      f"{pk.chunk_microbatches:.0f}", f"{pk.chunk_gib:.3f}",
                      *(f"{v:.2f}" for v in pk.terms.values()), f"{pk.closed_form:.2f}", f"{pk.simulated:.2f}",
                      "yes" if pk.simulated <= usable else "NO", f"{pk.megatron_activations:.2f}")
        out.print(b)
    if a.markdown:
        out.print("Assumptions beyond the recipes:\n\n" + "\n".join(f"- {x}" for x in ASSUMPTIONS))


if __name__ == "__main__":
    main()
