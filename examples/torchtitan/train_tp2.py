"""Train torchtitan's Llama 3 debug model on CPU with a lynx plan, as torchtitan's trainer would apply it.

Plan, export, then launch two gloo ranks (docs/export.md, "A torchtitan run from the docs"):

    python -m lynx plan --model torchtitan-llama3-debug --hardware h100-80g-nvlink --tp 2 --pp 1 --dp 1 \\
        --micro-batch 2 --global-batch 4 --seq-len 256 --method lynx --budget-gb 0.07 --out plan.json
    python -m lynx export torchtitan plan.json --out lynx-torchtitan
    torchrun --nproc-per-node 2 examples/torchtitan/train_tp2.py lynx-torchtitan --steps 3 --reference

The run's config is the exported registry read by torchtitan's own config parser (``ConfigManager``); any
other argument is a torchtitan command-line override (``--parallelism.enable_sequence_parallel``, ...), and an
override that makes the run differ from the plan is refused by lynx at apply time, in one line. Each step
prints the loss; ``--reference`` also trains the same model without lynx and says whether the losses are
bitwise equal. torchtitan's FSDP (shard 1 here) is left out: the parameters are cast to bf16, the dtype its
mixed precision computes in.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lynx.integrations.torchtitan.checks import PlanMismatch
from lynx.integrations.torchtitan.cpu import (
    build_parallelized,
    gather_logits,
    init_cpu_ranks,
    parallel_dims,
    sdpa_attention,
    spmd_batch,
    spmd_context,
)


def load_config(export_dir: Path, overrides: list[str]) -> Any:
    """The exported registry, through torchtitan's own parser (overrides applied on top)."""
    from torchtitan.config.manager import ConfigManager

    sys.path.insert(0, str(export_dir.resolve()))
    return ConfigManager().parse_args(["--module", "lynx_torchtitan_registry", "--config", "lynx_plan", *overrides])


def build(cfg: Any, pd: Any, with_lynx: bool) -> Any:
    """torchtitan's model as its parallelize function makes it: TP (module plans first), then the activation
    checkpointing entry -- lynx's engine from the export -- then (left out) FSDP."""
    model = build_parallelized(sdpa_attention(cfg.model_spec.model), pd, cfg.parallelism.enable_sequence_parallel)
    for p in model.parameters():  # FSDP's param_dtype: what forward and backward compute in
        p.data = p.data.to(torch.bfloat16)
    if with_lynx:
        cfg.activation_checkpoint.build(dump_folder="").apply(model)  # LynxEngineAC: checks, then the engine
    return model


def train(cfg: Any, pd: Any, model: Any, steps: int) -> list[float]:
    t = cfg.training
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accumulation = t.global_batch_size // (t.local_batch_size * pd.dp_replicate * pd.dp_shard)
    gen = torch.Generator().manual_seed(1)  # the same tokens on every TP rank
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        with spmd_context(pd)():
            for _ in range(accumulation):  # torchtitan's gradient accumulation: one forward of the local batch
                tokens = torch.randint(0, cfg.model_spec.model.vocab_size, (t.local_batch_size, t.seq_len + 1),
                                       generator=gen)
                inputs, labels = spmd_batch(pd, tokens)
                logits = gather_logits(model(inputs), pd)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) / accumulation
                loss.backward()
                total += loss.detach()
        opt.step()
        losses.append(float(total))
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export_dir", type=Path, help="the directory `lynx export torchtitan` wrote")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reference", action="store_true", help="also train without lynx and compare the losses")
    args, overrides = ap.parse_known_args()
    rank, world = init_cpu_ranks()
    cfg = load_config(args.export_dir, overrides)
    p = cfg.parallelism
    pd = parallel_dims(world, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                       dp_shard=max(p.data_parallel_shard_degree, 1), dp_replicate=p.data_parallel_replicate_degree)
    try:
        model = build(cfg, pd, with_lynx=True)
        losses = train(cfg, pd, model, args.steps)
    except PlanMismatch as e:  # the run is not what the plan describes: one line, exit 2
        if rank == 0:
            print(f"lynx: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    from lynx.integrations.torchtitan.trainer import LynxEngineAC

    stats = LynxEngineAC.applied[-1].stats
    if rank == 0:
        for i, loss in enumerate(losses):
            print(f"step {i + 1}: loss {loss:.6f}", flush=True)
        print(f"restored in collectives' windows: {stats.restored_in_window}, on demand: {stats.restored_on_demand}")
    if args.reference:
        ref = train(cfg, pd, build(cfg, pd, with_lynx=False), args.steps)
        if rank == 0:
            print(f"torchtitan without lynx: {' '.join(f'{x:.6f}' for x in ref)}; "
                  f"bitwise equal: {'yes' if ref == losses else 'no'}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
