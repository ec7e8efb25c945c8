"""Predicted vs published: the weak-scaling table of the Megatron-LM README (GPT 1.7B-462B on H100).

Source: NVIDIA/Megatron-LM README.md, section "Performance & Scaling" up to commit cde92b27ac (Aug 2025), table
`images/model_table.png` (Megatron-Core r0.8.0, H100 = DGX H100 nodes): vocabulary 131,072, sequence 4096,
bf16, and "fine-grained overlapping of data-parallel (--overlap-grad-reduce --overlap-param-gather),
tensor-parallel (--tp-comm-overlap) and pipeline-parallel communication (enabled by default)". Each row gives
heads, hidden size, layers, TP, PP, DP (48), GPUs, global batch and the achieved per-GPU TFLOP/s.

Published step time = model FLOPs of one iteration / (per-GPU TFLOP/s x GPUs), with Megatron's own FLOPs
count (megatron/training/training.py `num_floating_point_operations`: 72 B s L h^2 (1 + s/(6h)) + 6 B s h V,
the same as `lynx.cost.layer.model_flops_per_iteration` for these GPT models).

Assumptions (not in the table), each with its reason (docs/decisions/0089-readme-rows-documented-schedule.md):

* Untied embeddings: the rows' names are their parameter counts with a separate output layer (1.7B = 12 L h^2 +
  2 V h = 1.74e9; tied it would be 1.48e9; likewise 7.1B, 16B, 177B, 462B).
* PP > 1: micro-batch 1 and Megatron's interleaved 1F1B with 2 model chunks per stage where the layers per stage
  are even (Megatron needs them divisible by the chunks), 1F1B without interleaving where they are odd (119B's
  23 and 462B's 7 per stage). Not published. Without interleaving the held-out strong scaling at DP 96 (12
  micro-batches on 6 stages) is out of reach (+23%: the bubble). Two rules hold all nine rows: 2 chunks with a
  matmul asymptote of 0.76-0.78, and one layer per chunk (what NVIDIA's own H100 GPT-3 recipe runs) with
  0.68-0.72. Only runs the table does not contain separate them: at 0.76 NVIDIA's 29 held-out runs are centred
  (mean error +0.5%, mean |error| 3.8%), at 0.72 they lean slow (+4.8%, 5.1%) and at 0.68 five leave ±15%
  (--scan, --scan --interleave "1 layer per chunk", --candidates). So 2 chunks, and those held-out runs are
  not wholly held out any more.
  The README's "pipeline-parallel communication (enabled by default)" is the flag's default
  (`--no-overlap-p2p-communication`); at f2e5db402c it does nothing without interleaving (arguments.py).
* PP = 1: no gradient accumulation, micro-batch = global batch / DP (4 sequences; the stage fits, 45-56 GiB).
  Micro-batch 1 is ruled out by the 32B row itself: its 16 GB of fp32 gradients per GPU cross one NIC (0.37 s)
  behind only the last micro-batch's backward (~0.15 s; no_sync before it, schedules.py at f2e5db402c), so the
  published 0.892 s would leave the compute at most 0.67 s: 610 model TFLOP/s per GPU (62% of peak), a quarter
  above the table's best row (489). lynx at micro-batch 1: +38% (--pp1-micro-batch 1).
* No recomputation, sequence parallelism whenever TP > 1 (--tp-comm-overlap requires it), flash attention
  (TransformerEngine's fused attention, Megatron-Core's default with --transformer-impl transformer_engine), no
  dropout, GeLU MLP of 4h, learned position embeddings, the distributed optimizer with Megatron's bf16 recipe
  (fp32 gradients reduced in fp32), Megatron's even split of the layers.

Run: python benchmarks/megatron_readme.py [--markdown] [--no-overlaps] [--fit] [--scan] [--sensitivity] [--ablation]
     [--candidates] [--interleave RULE] [--pp1-micro-batch N]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import dataclass

import _results
from _markdown import Out
from rich.table import Table

from lynx.api import make_problem, plan
from lynx.cost.layer import model_flops_per_iteration
from lynx.problem import PlanOptions
from lynx.spec import Hardware, ModelSpec, ParallelSpec, load_hardware

TARGET = 0.10
"""The issue's target: every row within +-10% of the published step time."""
SEQ, VOCAB, DP = 4096, 131072, 48


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    global_batch: int
    tflops_per_gpu: float
    """Published achieved model TFLOP/s per GPU."""


