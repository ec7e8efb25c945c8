"""Held-out published FSDP runs: torchtitan's own throughput tables, measured vs lynx's prediction.

Nothing in lynx was fitted to these runs; they validate the FSDP time model (`lynx.cost.fsdp_time`, decision
0240) with the kernel constants of the hardware presets as they are. Target: +-15% of the published
tokens/s/GPU.

Source: pytorch/torchtitan docs/performance.md.
* At eaea6f6a (the H100 tables, torchtitan 9dec370 of 2024-12-26): "Table 1" and "Table 3", 1D FSDP, Llama 3.1
  8B, local batch size 2, selective activation checkpointing, eager (the rows without torch.compile and
  Float8): 5,762 tokens/s/GPU on 8 GPUs (global batch 16), 5,605 on 128 GPUs (global batch 256). Grand Teton
  hosts: 8 H100 with NVLink, "96GB HBM2e with 2.4 TB/sec", 400 Gb/s RDMA per GPU, 500 W power limit.
  Every 70B and 405B H100 row runs torch.compile and Float8, which lynx does not model for torchtitan.
* At 04133643 (the A100 table): "Llama 3 performance numbers", FSDP2 on 64 A100 80GB, local batch size 1:
  Llama 3 8B with selective op checkpointing 2,973 tokens/s/GPU, Llama 3 70B with full checkpointing 331.

How lynx is told each run: the family torchtitan-llama3 (torchtitan's eager block), sequence 8192 (torchtitan's
Llama 3 default), DP = every GPU, FSDP2 (`--use-torch-fsdp2`: shard over all of them, reshard after forward), local
batch = micro-batch, one micro-batch (global = local x DP); torchtitan's per-op selective checkpointing
(``selective_ac_option = "op"``: every other matmul output and the attention output saved, everything else
recomputed; torchtitan/parallelisms/parallelize_llama.py at both commits, a fresh count per block) as torch runs it
(`rules.saved_outputs`: the saved outputs held whether or not a backward reads them, the recomputation starting from
them), saving the attention and the 1st, 3rd, ... of the block's weight GEMMs in forward order
(`policy.rules.titan_sac_keep`, the method `titan-sac`): wq, wv, gate and down of the 2024 block's wq, wk, wv, wo,
w1, w3, w2 (0.3.0's fused block: qkv, gate, down); full checkpointing as full recomputation. Until decision 0264 the
saved wq and wv outputs (which no backward reads) were dropped and their GEMMs re-run in the recomputation, which
torch does not do. The H100 rows use the preset h100-80g-nvlink with the hosts' stated memory (96 GB) and bandwidth
(2.4 TB/s); its peak and kernel efficiencies are the 700 W SXM5's (the 500 W card's peak is unknown: the doc says
between SXM and NVL), so lynx should predict these rows high.

The norm each run ran (`Run.norm_fusion`) is read from the train config at the run's commit: ``norm_type =
"rmsnorm"`` (torchtitan's own eager fp32 RMSNorm in torchtitan/models/norms.py: 9dec370's llama3_8b.toml for the
H100 rows, 04133643's llama3_70b.toml) or ``"fused_rmsnorm"`` (its Triton kernel: 04133643's llama3_8b.toml). The
attention (`Run.kv_repeat`) is read from torchtitan/models/llama/model.py at the commit: both commits run
separate wq/wk/wv, the same complex fp32 RoPE as 0.3.0 on their outputs, and ``repeat_kv`` copying K and V to
every query head (4x for Llama 3 8B, 8x for 70B) before SDPA, which keeps the copies (decision 0263). The
family's other ops are torchtitan 0.3.0's, as the 2024 code ran them.
History: until 2026-12-07 the family priced torchtitan's memory-bound ops as Megatron's fused kernels and every
row read 19-38% high; looking at why led to the eager kernels' traffic (measured on CPU against torch's own aten
ops, tests/unit/test_eager_traffic.py), to each run's norm, and then to each run's attention. No constant was
fitted to these rows.

Run: PYTHONPATH=src python benchmarks/fsdp_published.py [--markdown] [--results PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import _results
from _markdown import Out
from rich.table import Table

from lynx.api import make_problem
from lynx.cost.fsdp import FSDP2
from lynx.decisions import RecomputePolicy
from lynx.partition.base import Partition
from lynx.policy.rules import full_layer, saved_outputs, titan_sac_keep
from lynx.problem import PlanOptions, PlanProblem, PlanResult
from lynx.simulate import simulate
from lynx.spec import Hardware, ParallelSpec, load_hardware

TARGET = 0.15
SEQ = 8192


@dataclass(frozen=True, slots=True)
class Run:
    name: str
    model: str
    hardware: str
    gpus: int
    local_batch: int
    ac: str
    """"op" (selective per-op) or "full"."""
    published_tps: float
    source: str
    norm_fusion: bool
    """The train config's ``norm_type`` at the commit: "rmsnorm" is torchtitan's own eager fp32 RMSNorm
    (torchtitan/models/norms.py, `ModelSpec.norm_fusion` False), "fused_rmsnorm" its Triton kernel (True)."""
    kv_repeat: bool
    """The attention at the commit: separate wq/wk/wv and ``repeat_kv`` (`ModelSpec.kv_repeat` True), or 0.3.0's
    fused QKV with attention over the K/V heads (False)."""


RUNS = (  # norm: train_configs/llama3_8b.toml at 9dec370 and llama3_{8b,70b}.toml at 04133643; attention:
    # torchtitan/models/llama/model.py at both (Attention.forward calls repeat_kv on K and V)
    Run("Llama 3.1 8B, FSDP 8, H100", "torchtitan-llama3-8b", "h100-96g-teton", 8, 2, "op", 5762,
        "performance.md@eaea6f6a Table 1", norm_fusion=False, kv_repeat=True),
    Run("Llama 3.1 8B, FSDP 128, H100", "torchtitan-llama3-8b", "h100-96g-teton", 128, 2, "op", 5605,
        "performance.md@eaea6f6a Table 3", norm_fusion=False, kv_repeat=True),
    Run("Llama 3 8B, FSDP 64, A100", "torchtitan-llama3-8b", "a100-80g-dgx", 64, 1, "op", 2973,
        "performance.md@04133643 Llama 3 table", norm_fusion=True, kv_repeat=True),
    Run("Llama 3 70B, FSDP 64, A100", "torchtitan-llama3-70b", "a100-80g-dgx", 64, 1, "full", 331,
        "performance.md@04133643 Llama 3 table", norm_fusion=False, kv_repeat=True),
)


def hardware(name: str) -> Hardware:
    """The preset, or for the Grand Teton hosts the H100 preset with the memory and bandwidth they state."""
    if name != "h100-96g-teton":
        return load_hardware(name)
    hw = load_hardware("h100-80g-nvlink")
    dev = dataclasses.replace(hw.device, name="H100-96GB-HBM2e", memory_bytes=96e9, memory_bandwidth_Bps=2.4e12)
    return dataclasses.replace(hw, name=name, device=dev, max_nodes=64)


def predict(r: Run, with_dp: bool = True) -> tuple[float, float, float]:
    """(tokens/s/GPU, iteration s, peak GiB) lynx predicts for the run (`with_dp` False: without FSDP's
    collectives and the optimizer step, to show what they add)."""
    from lynx.models import load_model

    hw = hardware(r.hardware)
    par = ParallelSpec(tp=1, pp=1, dp=r.gpus, micro_batch_size=r.local_batch, global_batch_size=r.local_batch * r.gpus,
                       seq_length=SEQ)
    nodes = -(-r.gpus // hw.devices_per_node)
    model = dataclasses.replace(load_model(r.model), norm_fusion=r.norm_fusion, kv_repeat=r.kv_repeat)
    prob = make_problem(model, hw, par, PlanOptions(precision="megatron-bf16", dp_sharding=FSDP2,
                                                                  nodes=nodes, include_dp_allreduce=with_dp))
    return run_torchtitan(prob, r.ac, r.gpus)


def run_torchtitan(prob: PlanProblem, ac: str, gpus: int) -> tuple[float, float, float]:
    """(tokens/s/GPU, iteration s, peak GiB) of one stage running every block as torchtitan's AC `ac` does
    ("op": per-op selective as its 2024-2025 code ran it, `policy.rules.titan_sac_keep`: Float8's GEMMs not on its
    save list; "full"), simulated."""
    g = prob.graph
    gemms = "none" if prob.model.fp8 is not None else "alternate"
    lp = saved_outputs(g, titan_sac_keep(g, gemms)) if ac == "op" else full_layer(g)
    layers = prob.model.num_layers
    pol = RecomputePolicy(f"torchtitan-{ac}", (lp,) * layers)
    res = PlanResult(pol.method, Partition((layers,), method="even"), (pol,))
    sim = simulate(prob, res.partition, res.policies, record=False)
    tps = SEQ * prob.parallel.global_batch_size / sim.iteration_time_s / gpus
    return tps, sim.iteration_time_s, max(s.peak_memory_bytes for s in sim.stages) / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    _results.add_option(ap, "fsdp_published")
    a = ap.parse_args()
    run = _results.Run()
    out = Out(a.markdown)
    t = Table(title="Held out: torchtitan's published FSDP2 throughput vs lynx (eager bf16, no Float8/compile)")
    for c in ("run", "AC", "norm", "attention", "local batch", "published tok/s/GPU", "lynx tok/s/GPU", "lynx step s",
              "FSDP + step s", "peak GiB", "error", "target", "holds", "source"):
        t.add_column(c, justify="left" if c in ("run", "source", "AC", "norm", "attention") else "right")
    figures: list[_results.Figure] = []
    held = 0
    for r in RUNS:
        tps, it, peak = predict(r)
        bare = predict(r, with_dp=False)[1]
        err = tps / r.published_tps - 1
        ok = abs(err) <= TARGET
        held += ok
        t.add_row(r.name, r.ac, "fused" if r.norm_fusion else "eager", "repeat_kv" if r.kv_repeat else "0.3.0",
                  str(r.local_batch), f"{r.published_tps:,.0f}",
                  f"{tps:,.0f}", f"{it:.3f}", f"{it - bare:.3f}", f"{peak:.1f}", f"{100 * err:+.1f}%",
                  f"±{100 * TARGET:.0f}%", "yes" if ok else "NO", r.source)
        figures.append(_results.Figure(f"{r.name} tokens/s/GPU", round(tps), "tok/s/GPU", f"published ± {TARGET:.0%}",
                                       ok, r.published_tps))
    out.print(t)
    out.print(f"{held} of {len(RUNS)} runs within ±{100 * TARGET:.0f}% of torchtitan's published throughput. "
              "'FSDP + step s': what FSDP's exposed collectives and the sharded optimizer step add to the step.")
    run.write(a.results, "fsdp_published", "prediction", "torchtitan's published FSDP2 runs (held out): "
              "tokens/s/GPU vs lynx's prediction", figures)


if __name__ == "__main__":
    main()
