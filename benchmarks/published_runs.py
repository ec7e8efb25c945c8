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
3.1 70B recipe of the same repository is section 17's (benchmarks/cp_long_context.py --only published).

Every run uses NeMo's `distributed_fused_adam` with `overlap_grad_sync` and `overlap_param_sync` (the YAMLs'
`optim` blocks), TransformerEngine with fused (flash) attention, Megatron-Core models (`mcore_gpt`). How lynx
is told each run, row by row, is in RUNS; what is assumed beyond the recipe is in ASSUMPTIONS.

Run: PYTHONPATH=src python benchmarks/published_runs.py [--markdown]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

from _markdown import Out
from rich.table import Table

from lynx.api import make_problem, plan
from lynx.problem import PlanOptions
from lynx.spec import Hardware, ModelSpec, ParallelSpec, load_hardware, load_model

TARGET = 0.15
"""The issue's target for published runs the constants were not fitted to: +-15% of the measured step."""

ASSUMPTIONS = (
    "Megatron-Core's bf16 recipe for the optimizer (lynx --precision megatron-bf16: fp32 main parameters and "
    "gradients, gradients reduced in fp32) with the distributed optimizer; NeMo's Apex DistributedFusedAdam is "
    "priced as Megatron-Core's distributed optimizer (both reduce-scatter the gradients and all-gather the "
    "parameters per bucket).",
    "Megatron's even split of the layers over PP x VP chunks, 1F1B (interleaved when VP > 1).",
    "The recipe's deferred embedding weight-gradient GEMM (`defer_embedding_wgrad_compute`) and p2p overlap "
    "are not modelled (lynx charges p2p as exposed).",
    "Nemotron-4 340B's optimizer as its YAML sets it (`grad_sync_dtype: bf16`, `dtype: bf16`): 2-byte "
    "gradients reduced in bf16 and 4 bytes of Adam state (lynx --precision paper --bytes-per-param 8).",
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
    query_groups: int | None = None
    vocab: int | None = None
    dropout: bool = False
    precision: str = "megatron-bf16"
    """lynx's name for the optimizer's dtypes: megatron-bf16 (fp32 gradients reduced in fp32, fp32 Adam state;
    NeMo's default `grad_sync_dtype` = `dtype` = fp32) unless the recipe says otherwise."""
    bytes_per_param: float | None = None


def _l8(gpus: int, step: float) -> Run:
    # llama3.1/README_8b.md "Llama 3.1 8b 24.09 BF16 (TP=1, PP=1, CP=2, MBS=1, GA=32)"; llama3.1_8b.yaml:
    # sequence_parallel false, ub_tp_comm_overlap false, no recompute, seq 8192; GBS = 128 x GPUs / 8.
    return Run("Llama 3.1 8B, NeMo 24.09", "llama3-8b", 1, 1, 2, 1, 1, 8192, gpus, 16 * gpus, step,
               sp=False, tp_comm_overlap=False)


def _l405(gpus: int, layers: int, pp: int, vpp: int, gbs: int, step: float) -> Run:
    # llama3.1/README_405b.md "Llama 3.1 405b 24.09 BF16 (TP=8, PP=9, CP=2, VP=7, MBS=1, GA=63)" with its rows
    # "Layers", "GBS", "PP", "VP" per scale (proxy configurations below 576 GPUs); llama3.1_405b.yaml: SP,
    # ub_tp_comm_overlap true, no recompute, num_query_groups 16 (as the recipe runs, not the released model's 8).
    return Run("Llama 3.1 405B, NeMo 24.09", "llama3.1-405b", 8, pp, 2, vpp, 1, 8192, gpus, gbs, step,
               layers=layers, query_groups=16)


def _n15(gpus: int, step: float) -> Run:
    # nemotron/README_15b.md "Nemotron4 15b 24.11 BF16 (TP=4, PP=1, MBS=4, GA=4)"; configure.sh: GBS = 4 x GPUs,
    # SP, ub_tp_comm_overlap True; nemotron4-15b-synth.yaml: no recompute, seq 4096.
    return Run("Nemotron-4 15B, NeMo 24.11", "nemotron4-15b", 4, 1, 1, 1, 4, 4096, gpus, 4 * gpus, step)


def _n340(gpus: int, step: float) -> Run:
    # nemotron/README_340b.md "Nemotron4 340b 24.11 BF16 (TP=8, PP=8, MBS=1, GA=16, VP=12)"; configure.sh: GBS =
    # 2 x nodes, SP, ub_tp_comm_overlap True; nemotron4-340b-synth.yaml: activations_checkpoint_granularity
    # selective.
    # Its optim block sets `grad_sync_dtype: bf16` and `dtype: bf16`: bf16 gradients reduced in bf16 and bf16
    # Adam state, so the parameters are the main weights: lynx's 2-byte-gradient recipe with 2 + 2 + 4 bytes.
    return Run("Nemotron-4 340B, NeMo 24.11", "nemotron4-340b", 8, 8, 1, 12, 1, 4096, gpus, gpus // 4, step,
               method="selective", precision="paper", bytes_per_param=8.0)


def _g175(gpus: int, step: float) -> Run:
    # nemo_megatron/README_175b.md "NeMo Megatron 24.11 BF16 (TP=4,PP=8, MBS=1, VP=12, SEQ=2048)"; configure.sh:
    # GBS = 16 x nodes; gpt3_175b_hydra.yaml: SP, ub_tp_comm_overlap, no recompute, dropout 0.1.
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
    kw: dict[str, object] = {"attention": "flash", "dropout": r.dropout,
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


def predicted(r: Run, hw: Hardware) -> tuple[float, float]:
    """(iteration s, the largest stage peak in GiB) of lynx's prediction of the run as the recipe sets it."""
    opts = PlanOptions(precision=r.precision, bytes_per_param=r.bytes_per_param,  # type: ignore[arg-type]
                       distributed_optimizer=True,
                       nodes=-(-r.gpus // hw.devices_per_node), vpp=r.vpp, overlap_grad_reduce=True,
                       overlap_param_gather=True, tp_comm_overlap=r.tp_comm_overlap and r.tp > 1,
                       budget_bytes=hw.device.memory_bytes)
    p = plan(make_problem(model_of(r), hw, parallel_of(r), opts), r.method, record=False)
    return p.sim.iteration_time_s, max(st.peak_memory_bytes for st in p.sim.stages) / 2**30


def errors(hw: Hardware) -> list[tuple[Run, float, float]]:
    """(run, predicted step s, peak GiB) for every run."""
    return [(r, *predicted(r, hw)) for r in RUNS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hardware", default="h100-80g-nvlink")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    out = Out(a.markdown)
    hw = load_hardware(a.hardware)
    t0 = time.perf_counter()
    rows = errors(hw)
    t = Table(title=f"Held out: NVIDIA DGX Cloud benchmarking recipes (H100, BF16) vs lynx on {hw.name}")
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
    out.print(t)
    fits = sum(peak * 2**30 <= hw.device.usable_bytes for _, _, peak in rows)
    out.print(f"fits: lynx's peak within the usable {hw.device.usable_bytes / 2**30:.1f} GiB (capacity less "
              f"reserve and fragmentation); every run ran on 80 GB H100s, so a NO is a memory over-estimate: "
              f"{fits} of {len(rows)} fit.")
    out.print(f"{held} of {len(rows)} runs within ±{100 * TARGET:.0f}%; worst |error| {100 * worst:.1f}%; "
              f"{time.perf_counter() - t0:.1f} s")
    if a.markdown:
        out.print("Assumptions beyond the recipes:\n\n" + "\n".join(f"- {x}" for x in ASSUMPTIONS))


if __name__ == "__main__":
    main()
