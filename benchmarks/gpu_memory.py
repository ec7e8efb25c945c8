"""The CUDA allocator against lynx's activation-memory prediction (needs a GPU).

    python benchmarks/gpu_memory.py [--hidden 2048 --heads 16 --seq 2048 --micro-batch 4 --layers 4]

For a stack of runtime transformer layers (GPT, and LLaMA with --family llama) in bf16 on one GPU, and for
each policy (none, selective, full, uniform, block, and lynx planned for the same shape), one micro-batch's
forward and backward run through the `RecomputeEngine`. Measured with `torch.cuda.memory_allocated` /
`max_memory_allocated`, relative to the allocation before the forward (parameters; their gradients are
freed before each pass):

- held after forward = allocated after the forward - before - the output (the next stage's input; the
  stage's own input, which the engine holds as layer 0's checkpoint, is counted);
- peak = max allocated over forward and backward - before - the parameters' gradients (which backward
  allocates and the planner counts as static memory, not activations).

Against `predicted_activation_bytes` (the planner's `lynx.cost.memory` on the graph rescaled to bf16): held after
forward and the peak held including what backward restores. Target: held after forward within 5% of the
prediction. The allocator's peak also holds backward's transient buffers, which the planner's stage peak
covers with a gradient workspace (`lynx.cost.memory.grad_workspace_bytes`, twice the largest activation): the
column "pred + workspace" is that sum; it is reported, not judged (docs/results.md, `restoration_peaks` judges it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import _results
from _markdown import Out
from _targets import Targets
from rich.table import Table


def measure(family: str, hidden: int, heads: int, seq: int, mb: int, layers: int, device: str) -> list[dict]:
    import torch
    from _harness import method_policy, problem_for

    from lynx.cost.memory import grad_workspace_bytes
    from lynx.runtime.engine import RecomputeEngine
    from lynx.runtime.layers.gpt import GPTLayer, LayerConfig
    from lynx.runtime.predict import predicted_activation_bytes, runtime_graph

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    if family == "llama":
        from lynx.runtime.layers.llama import LlamaConfig, LlamaLayer

        cfg: object = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_query_groups=max(1, heads // 4),
                                  ffn_hidden_size=int(hidden * 3.5) // 64 * 64, seq_length=seq, micro_batch_size=mb,
                                  dtype=torch.bfloat16, num_layers=layers)
        stack = torch.nn.ModuleList(LlamaLayer(cfg, None, layer_index=i, device=dev) for i in range(layers))
    else:
        cfg = LayerConfig(hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=4 * hidden,
                          seq_length=seq, micro_batch_size=mb, dtype=torch.bfloat16, num_layers=layers)
        stack = torch.nn.ModuleList(GPTLayer(cfg, None, layer_index=i, device=dev) for i in range(layers))
    prob = problem_for(cfg, layers, 32000, 1, hardware="h100-80g-nvlink", recompute_num_layers=max(1, layers // 2))
    graph = runtime_graph(prob.graph, torch.bfloat16)
    methods = ["none", "selective", "full", "uniform", "block", "lynx"]
    if family == "llama":
        methods.remove("selective")  # flash attention: selective frees nothing (decision 0034)
    grad_bytes = sum(p.numel() * p.element_size() for p in stack.parameters())
    rows = []
    for m in methods:
        pol = method_policy(m, prob)
        eng = RecomputeEngine(list(stack), pol)
        reps = []
        for _ in range(2):  # the first pass warms the allocator and the kernels; both are reported
            for p in stack.parameters():
                p.grad = None
            alloc = torch.cuda.memory_allocated if cuda else (lambda: 0)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            before = alloc()  # the stage input below is held by the engine (layer 0's checkpoint): counted
            x = torch.randn(seq, mb, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
            y = eng.forward(x, 0)
            after = alloc() - before - y.numel() * y.element_size()
            y.backward(torch.ones_like(y))
            eng.end_step()
            peak = (torch.cuda.max_memory_allocated() if cuda else 0) - before - grad_bytes
            del y
            left = alloc() - before - grad_bytes - 2 * x.numel() * x.element_size()  # besides grads, x, x.grad
            del x
            reps.append({"before": before, "after_fwd": after, "peak": peak, "left_after_step": left})
        pred_after, pred_peak = predicted_activation_bytes(graph, pol, cfg, in_flight=1)
        workspace = grad_workspace_bytes(graph)  # the stage peak's gradient buffers (lynx.cost.memory)
        rows.append({"family": family, "method": m, "held_after_fwd_bytes": reps[-1]["after_fwd"],
                     "peak_bytes": reps[-1]["peak"], "engine_peak_bytes": eng.stats.peak_bytes,
                     "predicted_after_fwd_bytes": pred_after, "predicted_peak_bytes": pred_peak,
                     "predicted_grad_workspace_bytes": workspace, "reps": reps})
    return rows


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--families", nargs="+", default=["gpt", "llama"], choices=("gpt", "llama"))
    ap.add_argument("--device", default="cuda", help="cpu only smoke-tests the script (no allocator figures)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--markdown", action="store_true")
    _results.add_option(ap, "gpu_memory")
    a = ap.parse_args()
    run_results = _results.Run()
    for name in ("hidden", "heads", "seq", "micro_batch", "layers"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be at least 1")
    if a.hidden % a.heads or (a.heads % 4 and "llama" in a.families):
        ap.error(f"--hidden {a.hidden} must be a multiple of --heads {a.heads} (and --heads of 4 for llama's groups)")
    if a.device not in ("cuda", "cpu"):
        ap.error(f"--device {a.device}: expected cuda or cpu")
    if a.out is not None and not a.out.resolve().parent.is_dir():
        ap.error(f"--out {a.out}: directory {a.out.resolve().parent} does not exist")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_memory: needs a CUDA device")
    rows = [r for f in a.families for r in measure(f, a.hidden, a.heads, a.seq, a.micro_batch, a.layers, a.device)]
    mib = 2**20
    targets = Targets()
    t = Table(title=f"CUDA allocator vs prediction, {a.layers} layers h{a.hidden} s{a.seq} b{a.micro_batch} bf16, "
                    f"{torch.cuda.get_device_name(0) if a.device == 'cuda' else 'cpu'}")
    for c in ("family", "policy", "held after fwd MiB (alloc / pred)", "peak MiB (alloc / pred)",
              "pred + workspace MiB", "engine peak MiB", "pass 1: after fwd / peak / left", "target", "holds"):
        t.add_column(c, justify="right")
    for r in rows:
        pred, got = r["predicted_after_fwd_bytes"], r["held_after_fwd_bytes"]
        t.add_row(r["family"], r["method"], f"{got / mib:.1f} / {pred / mib:.1f}",
                  f"{r['peak_bytes'] / mib:.1f} / {r['predicted_peak_bytes'] / mib:.1f}",
                  f"{(r['predicted_peak_bytes'] + r['predicted_grad_workspace_bytes']) / mib:.1f}",
                  f"{r['engine_peak_bytes'] / mib:.1f}",
                  " / ".join(f"{r['reps'][0][k] / mib:.1f}" for k in ("after_fwd", "peak", "left_after_step")),
                  "within 5%",
                  targets.add(f"{r['family']} {r['method']} held after forward within 5%",
                                abs(got - pred) <= 0.05 * max(pred, 1.0)))
    con = Out(a.markdown)
    con.print(t)
    con.print(targets.summary())
    run_results.write(a.results, "gpu_memory", "measurement",
                      "The CUDA allocator against lynx's activation-memory prediction (GPU)",
                      _results.figures_of(targets), targets.summary())
    if a.out:
        name = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
        a.out.write_text(json.dumps({"device": name, "torch": torch.__version__,
                                     "argv": sys.argv, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
