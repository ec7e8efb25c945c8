"""On a GPU: Megatron-Core's eager memory-bound ops (the code paths its `--no-*-fusion` flags select) timed against
lynx's eager prices (`lynx.families.fusion`), and the same functions compiled into fused kernels (torch.compile,
what Megatron-Core's `jit_fuser` is on current torch) against lynx's fused prices.

Shapes: the H100 session's (2026-11-23) Llama-3-8B layer (h 4096, 32 heads, 8 query groups, FFN 14336, s 4096,
micro-batch 1, TP 1) for SwiGLU, RoPE and RMSNorm (the eager fp32 composite of
`norm_fusion: false`); its GPT-1.3B layer (h 2048, 16 heads, s 2048, micro-batch 4) for the
causal masked softmax and bias + dropout + residual. bf16, CUDA events, median of `--repeats` after warm-ups.
Prints one table: measured ms forward / backward beside lynx's price on the H100 preset, and measured /
predicted. Target (stated, not fitted): eager within a factor 2 of lynx's eager price.
Without CUDA it prints "not measured" and exits 0.

    python benchmarks/gpu_eager_ops.py [--repeats 20] [--no-compile] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _results  # noqa: E402


def _ops(torch: Any) -> dict[str, tuple[Callable[..., Any], Callable[[], tuple[Any, ...]]]]:
    """name -> (function as Megatron-Core's unfused path computes it, inputs maker)."""
    F = torch.nn.functional
    dev, bf = "cuda", torch.bfloat16
    s8, f8, d = 4096, 14336, 128

    def swiglu(x: Any) -> Any:  # megatron/core/transformer/mlp.py glu
        a, b = torch.chunk(x, 2, dim=-1)
        return F.silu(a) * b

    def rope(t: Any, cos: Any, sin: Any) -> Any:  # rope_utils._apply_rotary_pos_emb_bshd with _rotate_half
        x1, x2 = torch.chunk(t, 2, dim=-1)
        return t * cos + torch.cat((-x2, x1), dim=-1) * sin

    def rmsnorm(x: Any, w: Any) -> Any:  # torch's F.rms_norm composite (the CPU build; CUDA before torch 2.8)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w).type_as(x)

    def softmax(x: Any, mask: Any) -> Any:  # FusedScaleMaskSoftmax.forward_torch_softmax (mask in place)
        x = x.masked_fill(mask, -10000.0)
        return torch.nn.Softmax(dim=-1)(x)

    def bda(x: Any, bias: Any, residual: Any) -> Any:  # fused_bias_dropout._bias_dropout_add_func, unfused
        return residual + F.dropout(x + bias, p=0.1, training=True)

    s1, b1, h1, a1 = 2048, 4, 2048, 16
    return {
        "swiglu": (swiglu, lambda: (torch.randn(s8, 2 * f8, device=dev, dtype=bf, requires_grad=True),)),
        "rope": (rope, lambda: (torch.randn(s8, 1, 40, d, device=dev, dtype=bf, requires_grad=True),
                                torch.randn(s8, 1, 1, d, device=dev, dtype=bf),
                                torch.randn(s8, 1, 1, d, device=dev, dtype=bf))),
        "rmsnorm1": (rmsnorm, lambda: (torch.randn(s8, 4096, device=dev, dtype=bf, requires_grad=True),
                                       torch.ones(4096, device=dev, dtype=bf, requires_grad=True))),
        "softmax": (softmax, lambda: (torch.randn(b1 * a1, s1, s1, device=dev, dtype=bf, requires_grad=True),
                                      torch.ones(s1, s1, device=dev, dtype=torch.bool).triu(1))),
        "attn_residual": (bda, lambda: (torch.randn(s1 * b1, h1, device=dev, dtype=bf, requires_grad=True),
                                        torch.randn(h1, device=dev, dtype=bf, requires_grad=True),
                                        torch.randn(s1 * b1, h1, device=dev, dtype=bf, requires_grad=True))),
    }


def _time(torch: Any, fn: Callable[..., Any], make: Callable[[], tuple[Any, ...]], repeats: int) -> tuple[float, float]:
    args = make()
    fwd, bwd = [], []
    for i in range(repeats + 3):
        s, m, e = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        s.record()
        y = fn(*args)
        m.record()
        y.backward(torch.ones_like(y))
        e.record()
        torch.cuda.synchronize()
        for a in args:
            a.grad = None
        if i >= 3:
            fwd.append(s.elapsed_time(m))
            bwd.append(m.elapsed_time(e))
    return statistics.median(fwd), statistics.median(bwd)


def lynx_prices() -> dict[str, tuple[float, float, float, float]]:
    from lynx.cost.layer import build_layer_graph
    from lynx.models import load_model
    from lynx.spec import ModelSpec, ParallelSpec, load_hardware

    eager = dict(bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
                 apply_rope_fusion=False, norm_fusion=False)
    hw = load_hardware("h100-80g-nvlink")
    llama = (load_model("llama3-8b"), ParallelSpec(seq_length=4096, micro_batch_size=1))
    gpt = (ModelSpec("gpt-1.3b", 24, 2048, 16, attention="standard"),
           ParallelSpec(seq_length=2048, micro_batch_size=4, global_batch_size=4))
    out = {}
    for op, (model, par) in {"swiglu": llama, "rope": llama, "rmsnorm1": llama, "softmax": gpt,
                                    "attn_residual": gpt}.items():
        a = build_layer_graph(model, hw, par).op(op)
        b = build_layer_graph(replace(model, **eager), hw, par).op(op)
        out[op] = (a.fwd_time * 1e3, a.bwd_time * 1e3, b.fwd_time * 1e3, b.bwd_time * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd (fused) rows")
    ap.add_argument("--out", type=Path)
    _results.add_option(ap, "gpu_eager_ops")
    a = ap.parse_args()
    run = _results.Run()
    figures: list[_results.Figure] = []
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: not measured")
        return
    prices = lynx_prices()
    rows: list[dict[str, Any]] = []
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print("| op | kind | measured fwd / bwd ms | lynx fwd / bwd ms | measured / lynx | target | holds |")
    print("|---|---|---|---|---|---|---|")
    for name, (fn, make) in _ops(torch).items():
        kinds = [("eager", fn)] + ([] if a.no_compile else [("compiled", torch.compile(fn))])
        for kind, f in kinds:
            mf, mb = _time(torch, f, make, a.repeats)
            pf, pb = prices[name][2:] if kind == "eager" else prices[name][:2]
            rf, rb = mf / pf, mb / pb
            ok = kind != "eager" or (0.5 <= rf <= 2.0 and 0.5 <= rb <= 2.0)
            rows.append({"op": name, "kind": kind, "fwd_ms": mf, "bwd_ms": mb, "lynx_fwd_ms": pf, "lynx_bwd_ms": pb})
            target, holds = ("within 2x", "yes" if ok else "NO") if kind == "eager" else ("-", "-")
            figures.append(_results.Figure(f"{name} ({kind}): measured / lynx's price, fwd / bwd",
                                           f"{rf:.2f} / {rb:.2f}", "", "within 2x" if kind == "eager" else "",
                                           ok if kind == "eager" else None))
            print(f"| {name} | {kind} | {mf:.3f} / {mb:.3f} | {pf:.3f} / {pb:.3f} | {rf:.2f} / {rb:.2f} | "
                  f"{target} | {holds} |")
    if a.out:
        a.out.write_text(json.dumps(rows, indent=2))
    run.write(a.results, "gpu_eager_ops", "measurement", "Megatron-Core's unfused code paths on a GPU against "
              "lynx's eager and fused prices", figures)


if __name__ == "__main__":
    main()
