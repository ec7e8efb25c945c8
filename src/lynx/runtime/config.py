"""`lynx train`'s configuration, typed: what one training run does, built once at the edge (the `lynx train`
command, or the torchrun entry's argument parser) and read by every rank. Tests observe and disturb a run
through `TrainProbes`, a seam no command line reaches."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from lynx.runtime.pipeline import PipelineRunner

Device = Literal["auto", "cpu", "cuda"]
Dtype = Literal["float32", "bfloat16"]
Precision = Literal["fp32", "megatron-bf16"]
"""Named as `lynx plan --precision` names its recipes: fp32, or megatron-bf16 (Megatron-Core's `--bf16`: bf16
autocast over fp32 master weights, gradients and optimizer state). megatron-fp16 needs loss scaling, which this
runtime does not implement."""
Backend = Literal["auto", "nccl", "gloo"]
DEVICES: tuple[Device, ...] = ("auto", "cpu", "cuda")
DTYPE_NAMES: tuple[Dtype, ...] = ("float32", "bfloat16")
PRECISION_NAMES: tuple[Precision, ...] = ("fp32", "megatron-bf16")
BACKENDS: tuple[Backend, ...] = ("auto", "nccl", "gloo")

Probe = Callable[["PipelineRunner", int, int], None]
"""probe(runner, rank, iteration): a test's look at (or disturbance of) one rank's run."""


@dataclass(frozen=True, slots=True)
class TrainProbes:
    """Test seams: called on every rank; they must pickle (module-level classes or functions), since local
    ranks are spawned. Production runs have none."""

    before_iteration: Probe | None = None
    """Before the iteration's step (tests: a rank that dies or freezes in it)."""
    after_backward: Probe | None = None
    """After the iteration's backward, before the optimizer step (tests: the gradients a rank computed)."""


NO_PROBES = TrainProbes()


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    plan: str
    """The plan file (`lynx plan --out`)."""
    iters: int = 5
    """Timed iterations."""
    warmup: int = 1
    """Untimed iterations first."""
    data: str | None = None
    """A text file: byte-level tokens instead of synthetic ones."""
    seed: int = 1234
    lr: float = 1e-3
    out: str | None = None
    """Write the report (JSON) here (rank 0)."""
    timeout: float = 60.0
    """Process-group timeout, seconds: a dead or frozen peer fails the run within it."""
    threads: int = 0
    """torch intra-op threads per rank (0: torch's default)."""
    device: Device = "auto"
    dtype: Dtype = "float32"
    precision: Precision = "fp32"
    backend: Backend = "auto"
    """auto: NCCL on CUDA, gloo on the CPU; gloo on CUDA runs the pipeline's p2p through host memory."""
    host_staged: bool = False
    """p2p through host memory on the CPU too (the tests of that path)."""
    core_attn: bool = False
    """scaled_dot_product_attention as core_attn."""
    quiet: bool = False
    schedule: str | None = None
    """The action list to run (compute-only CSV, one row per pipeline rank); default 1F1B (interleaved with VPP)."""
    trace: str | None = None
    """Write the last iteration's timeline (Chrome trace)."""
    compare_trace: bool = False
    """Print the measured timeline beside the simulator's (needs `trace`)."""
    probes: TrainProbes = NO_PROBES

    def but(self, **changes: Any) -> TrainConfig:
        return replace(self, **changes)


def parser() -> argparse.ArgumentParser:
    """The torchrun entry's options (`python -m lynx.runtime.train`), the `lynx train` command's names."""
    p = argparse.ArgumentParser(prog="lynx.runtime.train", description="Train a plan on torch.distributed.")
    p.add_argument("--plan", required=True)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--data", default=None, help="a text file: byte-level tokens instead of synthetic ones")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default=None, help="write the report (JSON) here (rank 0)")
    p.add_argument("--timeout", type=float, default=60.0, help="process-group timeout, seconds")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads per rank (0: default)")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    p.add_argument("--precision", choices=PRECISION_NAMES, default="fp32",
                   help="fp32, or megatron-bf16: bf16 autocast with fp32 master weights, gradients and AdamW state")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="process groups: auto (NCCL on CUDA, gloo on CPU); gloo on CUDA runs the pipeline's "
                        "p2p through host memory (several ranks on one GPU)")
    p.add_argument("--host-staged", action="store_true", help=argparse.SUPPRESS)  # tests: that p2p on the CPU
    p.add_argument("--core-attn", action="store_true", help="scaled_dot_product_attention as core_attn")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--schedule", default=None,
                   help="the action list to run (compute-only CSV, one row per pipeline rank); "
                        "default 1F1B (interleaved with vpp > 1)")
    p.add_argument("--trace", default=None, help="write the last iteration's timeline (Chrome trace)")
    p.add_argument("--compare-trace", action="store_true",
                   help="print the measured timeline beside the simulator's (needs --trace)")
    return p


def parse(argv: list[str] | None = None, probes: TrainProbes = NO_PROBES) -> TrainConfig:
    """The configuration of a command line of the torchrun entry."""
    ns = parser().parse_args(argv)
    return TrainConfig(plan=ns.plan, iters=ns.iters, warmup=ns.warmup, data=ns.data, seed=ns.seed, lr=ns.lr,
                       out=ns.out, timeout=ns.timeout, threads=ns.threads, device=ns.device, dtype=ns.dtype,
                       precision=ns.precision, backend=ns.backend, host_staged=ns.host_staged,
                       core_attn=ns.core_attn, quiet=ns.quiet, schedule=ns.schedule, trace=ns.trace,
                       compare_trace=ns.compare_trace, probes=probes)