ROWS = (
    Row("1.7B", 16, 2048, 24, 1, 1, 192, 408.8),
    Row("7.1B", 32, 4096, 30, 2, 1, 192, 465.9),
    Row("16B", 48, 6144, 32, 4, 1, 192, 489.1),
    Row("32B", 56, 7168, 48, 8, 1, 192, 459.6),
    Row("70B", 64, 8192, 84, 8, 2, 384, 419.7),
    Row("119B", 80, 10240, 92, 8, 4, 768, 420.5),
    Row("177B", 96, 12288, 96, 8, 6, 1152, 432.8),
    Row("314B", 128, 16384, 96, 8, 8, 1536, 474.4),
    Row("462B", 144, 18432, 112, 8, 16, 3072, 459.9),
)


HELD_OUT_TARGET = 0.15
"""The issue's target for published runs the constants were not fitted to."""
HELD_OUT = ((2, 0.47), (96, 0.42))
"""Not fitted (--fit does not read it; it informed the interleaving rule, module docstring): the README's strong
scaling of its 177B model (the 177B row's shape, TP 8, PP 6) at global batch 1152 "from 96 H100 GPUs to 4608
GPUs ... MFU from 47% to 42%" (DP 2 and DP 96; MFU as the README's text rounds it, so +-0.5 points, about +-1%
in time)."""


