"""The window control on torchtitan's own Llama 3 model (issue 24 item 5). Needs root (network namespaces).

    python benchmarks/window_control_torchtitan.py --out benchmarks/results/raw/window_control_torchtitan.json
    python benchmarks/window_control_torchtitan.py --from-json benchmarks/results/raw/window_control_torchtitan.json
    python benchmarks/window_control_torchtitan.py --smoke        # end to end in a few minutes

The same control as benchmarks/window_control.py (read its docstring for the design, the noise and the
targets), with torchtitan 0.3.0's `Llama3Model` in place of lynx's own layers: TP 2 over the two-namespace
testbed (tests/harness/testbed.py: one rank per namespace and CPU, the veth link shaped to `--rate`), the
debug model's blocks (h 256, 16 heads, FFN 768, vocab 2048; `tests.harness.torchtitan_models.debug_config`),
`--layers` of them, parallelized by torchtitan's own `parallelize` and run by lynx's engine through
`lynx.integrations.torchtitan.apply_lynx_plan` (public API only). Two micro-batches of 2 x 256 tokens, run
F0 F1 B0 B1 as lynx's TP-only runner does, then AdamW; fp32, one torch thread per rank.

Sizing (debug model, TP 2, 512 tokens per micro-batch): one block's forward GEMMs are ~0.44 GFLOP per rank,
~10-20 ms on one core of this VM; each TP all-reduce carries 512 x 256 fp32 = 512 KiB, ~10 ms of wire time at
400 Mbit/s plus gloo's overhead, so a window and the recomputation put in it are the same order.

Steps: (1) profile one torchtitan block inside the testbed: each op of the integration's `TitanLayer` timed by
lynx's profiler (`lynx.profile.measure.OpRunner`, `count_saved`, `restore_times`) and assembled into a
profiled `LayerGraph` of family torchtitan-llama3 by `lynx.profile.profiler.assemble` (`lynx profile` itself
builds only lynx's runtime layers); (2) plan lynx on that graph with window_control.py's testbed hardware and
budget scan (F auto: the largest predicted control - plan); (3) rounds of A B A' (plan, control, plan), each
a fresh pair of ranks; (4) window_control.py's analysis and table.

What differs from lynx's own runner: the loss is cross-entropy over each rank's shard of the vocabulary
(labels taken modulo the shard) instead of gathering the logits, so the timed step has no collective the plan
does not price; it changes neither the blocks' windows nor their recomputation. Gradient equality with
torchtitan's own model is tested elsewhere (tests/integration/test_torchtitan_tp.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import _results  # noqa: E402
import pipeline_testbed as pt  # noqa: E402
import window_control as wc  # noqa: E402
from _window_control import ControlDefaults, control_parser, finish_control_args, profile_rank_and_exit  # noqa: E402

H, HEADS, FFN, VOCAB = 256, 16, 768, 2048  # torchtitan 0.3.0's llama3 "debugmodel" (llama3/__init__.py)
MB, SEQ, MICROBATCHES = 2, 256, 2
TP = 2
ROLES = wc.ROLES


# -- inside a rank -------------------------------------------------------------------------------------
def _init(layers: int) -> tuple[Any, Any, Any]:
    """gloo over the testbed (env://), torchtitan's debug model built and parallelized at TP 2."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # the testbed sets LOCAL_RANK for lynx's own runner; torchtitan's DeviceMesh would then set a CUDA device
    os.environ.pop("LOCAL_RANK", None)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=300))
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    from tests.harness.torchtitan_models import debug_config

    world = dist.get_world_size()
    pd = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1, world_size=world)
    pd.build_mesh()
    group = pd.get_mesh("tp").get_group()
    cfg = debug_config(layers)
    set_llama3_sharding_config(cfg, enable_sp=False)
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    model.parallelize(pd)
    return model, pd, group


def _profile_config(repeats: int) -> Any:
    from lynx.profile.profiler import ProfileConfig

    return ProfileConfig(model="torchtitan-debug", hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                         seq_length=SEQ, micro_batch_size=MB, tp=TP, dtype="fp32", family="torchtitan-llama3",
                         dropout_p=0.0, repeats=repeats, threads=1, num_query_groups=HEADS)


def rank_profile(args: argparse.Namespace) -> None:
    """Time each op of one torchtitan block (lynx's profiler on the integration's TitanLayer); rank 0 pickles
    what `lynx.profile.profiler.assemble` takes."""
    import torch

    from lynx.integrations.torchtitan.layer import TitanLayer
    from lynx.policy.rules import full_layer
    from lynx.profile.profiler import analytic_graph

    model, _, group = _init(1)
    cfg = _profile_config(args.repeats)
    layer = TitanLayer(model.get_submodule("layers.0"), 0, group)
    torch.manual_seed(cfg.seed)
    x = torch.randn(MB, SEQ, H)  # torchtitan's blocks take [batch, seq, hidden]
    profile_rank_and_exit(layer, x, group, cfg, full_layer(analytic_graph(cfg)), args.out_path)


