"""Where the recompute engine's time goes: one process, TP 1, one torch thread, the testbeds'
4-layer GPT (h 512, 8 heads, FFN 2048, s 256, micro-batch 2, 4 micro-batches, fp32, dropout 0.1).

Side by side in one process, per recomputed op:

* ``profile``: the op's forward time as `lynx profile` measures it (the planner's price of a restoration),
* ``plain``: the same op timed inside a plain forward pass of the layer (op by op, autograd recording),
* ``engine``: what one restoration of that op costs inside the engine (`RecomputeEngine.tracer`), per policy,

then per policy the iteration time (forward + backward of 4 micro-batches, no optimizer) against the plain
model's, the recomputation the engine timed, the rest (``extra``: time the plan's recomputation, priced as the
profile's forward plus its measured overhead per restoration, does not explain) and the minor page faults per
iteration (a leak shows there first); and the work outside the layers (embedding, LM head + loss, AdamW).
``--cprofile`` adds the engine's own Python functions (tottime) for one iteration of each policy.
Ratios taken in one run are comparable; absolute numbers depend on the machine's load.

    python benchmarks/engine_overhead.py                 # ~1-2 minutes on one core
    python benchmarks/engine_overhead.py --iters 5 --cprofile --json /tmp/engine_overhead.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import statistics
import time
from typing import Any

import _results
import torch
from _harness import method_policy, problem_for, train_step
from _targets import Targets

from lynx.decisions import LayerPolicy, Phase, RecomputePolicy
from lynx.graph import LAYER_INPUT
from lynx.profile.profiler import ProfileConfig, profile
from lynx.runtime.cpu_alloc import keep_freed_memory
from lynx.runtime.engine import RecomputeEngine
from lynx.runtime.layers.gpt import LayerConfig
from lynx.runtime.layers.gpt_model import GPTModel

H, HEADS, FFN, SEQ, MB, LAYERS, MBS, VOCAB = 512, 8, 2048, 256, 2, 4, 4, 1024
LYNX_LIKE = ("ln1", "attn_scores", "softmax", "attn_dropout", "ln2", "gelu")
"""What the PP 2 testbed's lynx plan recomputes on stage 0 (phase 5), benchmarks/pipeline_testbed.py."""


def layer_config() -> LayerConfig:
    return LayerConfig(hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN, seq_length=SEQ,
                       micro_batch_size=MB, dropout_p=0.1, num_layers=LAYERS)


def lynx_like(names: tuple[str, ...]) -> RecomputePolicy:
    keep = frozenset(n for n in names if n not in LYNX_LIKE)
    lp = LayerPolicy(keep=keep, recompute=tuple((n, Phase.ON_DEMAND) for n in LYNX_LIKE))
    return RecomputePolicy(method="lynx-like", layers=(lp,) * LAYERS)


def profiled(repeats: int) -> tuple[dict[str, float], float]:
    """`lynx profile`'s forward time per op and its measured engine overhead per restoration."""
    cfg = ProfileConfig(model="engine-overhead", hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                        seq_length=SEQ, micro_batch_size=MB, threads=1, repeats=repeats)
    g = profile(cfg).graph
    return {o.name: o.fwd_time for o in g.ops}, g.runtime.restore_op_s if g.runtime is not None else 0.0


def plain_op_times(model: GPTModel, repeats: int) -> dict[str, float]:
    """Median time of each op inside a plain forward pass of layer 1 (autograd recording, warm inputs)."""
    layer = model.layers[1]
    x = torch.randn(SEQ, MB, H, requires_grad=True)
    samples: dict[str, list[float]] = {n: [] for n in layer.op_names}
    for _ in range(repeats):
        env = {LAYER_INPUT: x}
        for n in layer.op_names:
            t0 = time.perf_counter()
            env[n] = layer.run_op(n, env, 0)
            samples[n].append(time.perf_counter() - t0)
        del env
    return {n: statistics.median(v) for n, v in samples.items()}


