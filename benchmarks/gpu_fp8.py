"""FP8 on a lent H100 / H200 (issue 33): the measurements lynx's FP8 model rests on, against what it predicts.

1. FP8 GEMM rates by shape: ``torch._scaled_mm`` (E4M3, per-tensor scales: what TransformerEngine's delayed and
   current scaling and torchao's tensorwise run; and with one scale per row, what torchao's rowwise runs, priced by
   lynx on the same curve, decision 0268) and the BF16 matmul on the weight GEMMs of Llama layers at TP 1-8, beside
   lynx's prediction (`KernelCurves.fp8_of` on the hardware preset). Target: each GEMM within +-15% of lynx's time.
2. Saved bytes (where TransformerEngine imports): a ``te.Linear`` under ``fp8_autocast`` with autograd's saved-tensor
   hooks; target: the input is kept as 1 byte per element (lynx's rule, `lynx.cost.fp8`), not 2.
3. The allocator's view (where TransformerEngine imports): a stack of FP8 ``te.Linear`` layers, the memory still
   allocated after the forward against lynx's rule (FP8 input copies + FP8 weight workspaces + the last output);
   target +-10%.

Without a CUDA device (or one without FP8 tensor cores, compute capability < 8.9) it says so, writes the reason to
the results file and exits 0.

Run: PYTHONPATH=src python benchmarks/gpu_fp8.py --out results.json [--hardware h100-80g-nvlink]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lynx.cost.kernels import KernelCurves
from lynx.spec import load_hardware

TARGET_GEMM = 0.15
TARGET_PEAK = 0.10
SHAPES = ((8192, 4096, 6144), (8192, 4096, 28672), (8192, 14336, 4096), (8192, 8192, 2560), (8192, 8192, 7168),
          (8192, 3584, 8192), (4096, 8192, 1280), (4096, 16384, 2304))
"""(tokens, in, out) of Llama 3 8B / 70B / 405B weight GEMMs (QKV, gate-up, down, projection) at TP 1, 4 and 8."""


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) < (8, 9):
        return f"{torch.cuda.get_device_name(0)} (sm_{major}{minor}) has no FP8 tensor cores"
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no _scaled_mm"
    return None


def _time(fn: Any, reps: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def gemm_rates(hw_name: str) -> list[dict[str, Any]]:
    import torch

    hw = load_hardware(hw_name)
    d = hw.device
    curves, fp8c = KernelCurves.of(d), KernelCurves.fp8_of(d)
    rows = []
    for m, k, n in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        t16 = _time(lambda a=a, b=b: a @ b.t())
        t8 = _time(lambda a8=a8, b8=b8, one=one: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                                 out_dtype=torch.bfloat16))
        # torchao's rowwise recipe: one fp32 scale per row of each operand (torch's row-wise scaled kernel)
        sa, sb = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
        try:
            trw: float | None = _time(lambda a8=a8, b8=b8, sa=sa, sb=sb: torch._scaled_mm(
                a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
        except RuntimeError:  # a torch without row-wise scaling on this device
            trw = None
        flops = 2.0 * m * k * n
        p16 = flops / (d.peak_flops * curves.gemm(m, k, n))
        p8 = flops / ((d.fp8_peak_flops or d.peak_flops) * fp8c.gemm(m, k, n))
        rows.append({"m": m, "k": k, "n": n, "bf16_tflops": flops / t16 / 1e12, "fp8_tflops": flops / t8 / 1e12,
                     "bf16_s": t16, "fp8_s": t8, "lynx_bf16_s": p16, "lynx_fp8_s": p8,
                     "fp8_error": p8 / t8 - 1, "holds": abs(p8 / t8 - 1) <= TARGET_GEMM,
                     # lynx prices torchao's rowwise GEMM on the same FP8 curve (lynx.cost.float8_torchao)
                     "fp8_rowwise_s": trw, "fp8_rowwise_error": None if trw is None else p8 / trw - 1})
    return rows


def te_checks() -> dict[str, Any]:
    """Saved bytes of one FP8 te.Linear, and the allocator's held bytes after a stack's forward."""
    try:
        import torch
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling, Format
    except ImportError as e:
        return {"skipped": f"transformer_engine does not import ({e})"}
    tokens, h, layers = 8192, 4096, 8
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    lin = te.Linear(h, h, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.untyped_storage().nbytes() if hasattr(t, "untyped_storage") else t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), te.fp8_autocast(enabled=True,
                                                                                       fp8_recipe=recipe):
        lin(x, is_first_microbatch=True)
    stack = [te.Linear(h, h, bias=False, params_dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = x
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
        for layer in stack:
            y = layer(y, is_first_microbatch=True)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    # lynx's rule: each layer keeps its input's FP8 copy (1 byte) and an FP8 weight workspace (row-wise +
    # transposed, 2 bytes per weight); the last output is 16-bit
    expect = layers * (tokens * h * 1.0 + 2.0 * h * h) + 2.0 * tokens * h
    return {"saved_tensor_bytes": sizes, "input_elements": tokens * h,
            "input_kept_fp8": any(abs(s - tokens * h) <= 0.01 * tokens * h for s in sizes)
            and not any(abs(s - 2 * tokens * h) <= 0.01 * tokens * h for s in sizes),
            "held_bytes": held, "lynx_bytes": expect, "held_error": expect / held - 1,
            "holds": abs(expect / held - 1) <= TARGET_PEAK}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hardware", default="h100-80g-nvlink")
    a = ap.parse_args()
    meta = {"command": "gpu_fp8.py", "machine": platform.node(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"), "hardware": a.hardware}
    why = _skip_reason()
    if why is not None:
        print(f"gpu_fp8: skipped: {why}")
        a.out.write_text(json.dumps({**meta, "skipped": why}, indent=1) + "\n")
        return
    import torch

    t0 = time.perf_counter()
    rows = gemm_rates(a.hardware)
    print(f"{torch.cuda.get_device_name(0)}; lynx preset {a.hardware}")
    print(f"{'m':>6} {'k':>6} {'n':>6} {'BF16 TF/s':>10} {'FP8 TF/s':>9} {'FP8 s':>10} {'lynx FP8 s':>11} "
          f"{'error':>7}  target  holds  {'rowwise s':>10} {'rowwise err':>11}")
    for r in rows:
        rw = "-" if r["fp8_rowwise_s"] is None else f"{r['fp8_rowwise_s']:.2e}"
        rwe = "-" if r["fp8_rowwise_error"] is None else f"{100 * r['fp8_rowwise_error']:+.1f}%"
        print(f"{r['m']:>6} {r['k']:>6} {r['n']:>6} {r['bf16_tflops']:>10.0f} {r['fp8_tflops']:>9.0f} "
              f"{r['fp8_s']:>10.2e} {r['lynx_fp8_s']:>11.2e} {100 * r['fp8_error']:>+6.1f}%  "
              f"±{100 * TARGET_GEMM:.0f}%  {'yes' if r['holds'] else 'NO':>5}  {rw:>10} {rwe:>11}")
    te_res = te_checks()
    if "skipped" in te_res:
        print(f"saved bytes and allocator peak: skipped: {te_res['skipped']}")
    else:
        print(f"te.Linear keeps its input as FP8 (1 byte per element): {te_res['input_kept_fp8']} "
              f"(saved tensors {te_res['saved_tensor_bytes']})")
        print(f"held after an 8-layer FP8 forward: {te_res['held_bytes'] / 2**20:.1f} MiB, lynx's rule "
              f"{te_res['lynx_bytes'] / 2**20:.1f} MiB ({100 * te_res['held_error']:+.1f}%, target "
              f"±{100 * TARGET_PEAK:.0f}%): {'yes' if te_res['holds'] else 'NO'}")
    a.out.write_text(json.dumps({**meta, "device": torch.cuda.get_device_name(0), "gemms": rows, "te": te_res,
                                 "seconds": time.perf_counter() - t0}, indent=1, default=float) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
