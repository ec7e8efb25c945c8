"""Activation memory of the testbed model (docs/results.md, `testbed_experiment`) per policy: the recompute engine's
measured peak against `lynx.runtime.predict.predicted_activation_bytes`, without the shaped link (memory does
not depend on it). Two gloo ranks on 127.0.0.1, TP 2, float32, PP 1, 2 micro-batches.

    python benchmarks/testbed_memory.py [--json benchmarks/results/raw/testbed_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from pathlib import Path

import _results

LAYERS, VOCAB, MBS = 4, 1024, 2



def _policies(cfg):  # type: ignore[no-untyped-def]
    from _harness import method_policy, problem_for

    from lynx.decisions import LayerPolicy, Phase, RecomputePolicy

    prob2 = problem_for(cfg, LAYERS, VOCAB, MBS, recompute_num_layers=2)
    out = {m: method_policy(m, prob2) for m in ("none", "selective", "full")}
    out["uniform(2)"] = method_policy("uniform", prob2)
    out["block(2)"] = method_policy("block", prob2)
    # the plan lynx chose on the testbed (docs/results.md, `testbed_experiment`)
    lp = LayerPolicy(keep=frozenset({"softmax", "attn_residual", "mlp_residual"}),
                     recompute=(("ln1", Phase.BWD_ATTN), ("qkv", Phase.BWD_ATTN), ("attn_dropout", Phase.ON_DEMAND),
                                ("attn_context", Phase.ON_DEMAND), ("ln2", Phase.BWD_MLP), ("fc1", Phase.BWD_MLP),
                                ("gelu", Phase.ON_DEMAND)))
    out["lynx (testbed plan)"] = RecomputePolicy(method="lynx", layers=(lp,) * LAYERS)
    return out


def _worker(rank: int, port: int, outdir: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from _harness import problem_for, train_step

    from lynx.runtime.engine import RecomputeEngine
    from lynx.runtime.layers.gpt import LayerConfig
    from lynx.runtime.layers.gpt_model import GPTModel
    from lynx.runtime.predict import predicted_activation_bytes, runtime_graph

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    cfg = LayerConfig(hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048, seq_length=256,
                      micro_batch_size=2, tp=2)
    graph = runtime_graph(problem_for(cfg, LAYERS, VOCAB, MBS).graph, cfg.dtype)
    res = {}
    for name, pol in _policies(cfg).items():
        torch.manual_seed(0)
        model = GPTModel(cfg, LAYERS, VOCAB, dist.group.WORLD)
        eng = RecomputeEngine(model.layers, pol)
        train_step(model, MBS, eng, in_flight=1)
        after, peak = predicted_activation_bytes(graph, pol, cfg, in_flight=1)
        res[name] = {"after_fwd_measured": max(eng.stats.fwd_end_bytes), "after_fwd_predicted": after,
                     "peak_measured": eng.stats.peak_bytes, "peak_predicted": peak}
    (Path(outdir) / f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    os._exit(0)  # gloo's destructors may abort a rank after a clean run (as lynx train)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    _results.add_option(ap, "testbed_memory")
    args = ap.parse_args()
    run = _results.Run()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(port, d), nprocs=2, join=True)
        res = json.loads((Path(d) / "rank0.json").read_text())
    mib = 2.0 ** 20
    print("| policy | after fwd MiB (meas / pred) | peak MiB (meas / pred) | meas / pred |")
    print("|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {r['after_fwd_measured'] / mib:.2f} / {r['after_fwd_predicted'] / mib:.2f} | "
              f"{r['peak_measured'] / mib:.2f} / {r['peak_predicted'] / mib:.2f} | "
              f"{r['peak_measured'] / r['peak_predicted']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    figures = [_results.Figure(f"{name}: activation peak held, measured by the engine (MiB)",
                               round(r["peak_measured"] / mib, 2), "", f"= predicted {r['peak_predicted'] / mib:.2f}",
                               abs(r["peak_measured"] - r["peak_predicted"]) <= 1e-6 * r["peak_predicted"])
               for name, r in res.items()]
    run.write(args.results, "testbed_memory", "measurement", "Activation memory on two gloo ranks: the engine "
              "against the lifetime model (bytes; they do not depend on the load)", figures)


if __name__ == "__main__":
    main()