def held_out(hw: Hardware | None = None, micro_batch: int | None = None, vpp: int | None = None
             ) -> list[tuple[int, float, float, float]]:
    """(DP, published MFU, published step s, predicted step s) of the strong-scaling endpoints, under the
    177B row's schedule (`schedule_of`) unless a micro-batch / VP size is given."""
    hw = hw if hw is not None else load_hardware("h100-80g-nvlink")
    r = ROWS[6]
    mb0, vpp0 = schedule_of(r)
    micro_batch = mb0 if micro_batch is None else micro_batch
    vpp = vpp0 if vpp is None else vpp
    out = []
    for dp, mfu in HELD_OUT:
        par = ParallelSpec(tp=r.tp, pp=r.pp, dp=dp, sequence_parallel=True, micro_batch_size=micro_batch,
                           global_batch_size=1152, seq_length=SEQ)
        gpus = r.tp * r.pp * dp
        opts = PlanOptions(precision="megatron-bf16", distributed_optimizer=True, nodes=-(-gpus // hw.devices_per_node),
                           overlap_grad_reduce=True, overlap_param_gather=True, tp_comm_overlap=True,
                           budget_bytes=hw.device.memory_bytes, vpp=vpp)
        pred = plan(make_problem(model_of(r), hw, par, opts), "none", record=False).sim.iteration_time_s
        pub = model_flops_per_iteration(model_of(r), par) / (mfu * hw.device.peak_flops * gpus)
        out.append((dp, mfu, pub, pred))
    return out


def model_of(r: Row) -> ModelSpec:
    return ModelSpec(name=f"gpt-{r.name}", num_layers=r.layers, hidden_size=r.hidden, num_attention_heads=r.heads,
                     vocab_size=VOCAB, max_position_embeddings=SEQ, attention="flash", dropout=False,
                     tie_embeddings=False)


PP1_MICRO_BATCH: int | None = None
"""Micro-batch of the PP = 1 rows; None: the per-replica batch (no gradient accumulation), the documented rule."""
PP_INTERLEAVE = "2 chunks"
"""Interleaving rule of the PP > 1 rows (INTERLEAVE), the documented one."""


def schedule_of(r: Row, pp1_micro_batch: int | None = PP1_MICRO_BATCH, interleave: str = PP_INTERLEAVE
                ) -> tuple[int, int]:
    """(micro-batch, VP chunks per stage) a row is planned with: PP 1 without gradient accumulation (or the
    given micro-batch), PP > 1 at micro-batch 1 with the interleaving rule (module docstring)."""
    if r.pp == 1:
        return (r.global_batch // DP if pp1_micro_batch is None else pp1_micro_batch), 1
    return 1, vpp_of(r, interleave)


def parallel_of(r: Row, micro_batch: int = 1) -> ParallelSpec:
    return ParallelSpec(tp=r.tp, pp=r.pp, dp=DP, sequence_parallel=r.tp > 1, micro_batch_size=micro_batch,
                        global_batch_size=r.global_batch, seq_length=SEQ)


def published_step_s(r: Row) -> float:
    gpus = r.tp * r.pp * DP
    return model_flops_per_iteration(model_of(r), parallel_of(r)) / (r.tflops_per_gpu * 1e12 * gpus)


def predicted_step_s(r: Row, hw: Hardware, overlaps: bool = True) -> float:
    return predicted(r, hw, overlaps)[0]


def predicted(r: Row, hw: Hardware, overlaps: bool = True) -> tuple[float, float]:
    """(iteration, the part after the pipeline: exposed DP communication + optimizer step), seconds, under the
    documented schedule."""
    return _predicted(r, hw, overlaps, *schedule_of(r))[:2]


def _predicted(r: Row, hw: Hardware, overlaps: bool = True, micro_batch: int = 1, vpp: int = 1
               ) -> tuple[float, float, float]:
    """(iteration, after the pipeline, the largest stage peak in GiB)."""

    gpus = r.tp * r.pp * DP
    opts = PlanOptions(precision="megatron-bf16", distributed_optimizer=True, nodes=-(-gpus // hw.devices_per_node),
                       overlap_grad_reduce=overlaps, overlap_param_gather=overlaps,
                       tp_comm_overlap=overlaps and r.tp > 1, budget_bytes=hw.device.memory_bytes, vpp=vpp)
    par = parallel_of(r, micro_batch)
    p = plan(make_problem(model_of(r), hw, par, opts), "none", record=False)
    peak = max(st.peak_memory_bytes for st in p.sim.stages) / 2**30
    return p.sim.iteration_time_s, p.sim.iteration_time_s - p.sim.pipeline_time_s, peak


def sensitivity(hw: Hardware) -> Table:
    """The unpublished micro-batch: each row's error and exposed DP tail at micro-batch 1, 2 and 4 (where it
    divides the per-replica batch; PP > 1 rows with the documented interleaving), with the stage peak (GiB)."""
    t = Table(title="The README's micro-batch is not published: error (tail s, peak GiB) per micro-batch")
    for c in ("model", "TP", "PP", "micro-batches at 1", "micro-batch 1", "micro-batch 2", "micro-batch 4"):
        t.add_column(c, justify="left" if c == "model" else "right")
    for r in ROWS:
        per = r.global_batch // DP
        cells = []
        for mb in (1, 2, 4):
            if per % mb:
                cells.append("-")
                continue
            pred, tail, peak = _predicted(r, hw, True, mb, schedule_of(r)[1])
            cells.append(f"{100 * (pred / published_step_s(r) - 1):+.1f}% ({tail:.2f} s, {peak:.0f})")
        t.add_row(r.name, str(r.tp), str(r.pp), str(per), *cells)
    return t


INTERLEAVE = {"none": lambda lps: 1, "2 chunks": lambda lps: 2 if lps % 2 == 0 else 1,
              "1 layer per chunk": lambda lps: lps}
"""Candidate interleaving rules, each the same for every PP > 1 row (VP chunks per stage from the layers per
stage; Megatron needs the layers per stage divisible by VP, so 119B's 23 and 462B's 7 admit only 1 or all).
"1 layer per chunk" is what NVIDIA's own H100 recipes of GPT-3 175B and Nemotron-4 340B run (TP 4 / 8, PP 8,
VP 12 on 96 layers: dgxc-benchmarking 143b90dd, nemo_megatron/README_175b.md, nemotron/README_340b.md); "2 chunks"
is the documented assumption for the README rows (PP_INTERLEAVE, module docstring)."""
CANDIDATE_MATMUL = (0.8, 0.76, 0.72, 0.68)
CANDIDATE_MICRO_BATCH = ("1", "2", "per-replica at PP 1")
"""Micro-batch candidates: 1 or 2 for every row, or the documented rule (PP 1 rows without gradient
accumulation, PP > 1 rows at 1)."""


def candidates(hw: Hardware) -> Table:
    """Every (micro-batch, interleaving rule, matmul asymptote) candidate applied to all nine rows at once: the
    rows outside +-10%, the held-out checks (177B strong scaling, benchmarks/published_runs.py), and whether
    the largest stage fits the usable memory. Evidence for decisions 0082 and 0089-0091."""
    from dataclasses import replace

    import published_runs

    t = Table(title="One assumption for every row: README rows and the runs outside the table under each candidate")
    for c in ("matmul", "micro-batch", "interleaving", "README rows outside ±10%", "README errors",
              "largest peak GiB (usable)", "177B strong DP 2 / DP 96 (±15%)", "dgxc runs within ±15%"):
        t.add_column(c, justify="left" if c in ("interleaving", "README errors") else "right")
    for mm in CANDIDATE_MATMUL:
        h = replace(hw, device=replace(hw.device, matmul_efficiency=mm))
        pr = [pred / r.step_s - 1 for r, pred, _ in published_runs.errors(h)]
        dgxc = f"{sum(abs(e) <= published_runs.TARGET for e in pr)} of {len(pr)} ({100 * min(pr):+.1f}% .. " \
               f"{100 * max(pr):+.1f}%)"
        for mbc in CANDIDATE_MICRO_BATCH:
            for name in INTERLEAVE:
                errs, peaks = [], []
                for r in ROWS:
                    mb = (schedule_of(r, None, name)[0] if r.pp == 1 else 1) if mbc == CANDIDATE_MICRO_BATCH[2] \
                        else int(mbc)
                    pred, _, peak = _predicted(r, h, True, mb, vpp_of(r, name))
                    errs.append(pred / published_step_s(r) - 1)
                    peaks.append(peak)
                strong = held_out(h, 2 if mbc == "2" else 1, vpp_of(ROWS[6], name))
                t.add_row(f"{mm:.2f}", mbc, name, str(sum(abs(e) > TARGET for e in errs)),
                          " ".join(f"{100 * e:+.0f}" for e in errs),
                          f"{max(peaks):.0f} ({h.device.usable_bytes / 2**30:.0f})",
                          " / ".join(f"{100 * (p / q - 1):+.1f}%" for _, _, q, p in strong), dgxc)
    return t


def vpp_of(r: Row, interleave: str) -> int:
    """The row's VP chunks per stage under an INTERLEAVE rule (1 at PP 1)."""
    return INTERLEAVE[interleave](r.layers // r.pp) if r.pp > 1 else 1


def errors(hw: Hardware, overlaps: bool = True, interleave: str = PP_INTERLEAVE,
           pp1_micro_batch: int | None = PP1_MICRO_BATCH) -> list[tuple[Row, float, tuple[float, float]]]:
    return [(r, published_step_s(r), _predicted(r, hw, overlaps, *schedule_of(r, pp1_micro_batch, interleave))[:2])
            for r in ROWS]


FIT_GRID = {"matmul_efficiency": (0.7, 0.73, 0.75, 0.8), "gemm_half_dim": (128.0, 256.0, 384.0, 512.0),
            "memory_efficiency": (0.5, 0.7), "flash_fwd_efficiency": (0.55, 0.65)}
"""The grid --fit searches for the kernel constants (flash backward = 0.8 x forward)."""


def fit(hw: Hardware, interleave: str = PP_INTERLEAVE, pp1_micro_batch: int | None = PP1_MICRO_BATCH
        ) -> list[tuple[int, float, dict[str, float]]]:
    """Every point of FIT_GRID with (rows outside the target, RMS error), best first: most rows within
    +-10%, then the smallest RMS."""
    import itertools
    from dataclasses import replace

    out = []
    for vals in itertools.product(*FIT_GRID.values()):
        kw = dict(zip(FIT_GRID, vals, strict=True))
        dev = replace(hw.device, **kw, flash_bwd_efficiency=0.8 * kw["flash_fwd_efficiency"])
        errs = [pred / pub - 1 for _, pub, (pred, _) in
                errors(replace(hw, device=dev), True, interleave, pp1_micro_batch)]
        out.append((sum(abs(e) > TARGET for e in errs), (sum(e * e for e in errs) / len(errs)) ** 0.5, kw))
    return sorted(out, key=lambda x: (x[0], x[1]))


SCAN = tuple(round(0.68 + 0.01 * i, 2) for i in range(13))
"""The matmul asymptotes --scan tries, every other constant of the preset as it is."""


def scan(hw: Hardware, interleave: str = PP_INTERLEAVE, pp1_micro_batch: int | None = PP1_MICRO_BATCH) -> Table:
    """The H100 preset's one fitted constant that the README rows pin down, the matmul asymptote, over SCAN:
    the README rows (fitted) beside the held-out checks (the README's 177B strong scaling, NVIDIA's 29 dgxc
    runs), so the choice and what it does to runs it was not fitted to are read in one table."""
    from dataclasses import replace

    import published_runs

    t = Table(title="The matmul asymptote: README rows (fitted) and the runs outside the table")
    for c in ("matmul", "README rows outside ±10%", "worst README error", "README RMS",
              "177B strong DP 2 / DP 96 (±15%)", "dgxc runs within ±15%", "preset"):
        t.add_column(c, justify="right")
    for mm in SCAN:
        h = replace(hw, device=replace(hw.device, matmul_efficiency=mm))
        errs = [pred / pub - 1 for _, pub, (pred, _) in errors(h, True, interleave, pp1_micro_batch)]
        strong = held_out(h, *(None, None) if (interleave, pp1_micro_batch) == (PP_INTERLEAVE, PP1_MICRO_BATCH)
                          else (1, vpp_of(ROWS[6], interleave)))
        pr = [pred / r.step_s - 1 for r, pred, _ in published_runs.errors(h)]
        t.add_row(f"{mm:.2f}", str(sum(abs(e) > TARGET for e in errs)), f"{100 * max(errs, key=abs):+.1f}%",
                  f"{100 * (sum(e * e for e in errs) / len(errs)) ** 0.5:.1f}%",
                  " / ".join(f"{100 * (p / q - 1):+.1f}%" for _, _, q, p in strong),
                  f"{sum(abs(e) <= published_runs.TARGET for e in pr)} of {len(pr)} "
                  f"({100 * min(pr):+.1f}% .. {100 * max(pr):+.1f}%)",
                  "<-" if abs(mm - hw.device.matmul_efficiency) < 1e-9 else "")
    return t


def ablation(hw: Hardware) -> Table:
    """What each change of decisions 0089-0091 does to the rows, one step at a time from the model
    before it: micro-batch 1 without interleaving at the 0.80 asymptote (tied embeddings then too), then the
    documented schedule, interleaved stages reducing chunk by chunk, the gradient buffer's passes, the refit."""
    from dataclasses import replace
    from unittest import mock

    import lynx.simulate.metrics as metrics
    from lynx.cost.dp_overlap import DpSync

    def as_one_chunk(chunks: list[DpSync], og: bool, op: bool, bwd: list[float], fwd: list[float], pp: int,
                     rank: int) -> float:
        one = DpSync(sum(c.grad_s for c in chunks), max(c.grad_bucket_s for c in chunks),
                     sum(c.param_s for c in chunks), max(c.param_bucket_s for c in chunks))
        return one.exposed(og, op, sum(bwd), sum(fwd))

    old_hw = replace(hw, device=replace(hw.device, matmul_efficiency=0.80))
    no_passes = mock.patch.object(metrics, "grad_buffer_time", lambda *a, **k: 0.0)
    one_chunk = mock.patch.object(metrics, "interleaved_exposed", as_one_chunk)
    tied = mock.patch(__name__ + ".model_of", lambda r, f=model_of: replace(f(r), tie_embeddings=True))
    steps = (("before: micro-batch 1, no interleaving, tied, 0.80", old_hw, (1, "none"), (no_passes, one_chunk, tied)),
             ("+ untied embeddings", old_hw, (1, "none"), (no_passes, one_chunk)),
             ("+ the documented schedule", old_hw, (None, PP_INTERLEAVE), (no_passes, one_chunk)),
             ("+ interleaved stages reduce chunk by chunk", old_hw, (None, PP_INTERLEAVE), (no_passes,)),
             ("+ the gradient buffer's passes", old_hw, (None, PP_INTERLEAVE), ()),
             (f"+ matmul asymptote {hw.device.matmul_efficiency:.2f} (the preset)", hw, (None, PP_INTERLEAVE), ()))
    t = Table(title="One change at a time: error of each README row, and the README's strong scaling")
    for c in ("step", *(r.name for r in ROWS), "rows outside ±10%", "177B strong DP 2 / DP 96"):
        t.add_column(c, justify="left" if c == "step" else "right")
    for name, h, (mb, rule), patches in steps:
        with contextlib.ExitStack() as stack:
            for ptc in patches:
                stack.enter_context(ptc)
            errs = [pred / pub - 1 for _, pub, (pred, _) in errors(h, True, rule, mb)]
            strong = held_out(h, 1, vpp_of(ROWS[6], rule))
        t.add_row(name, *(f"{100 * e:+.1f}%" for e in errs), str(sum(abs(e) > TARGET for e in errs)),
                  " / ".join(f"{100 * (p / q - 1):+.1f}%" for _, _, q, p in strong))
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hardware", default="h100-80g-nvlink")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--no-overlaps", action="store_true", help="price every collective as exposed (the old model)")
    ap.add_argument("--fit", action="store_true", help="search FIT_GRID for the kernel constants (about a minute)")
    ap.add_argument("--scan", action="store_true",
                    help="the matmul asymptote over SCAN: README rows beside the held-out checks (about a minute)")
    ap.add_argument("--sensitivity", action="store_true", help="each row at micro-batch 1, 2 and 4")
    ap.add_argument("--ablation", action="store_true",
                    help="what each change of decisions 0089-0091 does, one at a time")
    ap.add_argument("--interleave", choices=tuple(INTERLEAVE), default=PP_INTERLEAVE,
                    help=f"the interleaving rule of the PP > 1 rows (default: {PP_INTERLEAVE!r}, module docstring)")
    ap.add_argument("--pp1-micro-batch", type=int, default=None, metavar="N",
                    help="micro-batch of the PP 1 rows, 1, 2 or 4 (default: 4 = global batch / DP, no accumulation)")
    ap.add_argument("--candidates", action="store_true",
                    help="one micro-batch / interleaving / matmul assumption for all rows, with the held-out checks")
    _results.add_option(ap, "megatron_readme")
    a = ap.parse_args()
    run = _results.Run()
    per_replica = ROWS[0].global_batch // DP
    if a.pp1_micro_batch is not None and (a.pp1_micro_batch < 1 or per_replica % a.pp1_micro_batch):
        ap.exit(2, f"megatron_readme.py: error: --pp1-micro-batch {a.pp1_micro_batch}: must divide the PP 1 rows' "
                   f"per-replica batch of {per_replica} (1, 2 or 4)\n")
    out = Out(a.markdown)
    hw = load_hardware(a.hardware)
    if a.sensitivity:
        out.print(sensitivity(hw))
        return
    if a.ablation:
        out.print(ablation(hw))
        return
    if a.candidates:
        out.print(candidates(hw))
        return
    if a.fit:
        for outside, rms, kw in fit(hw, a.interleave, a.pp1_micro_batch)[:5]:
            print(f"{outside} rows outside ±{100 * TARGET:.0f}%, RMS error {100 * rms:.1f}%: {kw}")
        return
    if a.scan:
        out.print(scan(hw, a.interleave, a.pp1_micro_batch))
        return
    t0 = time.perf_counter()
    rows = errors(hw, not a.no_overlaps, a.interleave, a.pp1_micro_batch)
    t = Table(title=f"Megatron-LM README weak scaling (H100, seq {SEQ}, bf16) vs lynx on {hw.name}"
                    f"{' without overlaps' if a.no_overlaps else ''}")
    for c in ("model", "TP", "PP", "DP", "GPUs", "global batch", "micro-batch", "VP", "published TFLOP/s/GPU",
              "published step s", "lynx step s", "of which after the pipeline s", "lynx TFLOP/s/GPU", "error",
              "target", "holds"):
        t.add_column(c, justify="left" if c == "model" else "right")
    worst = 0.0
    figures: list[_results.Figure] = []
    for r, pub, (pred, tail) in rows:
        err = pred / pub - 1
        worst = max(worst, abs(err))
        mb, vp = schedule_of(r, a.pp1_micro_batch, a.interleave)
        figures.append(_results.Figure(f"{r.name} step (TP {r.tp} PP {r.pp} DP {DP}, micro-batch {mb}, VP {vp})",
                                       round(pred, 3), "s", f"published ± {TARGET:.0%}", abs(err) <= TARGET,
                                       round(pub, 3)))
        t.add_row(r.name, str(r.tp), str(r.pp), str(DP), str(r.tp * r.pp * DP), str(r.global_batch), str(mb), str(vp),
                  f"{r.tflops_per_gpu:.1f}", f"{pub:.3f}", f"{pred:.3f}", f"{tail:.3f}",
                  f"{r.tflops_per_gpu * pub / pred:.1f}",
                  f"{100 * err:+.1f}%", f"±{100 * TARGET:.0f}%", "yes" if abs(err) <= TARGET else "NO")
    out.print(t)
    held = sum(abs(p / q - 1) <= TARGET for _, q, (p, _) in rows)
    out.print(f"{held} of {len(rows)} rows within ±{100 * TARGET:.0f}%; worst |error| {100 * worst:.1f}%; "
              f"{time.perf_counter() - t0:.1f} s (micro-batch and VP: assumptions, module docstring)")
    title = "Megatron-LM README weak scaling on H100: published step time vs lynx's prediction"
    notes = ("The README publishes neither micro-batch nor interleaving: PP 1 rows run without gradient accumulation, "
             "PP > 1 rows at micro-batch 1 with VP 2 where the layers per stage are even (decision 0089); the H100 "
             "matmul asymptote 0.76 is fitted to these nine rows (decision 0091).",)
    if a.no_overlaps or a.hardware != "h100-80g-nvlink":
        run.write(a.results, "megatron_readme", "prediction", title, figures, notes=notes)
        return
    h = Table(title="Not fitted: the README's strong scaling of the 177B model (TP 8, PP 6, global batch 1152, "
                    f"VP {vpp_of(ROWS[6], a.interleave)}, micro-batch 1)")
    for c in ("GPUs", "DP", "published MFU", "published step s", "lynx step s", "error", "target", "holds"):
        h.add_column(c, justify="right")
    for dp, mfu, pub, pred in held_out(hw, 1, vpp_of(ROWS[6], a.interleave)):
        err = pred / pub - 1
        h.add_row(str(48 * dp), str(dp), f"{100 * mfu:.0f}%", f"{pub:.3f}", f"{pred:.3f}", f"{100 * err:+.1f}%",
                  f"±{100 * HELD_OUT_TARGET:.0f}%", "yes" if abs(err) <= HELD_OUT_TARGET else "NO")
        figures.append(_results.Figure(f"177B strong scaling at {48 * dp} GPUs step (not fitted)", round(pred, 3),
                                       "s", f"published ± {HELD_OUT_TARGET:.0%}", abs(err) <= HELD_OUT_TARGET,
                                       round(pub, 3)))
    out.print(h)
    run.write(a.results, "megatron_readme", "prediction", title, figures, notes=notes)


if __name__ == "__main__":
    main()
