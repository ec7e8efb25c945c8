"""The allocator's peaks measured on one H100 (2026-11-23; `git show 44d9795:docs/benchmarks.md`, section 9)
against lynx's activation peak before and after counting the restoration's working set (`lynx.cost.lifetime`,
`transient`).

No GPU needed: the measured figures are the H100 session's (`benchmarks/gpu_memory.py`, four layers, h 2048, 16 heads,
s 2048, micro-batch 4, bf16); the predictions are recomputed here. Columns: the allocator's peak, the
prediction sampled after the frees (the engine's ledger) and with the transient, each plus the gradient
workspace (`lynx.cost.memory.grad_workspace_bytes`), and allocator / prediction. Target: 1.00 or below (the
allocator never above the plan); run `python restoration_peaks.py` from benchmarks/.
"""

from __future__ import annotations

MEASURED_MIB = {  # the H100 session of 2026-11-23, "peak, allocator MiB" (git history)
    ("gpt", "none"): 8680.3, ("gpt", "selective"): 4840.3, ("gpt", "full"): 3528.1, ("gpt", "uniform"): 5256.2,
    ("gpt", "block"): 5096.0, ("llama", "none"): 2798.2, ("llama", "full"): 1388.6, ("llama", "uniform"): 1869.1,
    ("llama", "block"): 1693.1,
}


def main() -> None:
    import argparse

    import _results
    import torch
    from _harness import method_policy, problem_for

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _results.add_option(ap, "restoration_peaks")
    a = ap.parse_args()
    run = _results.Run()
    figures: list[_results.Figure] = []

    from lynx.cost.memory import grad_workspace_bytes
    from lynx.cost.memory import predicted_activation_bytes as predict
    from lynx.runtime.layers.gpt import LayerConfig
    from lynx.runtime.layers.llama import LlamaConfig
    from lynx.runtime.predict import as_executed, runtime_extra_bytes, runtime_graph

    hidden, heads, seq, mb, layers = 2048, 16, 2048, 4, 4
    mib = float(1 << 20)
    print("| family | policy | allocator MiB | after frees + workspace MiB | ratio | transient + workspace MiB "
          "| ratio | target | holds |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for fam in ("gpt", "llama"):
        cfg: object
        if fam == "llama":
            cfg = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_query_groups=heads // 4,
                              ffn_hidden_size=int(hidden * 3.5) // 64 * 64, seq_length=seq, micro_batch_size=mb,
                              dtype=torch.bfloat16, num_layers=layers)
        else:
            cfg = LayerConfig(hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=4 * hidden,
                              seq_length=seq, micro_batch_size=mb, dtype=torch.bfloat16, num_layers=layers)
        prob = problem_for(cfg, layers, 32000, 1, hardware="h100-80g-nvlink", recompute_num_layers=layers // 2)
        g = runtime_graph(prob.graph, torch.bfloat16)
        ws = grad_workspace_bytes(g)
        for (f, m), got in MEASURED_MIB.items():
            if f != fam:
                continue
            pol = as_executed(method_policy(m, prob))
            ln = [float(runtime_extra_bytes(cfg, lp.keep)) for lp in pol.layers]
            per_op = {n: float(runtime_extra_bytes(cfg, frozenset({n}))) for n in g.names}
            per_op = {n: b for n, b in per_op.items() if b}
            old = (predict(g, pol.layers, ln, 1, False, per_op)[1] + ws) / mib
            new = (predict(g, pol.layers, ln, 1, False, per_op, transient=True)[1] + ws) / mib
            print(f"| {fam} | {m} | {got:.1f} | {old:.1f} | {got / old:.3f} | {new:.1f} | {got / new:.3f} "
                  f"| <= 1.00 | {'yes' if got <= new else 'NO'} |")
            figures.append(_results.Figure(f"{fam} {m}: allocator peak / predicted peak (transient + workspace, "
                                           f"{new:.1f} MiB)", round(got / new, 3), "", "<= 1.00", got <= new, got))
    run.write(a.results, "restoration_peaks", "prediction", "The planner's stage peak against the CUDA allocator's "
              "(one H100, measured peaks)", figures, notes=(
                  "The reference column is the allocator's peak in MiB, measured on one H100 on 2026-11-23. Not "
                  "explained yet: the ops' own temporaries, the gradient buffers of the backward that triggers an "
                  "on-demand restore, or the engine's captured saved tensors; telling which needs "
                  "torch.cuda.memory_snapshot() on a GPU.",))


if __name__ == "__main__":
    main()
