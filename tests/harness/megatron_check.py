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


def _hookup(hookup: str) -> Any:
    """`apply_plan(model, vp_stage)`: the integration's own function on the plan file, or (a directory) the
    `lynx_megatron_engine.py` that `lynx export megatron` wrote there, imported as a model provider would."""
    import importlib.util
    import sys

    from lynx.export.megatron_engine import ENGINE_FILE

    if "lynx_megatron_engine" in sys.modules:  # imported once per process, as a model provider does
        return sys.modules["lynx_megatron_engine"]
    path = Path(hookup, ENGINE_FILE)
    spec = importlib.util.spec_from_file_location("lynx_megatron_engine", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["lynx_megatron_engine"] = mod
    spec.loader.exec_module(mod)
    return mod


def _chunks(s: Shape, mode: str, plan: str, hookup: str | None = None) -> tuple[Any, list[Any], list[Any]]:
    """(config, DDP-wrapped chunks, the lynx objects) of this rank for `mode` in none / full / lynx; with
    `hookup`, the plan is applied through the exported hook-up module in that directory."""
    from lynx.integrations.megatron import apply_lynx_plan
    from tests.harness import megatron_seams as ms

    t = s
    cfg = ms.config(t, s.tp, s.pp, s.sp, full_recompute=mode == "full", vpp=s.vpp if s.vpp > 1 else None)
    spec = ms.layer_spec(t, s.sp, s.pp * s.vpp)
    vps = list(range(s.vpp)) if s.vpp > 1 else [None]
    models = [ms.build_gpt(t, cfg, spec, vp_stage=v) for v in vps]
    apply = _hookup(hookup).apply_plan if hookup else (lambda m, vp_stage: apply_lynx_plan(m, plan, vp_stage=vp_stage))
    lynx = [apply(m, vp_stage=v) for m, v in zip(models, vps, strict=True)] if mode == "lynx" else []
    return cfg, [ms.wrap_ddp(cfg, m, s) for m in models], lynx


class _DdpWatch:
    """The engine's restorations (all places) when the first DDP bucket collective was launched and when the
    first one was waited for: Megatron's own bucket groups' ``start_grad_sync`` / ``finish_grad_sync``, wrapped
    per instance here (a test seam; the integration itself does not touch DDP)."""

    def __init__(self, lynx: list[Any]) -> None:
        self.lynx = lynx
        self.launched: int | None = None
        self.waited: int | None = None

    def restorations(self) -> int:
        return sum(sum(x.stats.by_window.values()) for x in self.lynx)

    def wrap(self, group: Any) -> None:
        start, finish = group.start_grad_sync, group.finish_grad_sync

        def started(*a: Any, **k: Any) -> Any:
            if self.launched is None and self.waited is None:
                self.launched = self.restorations()
            return start(*a, **k)

        def finished(*a: Any, **k: Any) -> Any:
            if self.waited is None:
                self.waited = self.restorations()
            return finish(*a, **k)

        group.start_grad_sync, group.finish_grad_sync = started, finished

    def restored_in_flight(self) -> int:
        """Restorations run while a bucket's gradient collective was outstanding (0 without the overlap:
        Megatron then launches each bucket from `finish_grad_sync`, after the backward)."""
        if self.launched is None or self.waited is None:
            return 0
        return self.waited - self.launched


def _watch_ddp(chunks: list[Any], lynx: list[Any]) -> _DdpWatch:
    w = _DdpWatch(lynx)
    for c in chunks:
        for g in c.bucket_groups:
            w.wrap(g)
    return w


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
    data = ms.batches(s, s.microbatches, s.mbs, seed=7 + ps.get_data_parallel_rank())
    runs: dict[str, Any] = {}
    stats: list[dict[str, int]] = []
    held: list[int] = []
    offloaded: list[int] = []
    peak: list[int] = []
    in_ddp = 0
    for mode in ("none", "full", "lynx"):
        cfg, chunks, lynx = _chunks(s, mode, args.plan, args.hookup)
        for _ in range(s.steps - 1):
            if s.overlap_param_gather:
                ms.stale_other_shards(chunks)
            ms.train_step(s, cfg, chunks, data, schedule_kwargs(lynx if s.vpp > 1 else lynx[0], cfg) if lynx
                          else None, keep_grads=False)
        watch = _watch_ddp(chunks, lynx) if lynx else None
        if s.overlap_param_gather:
            ms.stale_other_shards(chunks)
        if args.hookup and lynx:
            kw = _hookup(args.hookup).cooldown_kwargs(cfg)
        else:
            kw = schedule_kwargs(lynx if s.vpp > 1 else lynx[0], cfg) if lynx else None
        runs[mode] = ms.train_step(s, cfg, chunks, data, kw)
        if watch is not None:
            in_ddp = watch.restored_in_flight()
        stats = [dict(x.stats.by_window) for x in lynx] or stats
        if lynx:
            held = [x.engine.held_bytes() for x in lynx]
            peak = [x.stats.peak_bytes for x in lynx]
            offloaded = [x.stats.offloaded_bytes for x in lynx]
    (l0, g0), out = runs["none"], {"rank": rank, "stats": stats, "params": len(runs["none"][1]),
                                   "held_after_step": held, "peak_bytes": peak, "offloaded_bytes": offloaded,
                                   "restored_in_ddp_collective": in_ddp}
    for mode in ("full", "lynx"):
        loss, g = runs[mode]
        out[mode] = {"losses_equal": loss == l0, "grads_equal": all(torch.equal(g[k], g0[k]) for k in g0),
                     "max_diff": max(float((g[k] - g0[k]).abs().max()) for k in g0), "losses": loss}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def run(s: Shape, tmp: Path, policy: str = "windows", exported: bool = False,
        planned: Shape | None = None) -> list[dict[str, Any]]:
    """The comparison on tp x pp x dp local ranks; one dict per rank (see the module docstring). `exported`:
    apply the plan as a user does, through what `lynx export megatron` writes (`_hookup`). `planned`: the shape
    the plan is made for, when it is not the one run (a refusal's test)."""
    from lynx.export.megatron import build_megatron, write_megatron
    from lynx.export.source import load_source
    from lynx.runtime.launch import spawn_ranks

    plan = plan_file(tmp, planned or s, policy)
    hookup = None
    if exported:
        hookup = str(tmp / "lynx-megatron")
        write_megatron(build_megatron(load_source(plan), simulate=False), Path(hookup), plan)
    spawn_ranks(_rank, s.tp * s.pp * s.dp,
                argparse.Namespace(shape=asdict(s), plan=str(plan), out=str(tmp), hookup=hookup))
    return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(s.tp * s.pp * s.dp)]