def edge_times(model: GPTModel, repeats: int) -> dict[str, float]:
    """Per micro-batch: embedding, final norm + LM head + loss (forward + backward); and one AdamW step of the
    whole model: the work outside the layers, which the layer profile does not see."""
    from lynx.runtime.layers.gpt_model import head_logits, lm_loss, synthetic_batch

    tok, lab = synthetic_batch(VOCAB, MB, SEQ, 0)
    x = torch.randn(SEQ, MB, H, requires_grad=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    out: dict[str, list[float]] = {"embedding": [], "head+loss": [], "adamw": []}
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        model.embed(tok, 0).sum().backward()
        t1 = time.perf_counter()
        lm_loss(head_logits(x, model.ln_f, model.wte, model.cfg, None), lab).backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        for k, dt in zip(out, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            out[k].append(dt)
    model.zero_grad(set_to_none=True)
    return {k: statistics.median(v[1:]) for k, v in out.items()}


def _collector(into: dict[str, list[float]]):  # type: ignore[no-untyped-def]
    return lambda name, t0, t1: into.setdefault(name.split()[1], []).append(t1 - t0)


def run_policies(model: GPTModel, pols: dict[str, RecomputePolicy | None], iters: int) -> dict[str, dict[str, Any]]:
    """Each policy's iteration (forward + backward of `MBS` micro-batches), the policies interleaved round by
    round so that a change of the machine's load hits all of them alike; one warm-up round first."""
    engines = {p: RecomputeEngine(list(model.layers), pol) if pol is not None else None for p, pol in pols.items()}
    per_op: dict[str, dict[str, list[float]]] = {p: {} for p in pols}
    times: dict[str, list[float]] = {p: [] for p in pols}
    recompute: dict[str, list[float]] = {p: [] for p in pols}
    faults: dict[str, list[int]] = {p: [] for p in pols}
    for rnd in range(iters + 1):
        for p, engine in engines.items():
            if engine is not None:
                engine.stats.reset()
                engine.tracer = _collector(per_op[p]) if rnd else None
            model.zero_grad(set_to_none=True)
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            train_step(model, MBS, engine)
            if rnd:
                times[p].append(time.perf_counter() - t0)
                faults[p].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
                recompute[p].append(engine.stats.ondemand_s + engine.stats.window_s if engine is not None else 0.0)
    return {p: {"iter_s": statistics.median(times[p]), "recompute_s": statistics.median(recompute[p]),
                "minor_faults": statistics.median(faults[p]),
                "per_op_s": {n: statistics.median(v) for n, v in per_op[p].items()},
                "per_op_mean_s": {n: statistics.mean(v) for n, v in per_op[p].items()}, "engine": engines[p]}
            for p in pols}


def cprofile_engine(model: GPTModel, engine: RecomputeEngine | None,
                    top: int) -> tuple[list[tuple[str, float]], float, int]:
    """One iteration under cProfile: the engine's own functions by tottime (runtime/engine.py), their total,
    and the number of restorations (cProfile inflates Python time: read the shares, not the seconds)."""
    if engine is not None:
        engine.stats.reset()
    prof = cProfile.Profile()
    prof.enable()
    train_step(model, MBS, engine)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = [(k[2], v[2]) for k, v in stats.items() if k[0].endswith("runtime/engine.py")]
    n = engine.stats.restored_on_demand + engine.stats.restored_in_window if engine is not None else 0
    return sorted(rows, key=lambda r: -r[1])[:top], sum(t for _, t in rows), n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=3, help="timed iterations per policy (median), interleaved")
    ap.add_argument("--repeats", type=int, default=10, help="profile repeats")
    ap.add_argument("--cprofile", action="store_true", help="cProfile one iteration per policy")
    ap.add_argument("--no-mallopt", action="store_true", help="leave glibc's allocator settings alone")
    ap.add_argument("--json", default=None, help="write the numbers here")
    _results.add_option(ap, "engine_overhead")
    args = ap.parse_args(argv)
    run = _results.Run()
    if args.iters < 1 or args.repeats < 1:
        ap.error("--iters and --repeats must be >= 1")
    torch.set_num_threads(1)
    if not args.no_mallopt:
        keep_freed_memory()
    torch.manual_seed(0)
    prof, restore_op = profiled(args.repeats)
    cfg = layer_config()
    model = GPTModel(cfg, LAYERS, VOCAB)
    plain = plain_op_times(model, args.repeats)
    edges = edge_times(model, args.repeats)
    prob = problem_for(cfg, LAYERS, VOCAB, MBS)
    pols: dict[str, RecomputePolicy | None] = {"plain": None, "none": method_policy("none", prob),
                                               "full": method_policy("full", prob),
                                               "selective": method_policy("selective", prob),
                                               "lynx-like": lynx_like(model.layers[0].op_names)}
    res = run_policies(model, pols, args.iters)
    out: dict[str, Any] = {"profile_fwd_s": prof, "profile_restore_op_s": restore_op, "plain_op_s": plain,
                           "edges_s": edges, "policies": {}}
    _print_ops(model, pols, res, prof, plain, restore_op)
    print("outside the layers, ms: " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in edges.items())
          + " (embedding and head+loss per micro-batch, forward + backward; AdamW per step)")
    base = res["plain"]["iter_s"]
    print(f"\n{'policy':<11}{'iter s':>8}{'vs plain':>10}{'recompute s':>13}{'priced s':>10}{'extra s':>9}"
          f"{'faults/iter':>13}")
    for p, r in res.items():
        pol = pols[p]
        ops = [n for lp in pol.layers for n in lp.recomputed()] if pol is not None else []
        priced = MBS * sum(prof[n] + restore_op for n in ops)
        extra = r["iter_s"] - base - priced
        print(f"{p:<11}{r['iter_s']:8.3f}{r['iter_s'] / base:10.3f}{r['recompute_s']:13.3f}{priced:10.3f}"
              f"{extra:9.3f}{r['minor_faults']:13.0f}")
        out["policies"][p] = {k: v for k, v in r.items() if k != "engine"} | {"priced_s": priced}
    targets = _targets(res, out["policies"])
    if args.cprofile:
        for p, r in res.items():
            if r["engine"] is None:
                continue
            rows, total, n = cprofile_engine(model, r["engine"], 8)
            out["policies"][p]["cprofile_engine"] = {"rows": rows, "total_s": total, "restorations": n}
            print(f"\ncProfile, one iteration, {p}: engine.py {total * 1e3:.1f} ms for {n} restorations; "
                  + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    run.write(args.results, "engine_overhead", "measurement", "What the recompute engine's restorations cost "
              "against their price (CPU, one process)", _results.figures_of(targets), _plain(targets.summary()))
    return 0


def _targets(res: dict[str, dict[str, Any]], rows: dict[str, dict[str, Any]]) -> Targets:
    """What a recomputing policy adds over `none` costs what the plan prices (within 25%), and nothing leaks
    (under 1000 minor page faults per iteration: the engine leak fixed earlier caused ~50k)."""
    t = Targets()
    print("\ntargets:")
    for p, r in rows.items():
        if p in ("plain", "none"):
            continue
        added = res[p]["iter_s"] - res["none"]["iter_s"]
        ok = t.add(f"{p}: time added over none, s", abs(added - r["priced_s"]) <= 0.25 * r["priced_s"],
                   round(added, 3), f"priced {r['priced_s']:.3f} ± 25%")
        print(f"  {p:<11} added over none {added:.3f} s, priced {r['priced_s']:.3f} s (within 25%): {_plain(ok)}")
    for p, r in res.items():
        ok = t.at_most(f"{p}: minor faults per iteration < 1000", r["minor_faults"], 999)
        print(f"  {p:<11} minor faults per iteration {r['minor_faults']:.0f} (< 1000): {_plain(ok)}")
    print(_plain(t.summary()))
    return t


def _plain(text: str) -> str:
    return text.replace("[green]", "").replace("[/green]", "").replace("[red]", "").replace("[/red]", "")


def _print_ops(model: GPTModel, pols: dict[str, RecomputePolicy | None], res: dict[str, dict[str, Any]],
               prof: dict[str, float], plain: dict[str, float], restore_op: float) -> None:
    names = [p for p in pols if p != "plain"]
    print(f"engine overhead per restoration measured by lynx profile: {1e3 * restore_op:.3f} ms")
    print(f"{'op':<16}{'profile ms':>11}{'plain ms':>10}" + "".join(f"{p + ' ms':>14}" for p in names)
          + "   (engine: median / mean per restoration)")
    for n in model.layers[0].op_names:
        cells = [f"{1e3 * res[p]['per_op_s'][n]:7.2f}/{1e3 * res[p]['per_op_mean_s'][n]:<6.2f}"
                 if n in res[p]["per_op_s"] else f"{'-':>14}" for p in names]
        print(f"{n:<16}{1e3 * prof[n]:11.2f}{1e3 * plain[n]:10.2f}" + "".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    raise SystemExit(main())
