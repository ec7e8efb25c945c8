"""`lynx train --plan plan.json`: run a plan on torch.distributed (needs torch; see lynx.runtime.train)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, cast

import typer

from lynx.cli.app import app
from lynx.errors import SpecError


def check_trainable(plan: Path) -> None:
    """The plan file read and validated against its hardware before torch is imported (`lynx.plan.load_plan`:
    one line naming the file and field), and refused when the runtime cannot run it: it builds TP x PP x DP
    layers, so a plan with context parallelism is for planning and export."""
    from lynx.plan import load_plan

    problem, _ = load_plan(plan)
    if problem.model.fp8 is not None:
        raise SpecError(f"{plan}: the plan prices FP8 linear layers (TransformerEngine on an FP8 GPU); lynx train runs "
                        "16-bit layers only (export it: lynx export megatron)")
    opt = problem.options.optimizer_precision
    if not opt.is_default:
        raise SpecError(f"{plan}: the plan prices Megatron's {opt.describe()}; lynx train keeps torch AdamW's fp32 "
                        "gradients and state, so its static memory would not be the plan's (plan without those flags "
                        "to train here, or export it: lynx export megatron)")
    cp = problem.parallel.cp
    if cp != 1:
        raise SpecError(f"{plan}: the plan uses context parallelism (cp {cp}); lynx train runs TP x PP x DP only "
                        "(plan and export it: lynx export megatron|torchtitan)")


@app.command("train")
def train_cmd(
    plan: Annotated[Path, typer.Option("--plan", help="A plan file from `lynx plan --out`.")],
    iters: Annotated[int, typer.Option(help="Timed iterations.")] = 5,
    warmup: Annotated[int, typer.Option(help="Untimed iterations first.")] = 1,
    data: Annotated[Path | None, typer.Option(help="Text file: byte-level tokens (default synthetic).")] = None,
    out: Annotated[Path | None, typer.Option(help="Write the report (JSON) here.")] = None,
    timeout: Annotated[float, typer.Option(help="Process-group timeout in seconds.")] = 60.0,
    threads: Annotated[int, typer.Option(help="torch threads per rank (0: default).")] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
    precision: Annotated[str, typer.Option(
        help="fp32, or megatron-bf16: bf16 autocast with fp32 master weights, gradients and AdamW state "
             "(Megatron-Core's --bf16; lynx plan --precision names the same recipe).")] = "fp32",
    backend: Annotated[str, typer.Option(
        help="auto (nccl on cuda, gloo on cpu), nccl or gloo; gloo on cuda runs the pipeline's p2p through "
             "host memory, so several ranks can share one GPU.")] = "auto",
    host_staged: Annotated[bool, typer.Option("--host-staged", hidden=True)] = False,
    seed: Annotated[int, typer.Option(help="Model and data seed.")] = 1234,
    core_attn: Annotated[bool, typer.Option("--core-attn", help="Use scaled_dot_product_attention.")] = False,
    quiet: Annotated[bool, typer.Option(
        "--quiet", help="Print no per-iteration lines and no summary (errors still go to stderr).")] = False,
    schedule: Annotated[Path | None, typer.Option(
        help="PP > 1: action list to run (compute-only CSV, a row per pipeline rank; default 1F1B).")] = None,
    trace: Annotated[Path | None, typer.Option(help="PP > 1: write the last iteration's Chrome trace here.")] = None,
    compare_trace: Annotated[bool, typer.Option(
        "--compare-trace", help="PP > 1: print the trace beside the simulator's timeline (needs --trace).")] = False,
) -> None:
    """Train a plan for N iterations with its recomputation policy; report time, loss, activation memory
    and on-demand versus windowed recomputation per iteration. TP>1 spawns local ranks on 127.0.0.1
    unless launched by torchrun. PP > 1 or DP > 1 plans run on the pipeline runtime (TP x PP x DP ranks,
    spawned locally or one per torchrun process)."""
    if device not in ("auto", "cpu", "cuda"):
        raise SpecError(f"--device {device!r}: expected auto, cpu or cuda")
    if backend not in ("auto", "nccl", "gloo"):
        raise SpecError(f"--backend {backend!r}: expected auto, nccl or gloo")
    if dtype not in ("float32", "bfloat16"):
        raise SpecError(f"--dtype {dtype!r}: expected float32 or bfloat16")
    if precision not in ("fp32", "megatron-bf16"):
        raise SpecError(f"--precision {precision!r}: expected fp32 or megatron-bf16 (megatron-fp16 needs loss "
                        f"scaling, which lynx train does not implement)")
    if compare_trace and trace is None:
        raise SpecError("--compare-trace needs --trace FILE (the measured timeline to compare)")
    check_trainable(plan)
    from lynx.runtime.config import Backend, Device, Dtype, Precision
    from lynx.runtime.train import TrainConfig, launch  # lynx.runtime quiets torch's C++ logs before torch loads

    # the choices were checked above, one line each
    launch(TrainConfig(plan=str(plan), iters=iters, warmup=warmup, data=None if data is None else str(data),
                       out=None if out is None else str(out), timeout=timeout, threads=threads,
                       device=cast(Device, device), dtype=cast(Dtype, dtype), precision=cast(Precision, precision),
                       backend=cast(Backend, backend), seed=seed, host_staged=host_staged, core_attn=core_attn,
                       quiet=quiet,
                       schedule=None if schedule is None else str(schedule),
                       trace=None if trace is None else str(trace), compare_trace=compare_trace))
