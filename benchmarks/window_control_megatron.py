"""The window control on Megatron-Core's own GPT model at PP 2 x TP 2 (issue 32 item 4). Needs root (network
namespaces).

    python benchmarks/window_control_megatron.py --out benchmarks/results/window_control_megatron.json
    python benchmarks/window_control_megatron.py --from-json benchmarks/results/window_control_megatron.json
    python benchmarks/window_control_megatron.py --smoke        # end to end in a few minutes

The same control as benchmarks/window_control.py (read its docstring for the design, the noise and the
targets), with Megatron-Core 0.16.1's `GPTModel` (local layer spec; GPT: LayerNorm, GeLU, learned positions,
biases; h 256, 16 heads, FFN 1024, vocab 2048, `--layers` of them) built by Megatron-Core on CPU over gloo (the
seams of tests/harness/megatron_seams.py), run by Megatron's own 1F1B schedule and DDP, with lynx's engine
applied by `lynx.integrations.megatron.apply_lynx_plan` and the cool-down window opened through the schedule's
``p2p_communicator`` (`schedule_kwargs`). PP 2 x TP 2 over the two-namespace testbed (tests/harness/testbed.py;
namespaces named ``mc5a...`` / ``mc5b...``): Megatron's TP pairs (ranks 0-1, 2-3) cross the shaped link, its
PP pairs (0-2, 1-3) share a namespace, and both stages of a TP rank share its core. Four micro-batches of
2 x 256 tokens, fp32, one torch thread per rank; no optimizer step (the step's gradients are what the engine
changes nothing in).

Steps: (1) profile one Megatron-Core layer inside the testbed at TP 2 (each op of the integration's
`MegatronLayer` timed by lynx's profiler, `lynx.profile.measure`, and assembled into a profiled `LayerGraph` of
family gpt by `lynx.profile.profiler.assemble`); (2) plan lynx at PP 2 x TP 2 on that graph with
window_control.py's testbed hardware and budget scan; (3) rounds of A B A' (plan, control, plan), each a fresh
set of four ranks; (4) window_control.py's analysis and table.
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

H, HEADS, FFN, VOCAB = 256, 16, 1024, 2048
MB, SEQ, MICROBATCHES = 2, 256, 4
TP, PP = 2, 2
ROLES = wc.ROLES


def _shape(layers: int, pp: int) -> Any:
    from tests.harness.megatron_plans import Shape

    return Shape(layers=layers, hidden=H, heads=HEADS, groups=HEADS, ffn=FFN, vocab=VOCAB, seq=SEQ, tp=TP, pp=pp,
                 mbs=MB, microbatches=MICROBATCHES)


# -- inside a rank -------------------------------------------------------------------------------------
def _init(layers: int, pp: int) -> tuple[Any, Any, Any]:
    """gloo over the testbed (env://), Megatron-Core's parallel state and its GPTModel for this rank's stage."""
    import torch
    import torch.distributed as dist

    from tests.harness import megatron_seams as ms

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=300))
    ms.install()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=pp)
    s = _shape(layers, pp)
    cfg = ms.config(s, TP, pp)
    return s, cfg, ms.build_gpt(s, cfg, ms.layer_spec(s, False))


def _profile_config(repeats: int) -> Any:
    from lynx.profile.profiler import ProfileConfig

    return ProfileConfig(model="megatron-gpt", hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                         seq_length=SEQ, micro_batch_size=MB, tp=TP, dtype="fp32", family="gpt", dropout_p=0.0,
                         repeats=repeats, threads=1)


