"""One Megatron-Core training step three ways on every rank, compared: Megatron's own run without
recomputation, with its full recomputation (``recompute_granularity="full"``), and with a lynx plan applied by
`lynx.integrations.megatron` (its cool-down window opened through the schedule's ``p2p_communicator``). Ranks
are spawned by `lynx.runtime.launch.spawn_ranks` (gloo on CPU, the seams of `megatron_seams`); each writes
``rank<r>.json``: whether losses and every gradient are bitwise equal, the largest difference, and the
engine's restorations per place."""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tests.harness.megatron_plans import Shape, plan_file

TIMEOUT_S = 120.0


def _tiny(s: Shape) -> Any:
    from tests.harness.megatron_seams import Tiny

    return Tiny(llama=s.llama, layers=s.layers, hidden=s.hidden, heads=s.heads, groups=s.groups, ffn=s.ffn,
                vocab=s.vocab, seq=s.seq, dropout=s.dropout)


def _chunks(s: Shape, mode: str, plan: str) -> tuple[Any, list[Any], list[Any]]:
    """(config, DDP-wrapped chunks, the lynx objects) of this rank for `mode` in none / full / lynx."""
    from lynx.integrations.megatron import apply_lynx_plan
    from tests.harness import megatron_seams as ms

    t = _tiny(s)
    cfg = ms.config(t, s.tp, s.pp, s.sp, full_recompute=mode == "full", vpp=s.vpp if s.vpp > 1 else None)
    spec = ms.layer_spec(t, s.sp, s.pp * s.vpp)
    vps = list(range(s.vpp)) if s.vpp > 1 else [None]
    models = [ms.build_gpt(t, cfg, spec, vp_stage=v) for v in vps]
    lynx = [apply_lynx_plan(m, plan, vp_stage=v) for m, v in zip(models, vps, strict=True)] if mode == "lynx" else []
    return cfg, [ms.wrap_ddp(cfg, m) for m in models], lynx


def _rank(rank: int, world: int, init_method: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from lynx.integrations.megatron import schedule_kwargs
    from tests.harness import megatron_seams as ms

    s = Shape(**args.shape)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    ms.install()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=s.tp, pipeline_model_parallel_size=s.pp,
                                 virtual_pipeline_model_parallel_size=s.vpp if s.vpp > 1 else None)
    data = ms.batches(_tiny(s), s.microbatches, s.mbs, seed=7 + ps.get_data_parallel_rank())
    runs: dict[str, Any] = {}
    stats: list[dict[str, int]] = []
    held: list[int] = []
    offloaded: list[int] = []
    peak: list[int] = []
    for mode in ("none", "full", "lynx"):
        cfg, chunks, lynx = _chunks(s, mode, args.plan)
        kw = schedule_kwargs(lynx[0], cfg) if lynx and s.vpp == 1 else None
        runs[mode] = ms.train_step(_tiny(s), cfg, chunks, data, kw)
        stats = [dict(x.stats.by_window) for x in lynx] or stats
        if lynx:
            held = [x.engine.held_bytes() for x in lynx]
            peak = [x.stats.peak_bytes for x in lynx]
            offloaded = [x.stats.offloaded_bytes for x in lynx]
    (l0, g0), out = runs["none"], {"rank": rank, "stats": stats, "params": len(runs["none"][1]),
                                   "held_after_step": held, "peak_bytes": peak, "offloaded_bytes": offloaded}
    for mode in ("full", "lynx"):
        loss, g = runs[mode]
        out[mode] = {"losses_equal": loss == l0, "grads_equal": all(torch.equal(g[k], g0[k]) for k in g0),
                     "max_diff": max(float((g[k] - g0[k]).abs().max()) for k in g0), "losses": loss}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def run(s: Shape, tmp: Path, policy: str = "windows") -> list[dict[str, Any]]:
    """The comparison on tp x pp x dp local ranks; one dict per rank (see the module docstring)."""
    from lynx.runtime.launch import spawn_ranks

    plan = plan_file(tmp, s, policy)
    spawn_ranks(_rank, s.tp * s.pp * s.dp, argparse.Namespace(shape=asdict(s), plan=str(plan), out=str(tmp)))
    return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(s.tp * s.pp * s.dp)]