def rank_train(args: argparse.Namespace) -> None:
    """`--iters` timed iterations (after one warm-up) of torchtitan's model under the plan; rank 0 writes the
    iteration times and the engine's recomputation seconds per place."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.distributed.utils import get_spmd_context

    from lynx.integrations.torchtitan import apply_lynx_plan

    model, pd, group = _init(args.layers)
    lynx = apply_lynx_plan(model, args.plan, group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    context = get_spmd_context(parallel_dims=pd)
    gen = torch.Generator().manual_seed(1)
    iters = []
    for it in range(args.iters + 1):
        tokens = [torch.randint(0, VOCAB, (MB, SEQ + 1), generator=gen) for _ in range(MICROBATCHES)]
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        losses = []
        with context():
            for t in tokens:  # F0 F1, then B0 B1 (lynx's TP-only runner's order)
                inputs, labels, _ = annotate_input_spmd_types(pd, t[:, :-1].clone(), t[:, 1:].clone(), {})
                logits = model(inputs)  # this rank's shard of the vocabulary
                logits = logits.to_local() if hasattr(logits, "to_local") else logits
                losses.append(F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten() % logits.shape[-1]))
            for loss in losses:
                loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        st = lynx.stats
        iters.append({"time_s": dt, "warmup": it == 0, "recompute_window_s": st.window_s - st.cooldown_s,
                      "recompute_ondemand_s": st.ondemand_s, "by_window": dict(st.by_window)})
        lynx.end_step()
        st.reset()
    times = [torch.tensor([it["time_s"] for it in iters])]
    dist.all_reduce(times[0], op=dist.ReduceOp.MAX, group=group)  # the iteration ends when both ranks do
    for it, t in zip(iters, times[0].tolist(), strict=True):
        it["time_s"] = t
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"iterations": iters}))
    dist.barrier()
    os._exit(0)


# -- the driver ----------------------------------------------------------------------------------------
def model_spec(layers: int) -> Any:
    from lynx.spec import ModelSpec

    return ModelSpec(name="torchtitan-debug", family="torchtitan-llama3", num_layers=layers, hidden_size=H,
                     num_attention_heads=HEADS, num_query_groups=HEADS, ffn_hidden_size=FFN, vocab_size=VOCAB,
                     max_position_embeddings=4096, activation="swiglu", normalization="rmsnorm",
                     position_embedding="rope", tie_embeddings=False, attention="flash", dropout=False,
                     bias="none")


def problem(graph: Any, layers: int, rate: float, budget: float | None = None) -> Any:
    from lynx.api import make_problem
    from lynx.problem import PlanOptions
    from lynx.spec import ParallelSpec

    par = ParallelSpec(tp=TP, pp=1, micro_batch_size=MB, global_batch_size=MB * MICROBATCHES, seq_length=SEQ)
    return make_problem(model_spec(layers), pt.testbed_hardware(TP, 1, rate), par,
                        PlanOptions(budget_bytes=budget), graph=graph)


def choose(graph: Any, layers: int, rate: float, frac: str, method: str) -> tuple[dict[str, Any], Any, Any]:
    """window_control.py's plan, control and budget scan, on the torchtitan problem."""
    return wc.choose_at(lambda budget: problem(graph, layers, rate, budget), frac, method,
                        "window_control_torchtitan")


def _rank_argv(*extra: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *extra]


def reads_of_family(graph: Any) -> Any:
    """The profiled graph with each op's backward reads (`Op.saved`) taken from the family's analytic graph of
    the same shape (times and bytes stay measured). The family's reads are bf16's: there they equal what
    `count_saved` measures on TitanLayer op by op (tests/unit/test_titan_profile_reads.py). In fp32 (this
    benchmark) eager RMSNorm saves its input itself (no upcast copy), so rmsnorm1 / rmsnorm2 also read the
    layer input / attn_residual, as the profile says and the engine does; the family's reads miss that.
    (Before titan4 the profiler also charged each GEMM with its weight and rope with RoPE's table, because
    TitanLayer's parameters are the block's, not its own: decision 0088.)"""
    from dataclasses import replace

    from lynx.profile.profiler import analytic_graph

    ref = {o.name: o for o in analytic_graph(_profile_config(1)).ops}
    return replace(graph, ops=tuple(replace(o, saved=ref[o.name].saved) for o in graph.ops))