def rank_profile(args: argparse.Namespace) -> None:
    """Time each op of one Megatron-Core layer (lynx's profiler on the integration's MegatronLayer); rank 0
    pickles what `lynx.profile.profiler.assemble` takes."""
    import torch
    from megatron.core import parallel_state as ps

    from lynx.integrations.megatron.layer import MegatronLayer
    from lynx.policy.rules import full_layer
    from lynx.profile.profiler import analytic_graph
    from tests.harness.megatron_seams import causal_mask

    _, _, model = _init(1, 1)
    cfg = _profile_config(args.repeats)
    g = analytic_graph(cfg)
    layer = MegatronLayer(model.decoder.layers[0], g.names, {o.name: o.inputs for o in g.ops},
                          {o.name: o.block for o in g.ops})
    layer.context[0] = (causal_mask(SEQ), None)
    group = ps.get_tensor_model_parallel_group()
    torch.manual_seed(cfg.seed)
    x = torch.randn(SEQ, MB, H)  # Megatron's layers take [sequence, batch, hidden]
    profile_rank_and_exit(layer, x, group, cfg, full_layer(g), args.out_path)


def rank_train(args: argparse.Namespace) -> None:
    """`--iters` timed iterations (after one warm-up) of Megatron-Core's model under the plan, through its own
    1F1B schedule and DDP; rank 0 writes the iteration times (the slowest rank's) and, per stage, the
    engine's recomputation seconds per place (TP rank 0 of each stage, averaged over timed iterations)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from lynx.integrations.megatron import apply_lynx_plan, schedule_kwargs
    from tests.harness import megatron_seams as ms

    s, cfg, model = _init(args.layers, PP)
    lynx = apply_lynx_plan(model, args.plan)
    ddp = ms.wrap_ddp(cfg, model)
    kw = schedule_kwargs(lynx, cfg)
    data = ms.batches(s, MICROBATCHES, MB, seed=1)
    iters = []
    for it in range(args.iters + 1):
        dist.barrier()
        t0 = time.perf_counter()
        ms.train_step(s, cfg, [ddp], data, kw, keep_grads=False)
        dt = time.perf_counter() - t0
        st = lynx.stats
        iters.append({"time_s": dt, "warmup": it == 0, "window_s": st.window_s - st.cooldown_s,
                      "cooldown_s": st.cooldown_s, "ondemand_s": st.ondemand_s, "by_window": dict(st.by_window)})
        st.reset()
    times = torch.tensor([x["time_s"] for x in iters])
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the iteration ends when every rank's does
    timed = [x for x in iters if not x["warmup"]]
    mine = {k: statistics.fmean(x[k] for x in timed) for k in ("window_s", "cooldown_s", "ondemand_s")}
    mine["by_window"] = timed[-1]["by_window"]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), mine))
    if dist.get_rank() == 0:
        stages = {str(p): m for p, t, m in every if t == 0}
        Path(args.out).write_text(json.dumps({"times": times.tolist(), "warmup": [x["warmup"] for x in iters],
                                              "stages": stages}))
    dist.barrier()
    os._exit(0)


# -- the driver ----------------------------------------------------------------------------------------
def problem(graph: Any, layers: int, rate: float, budget: float | None = None) -> Any:
    from lynx.api import make_problem
    from lynx.problem import PlanOptions
    from tests.harness.megatron_plans import specs

    m, par = specs(_shape(layers, PP))
    return make_problem(m, pt.testbed_hardware(TP, PP, rate), par,
                        PlanOptions(budget_bytes=budget, precision="fp32"), graph=graph)


def choose(graph: Any, layers: int, rate: float, frac: str, method: str) -> tuple[dict[str, Any], Any, Any]:
    """window_control.py's plan, control and budget scan, on the Megatron-Core problem."""
    return wc.choose_at(lambda budget: problem(graph, layers, rate, budget), frac, method,
                        "window_control_megatron")


def _rank_argv(*extra: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *extra]


def profile(tb: Any, work: Path, repeats: int) -> Any:
    from lynx.profile.profiler import assemble

    out = work / "profile.pkl"
    t0 = time.perf_counter()
    res = tb.run(_rank_argv("--rank-profile", "--repeats", str(repeats), "--out-path", str(out)), timeout=900)
    pt._ok(res, "profiling Megatron-Core's layer")
    g = assemble(_profile_config(repeats), pickle.loads(out.read_bytes()), time.perf_counter() - t0).graph
    fwd = sum(o.fwd_time for o in g.ops if not o.is_comm)
    comm = sum(o.fwd_time for o in g.ops if o.is_comm)
    print(f"profiled Megatron-Core's layer in the testbed: compute forward {1e3 * fwd:.1f} ms, its "
          f"{sum(o.is_comm for o in g.ops)} all-reduces {1e3 * comm:.1f} ms (per micro-batch, rank 0)", flush=True)
    return g


def train(tb: Any, plan_path: Path, out: Path, iters: int, layers: int) -> dict[str, Any]:
    res = tb.run(_rank_argv("--rank-train", "--plan-path", str(plan_path), "--iters", str(iters), "--layers",
                            str(layers), "--out-path", str(out)), timeout=1800, world=TP * PP)
    pt._ok(res, f"training Megatron-Core's model under {plan_path.name}")
    report = json.loads(out.read_text())
    times = [t for t, w in zip(report["times"], report["warmup"], strict=True) if not w]
    return {"times": times, "median_s": statistics.median(times),
            "stages": {k: {x: v[x] for x in ("window_s", "cooldown_s", "ondemand_s")}
                       for k, v in report["stages"].items()},
            "by_window": {k: v["by_window"] for k, v in report["stages"].items()}}


def testbed(rate: float) -> Any:
    """tests/harness/testbed.py's two namespaces, named mc5a... / mc5b... (beside other sessions' testbeds)."""
    from tests.harness.testbed import Testbed

    tb = Testbed(rate)
    tag = tb.ns[0][len("lynxa"):]
    tb.ns, tb.dev = (f"mc5a{tag}", f"mc5b{tag}"), (f"m5a{tag}", f"m5b{tag}")
    return tb


CONTROL = ControlDefaults("window_control_megatron", layers=8, layers_help="decoder layers, split over the 2 stages",
                          iters=8, rounds=4, smoke_layers=4, from_json_runs=False)


def parse() -> argparse.Namespace:
    ap = control_parser(__doc__.splitlines()[0], CONTROL)
    args = ap.parse_args()
    bad = args.layers < PP or args.layers % PP
    return finish_control_args(ap, args, CONTROL, f"a positive multiple of PP {PP}" if bad else None)


TITLE = "What the windows hide on Megatron-Core's own GPTModel (PP 2 x TP 2)"


def from_json(path: Path, results: Path | None = None) -> None:
    """Re-print a saved run; with `results`, write its figures as the results file."""
    wc.replay_saved(path, results, "window_control_megatron", TITLE, lambda _, meta: "")


def main() -> None:
    args = parse()
    wc._repo_on_path()
    if args.rank_profile:
        rank_profile(args)
        return
    if args.rank_train:
        args.plan, args.out = args.plan_path, args.out_path
        rank_train(args)
        return
    if args.from_json is not None:
        from_json(args.from_json, args.results)
        return
    import importlib.util
    import tempfile

    from tests.harness.testbed import unavailable

    reason = unavailable() or (None if importlib.util.find_spec("megatron") else "megatron-core is not installed")
    if reason:
        print(f"skipped: {reason}")
        return
    work = Path(tempfile.mkdtemp(prefix="lynx-wctl-mcore-"))
    load_before = os.getloadavg()
    run = _results.Run()
    start = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    with testbed(args.rate) as tb:  # the namespaces are removed on the way out, whatever happens
        graph = profile(tb, work, args.repeats)
        chosen = choose(graph, args.layers, args.rate, args.budget_frac, args.method)
        rounds = wc.control_rounds(args, "window_control_megatron", "Megatron-Core pp2tp2", tb, work, chosen, train)
    meta = {"command": " ".join(sys.argv), "date": start, "layout": "megatron-core-pp2tp2", "rate_mbit": args.rate,
            "layers": args.layers, "load_before": load_before, "workdir": str(work)}
    wc.control_report(args, "window_control_megatron", TITLE, run, chosen[0], rounds, meta)


if __name__ == "__main__":
    main()