def profile(tb: Any, work: Path, repeats: int, reads: str = "profile") -> Any:
    from lynx.profile.profiler import assemble

    out = work / "profile.pkl"
    t0 = time.perf_counter()
    res = tb.run(_rank_argv("--rank-profile", "--repeats", str(repeats), "--out-path", str(out)), timeout=900)
    pt._ok(res, "profiling torchtitan's block")
    raw = pickle.loads(out.read_bytes())
    result = assemble(_profile_config(repeats), raw, time.perf_counter() - t0)
    g = result.graph if reads == "profile" else reads_of_family(result.graph)
    fwd = sum(o.fwd_time for o in g.ops if not o.is_comm)
    comm = sum(o.fwd_time for o in g.ops if o.is_comm)
    print(f"profiled torchtitan's block in the testbed: compute forward {1e3 * fwd:.1f} ms, its "
          f"{sum(o.is_comm for o in g.ops)} all-reduces {1e3 * comm:.1f} ms (per micro-batch, rank 0)", flush=True)
    return g


def train(tb: Any, plan_path: Path, out: Path, iters: int, layers: int) -> dict[str, Any]:
    res = tb.run(_rank_argv("--rank-train", "--plan-path", str(plan_path), "--iters", str(iters), "--layers",
                            str(layers), "--out-path", str(out)), timeout=1800)
    pt._ok(res, f"training torchtitan's model under {plan_path.name}")
    report = json.loads(out.read_text())
    timed = [it for it in report["iterations"] if not it["warmup"]]
    return {"times": [it["time_s"] for it in timed], "median_s": statistics.median(it["time_s"] for it in timed),
            "stages": {"0": {"window_s": statistics.fmean(it["recompute_window_s"] for it in timed),
                             "cooldown_s": 0.0,
                             "ondemand_s": statistics.fmean(it["recompute_ondemand_s"] for it in timed)}},
            "by_window": timed[-1]["by_window"]}


CONTROL = ControlDefaults("window_control_torchtitan", layers=6, layers_help="torchtitan debug-model blocks",
                          iters=10, rounds=5, smoke_layers=2, from_json_runs=True)


def parse() -> argparse.Namespace:
    ap = control_parser(__doc__.splitlines()[0], CONTROL)
    ap.add_argument("--reads", choices=("profile", "family"), default="profile",
                    help="which backward reads which output: as lynx's profiler counted them on the integration's "
                         "layer (default), or the torchtitan-llama3 family's (times and bytes measured either way)")
    args = ap.parse_args()
    return finish_control_args(ap, args, CONTROL, "must be at least 1" if args.layers < 1 else None)


TITLE = "What the windows hide on torchtitan's own Llama 3 model"


def from_json(paths: Path | list[Path], results: Path | None = None) -> None:
    """Re-print saved runs; with `results`, write their figures as one results file (each run labelled by its
    rate and file name)."""
    wc.replay_saved(paths, results, "window_control_torchtitan", TITLE,
                    lambda path, meta: f"{meta['rate_mbit']:g} Mbit/s ({path.stem}): ")


def main() -> None:
    args = parse()
    wc._repo_on_path()
    if args.rank_profile:
        rank_profile(args)
        return
    if args.rank_train:
        args.plan = args.plan_path
        args.out = args.out_path
        rank_train(args)
        return
    if args.from_json is not None:
        from_json(args.from_json, args.results)
        return
    run = _results.Run()
    import importlib.util
    import tempfile

    from tests.harness.testbed import Testbed, unavailable

    reason = unavailable() or (None if importlib.util.find_spec("torchtitan") else "torchtitan is not installed")
    if reason:
        print(f"skipped: {reason}")
        return
    work = Path(tempfile.mkdtemp(prefix="lynx-wctl-titan-"))
    load_before = os.getloadavg()
    start = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    with Testbed(args.rate) as tb:  # the namespaces are removed on the way out, whatever happens
        graph = profile(tb, work, args.repeats, args.reads)
        chosen = choose(graph, args.layers, args.rate, args.budget_frac, args.method)
        rounds = wc.control_rounds(args, "window_control_torchtitan", "torchtitan tp2", tb, work, chosen, train)
    meta = {"command": " ".join(sys.argv), "date": start, "layout": "torchtitan-tp2", "rate_mbit": args.rate,
            "layers": args.layers, "reads": args.reads, "load_before": load_before, "workdir": str(work)}
    wc.control_report(args, "window_control_torchtitan", TITLE, run, chosen[0], rounds, meta)


if __name__ == "__main__":
    main()
