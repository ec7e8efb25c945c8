"""Every use of a private `torch.distributed.pipelining` API in lynx, in one place (decision 0053,
docs/decisions/).

lynx executes the plan's action list with `_PipelineScheduleRuntime`: it loads a compute-only CSV, lowers it
to sends and receives (`_add_send_recv`) and runs the rank's row. Two compute types are replaced by custom
functions (`register_custom_function`) that do what the runtime's own branches do (wait for the received
activation or gradient, `forward_one_chunk` / `backward_one_chunk`, the loss, local hand-over between
stages on one rank) and add what lynx needs around them: the micro-batch and the phase-1/2 hosts are handed
to the stage before its forward, cool-down recomputation runs *before* waiting for the next stage's
gradient, and each p2p wait is timed and, when it fails, re-raised naming the peer rank.

Tested with the torch versions in `TESTED_TORCH`; `check_torch()` refuses others with one line, and
tests/unit/test_runtime_torch_pipelining.py fails when any private name below disappears.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lynx.runtime.layers.tp import Group

TESTED_TORCH = ("2.11", "2.13")
"""major.minor versions this module was checked against: 2.13 here and in CI; 2.11 (the lent GPU machine's
torch) by the pipeline's CPU tests, which pass there (the lent H100 session of 2026-11-23;
`git show 44d9795:docs/benchmarks.md`, section 9)."""

PRIVATE_NAMES = ("_PipelineScheduleRuntime", "_Action", "_ComputationType", "_PipelineContext")


class TorchPipeliningError(RuntimeError):
    """torch changed underneath: the private API this module relies on is not there."""


def check_torch(version: str | None = None) -> None:
    v = version or torch.__version__
    if ".".join(v.split("+")[0].split(".")[:2]) not in TESTED_TORCH:
        raise TorchPipeliningError(
            f"torch {v}: lynx's pipeline runtime uses private torch.distributed.pipelining APIs and was tested "
            f"with torch {', '.join(TESTED_TORCH)} only (src/lynx/runtime/_torch_pipelining.py); re-check "
            f"schedules.py against it and extend TESTED_TORCH")
    from torch.distributed.pipelining import schedules

    missing = [n for n in PRIVATE_NAMES if not hasattr(schedules, n)]
    rt = getattr(schedules, "_PipelineScheduleRuntime", None)
    for attr in ("register_custom_function", "_load_csv", "_maybe_compute_loss", "_maybe_get_loss"):
        if rt is None or not hasattr(rt, attr):
            missing.append(f"_PipelineScheduleRuntime.{attr}")
    if missing:
        raise TorchPipeliningError(f"torch {v}: torch.distributed.pipelining lacks {', '.join(missing)}; "
                                   "src/lynx/runtime/_torch_pipelining.py must be updated")


class PeerError(RuntimeError):
    """A p2p wait failed: the message names the peer rank, the stage and the micro-batch."""


@dataclass
class Hooks:
    """What the schedule calls around each compute action of this rank (all optional).

    before_forward(stage, mb): set the stage module's micro-batch and hosts;
    before_grad_wait(stage, mb): cool-down recomputation, before waiting for the next stage's gradient;
    span(name, t0, t1, stage): timeline events ("F", "B", "wait ..."); stage None: the running action's.
    peer_rank(stage): the global rank that runs `stage` (for error messages)."""

    before_forward: Callable[[int, int], None] | None = None
    before_grad_wait: Callable[[int, int], None] | None = None
    span: Callable[[str, float, float, int | None], None] | None = None
    peer_rank: Callable[[int], int] | None = None
    timeout_s: float | None = None
    """Bound on each p2p wait (gloo's receive otherwise waits forever for a frozen peer)."""


def _wait(ops: list[Any], what: str, peer_stage: int, hooks: Hooks) -> None:
    t0 = time.perf_counter()
    try:
        for w in ops:  # what _wait_batch_p2p does, with a timeout
            if hooks.timeout_s is None:
                w.wait()
            elif w.wait(datetime.timedelta(seconds=hooks.timeout_s)) is False:
                raise TimeoutError(f"no answer within {hooks.timeout_s:g} s")
    except Exception as e:
        peer = hooks.peer_rank(peer_stage) if hooks.peer_rank else peer_stage
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PeerError(f"waiting for {what} from stage {peer_stage} (rank {peer}): {cause}") from None
    if hooks.span is not None:
        hooks.span(f"p2p wait {what}", t0, time.perf_counter(), None)


def receives_before_sends(order: list[Any]) -> list[Any]:
    """Post each receive as early as the rank's lowered action list allows: ahead of every send and compute
    action before it, never ahead of another receive.

    torch's lowering posts a rank's RECV_B(j) after its F(j + k) and SEND_F(j + k) (`0F2 0SEND_F2 0RECV_B1
    0B1`). Over gloo a send's data moves only once the receiver has posted the matching receive, and the
    receiver's notice travels on the same TCP connection behind its own outgoing message: the gradient then
    waited for the forward and for the whole activation to cross first (measured on the testbed: 168 ms
    instead of 84 for 1 MiB at 100 Mbit/s each way; decision 0060). The simulator, like NCCL,
    lets a transfer start when its sender is done. Receives keep their order among themselves (gloo matches
    them to sends in posting order) and posting is non-blocking: every wait stays where it was, inside the
    compute action that needs the data."""
    out = list(order)
    recvs = ("RECV_F", "RECV_B")
    for i in range(1, len(out)):
        j = i
        while j > 0 and out[j].computation_type.name in recvs and out[j - 1].computation_type.name not in recvs:
            out[j - 1], out[j] = out[j], out[j - 1]
            j -= 1
    return out


def build_schedule(stages: list[Any], num_microbatches: int, loss_fn: Callable[..., torch.Tensor],
                   csv_path: str, hooks: Hooks) -> Any:
    """A `_PipelineScheduleRuntime` over this rank's `stages` (PipelineStage objects) running the compute-only
    CSV at `csv_path`, with lynx's forward and backward functions. Gradients are not rescaled (the loss
    function divides by the number of micro-batches, as a single-process run does)."""
    check_torch()
    from torch.distributed.pipelining import schedules

    sched = schedules._PipelineScheduleRuntime(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)
    sched._load_csv(csv_path, format="compute_only")
    sched.pipeline_order_with_comms = {r: receives_before_sends(order)
                                       for r, order in sched.pipeline_order_with_comms.items()}
    by_index = {s.stage_index: s for s in stages}
    ctype = schedules._ComputationType

    def span(name: str, t0: float, stage: int) -> None:
        if hooks.span is not None:
            hooks.span(name, t0, time.perf_counter(), stage)

    def forward(action: Any, ctx: Any) -> None:
        s, mb = action.stage_index, action.microbatch_index
        stage = by_index[s]
        if not stage.is_first and s - 1 not in by_index:
            _wait(sched.fwd_recv_ops.pop((s, mb)), f"activations of micro-batch {mb}", s - 1, hooks)
        if hooks.before_forward is not None:
            hooks.before_forward(s, mb)
        t0 = time.perf_counter()
        out = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=False)
        sched._maybe_compute_loss(stage, out, ctx.target_mbs, mb)
        span(f"F{mb} stage {s}", t0, s)
        if s + 1 in by_index:
            by_index[s + 1].set_local_fwd_input(out, mb)

    def backward(action: Any, ctx: Any) -> None:
        s, mb = action.stage_index, action.microbatch_index
        stage = by_index[s]
        if hooks.before_grad_wait is not None:
            hooks.before_grad_wait(s, mb)
        if not stage.is_last and s + 1 not in by_index:
            _wait(sched.bwd_recv_ops.pop((s, mb)), f"gradient of micro-batch {mb}", s + 1, hooks)
        t0 = time.perf_counter()
        loss = sched._maybe_get_loss(stage, mb)
        sched.backward_counter[s] += 1
        stage.backward_one_chunk(mb, loss=loss, full_backward=True,
                                 last_backward=sched.backward_counter[s] == num_microbatches)
        span(f"B{mb} stage {s}", t0, s)
        if s - 1 in by_index:
            by_index[s - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)

    sched.register_custom_function(ctype.FORWARD, forward)
    sched.register_custom_function(ctype.FULL_BACKWARD, backward)
    return sched


def make_stage(module: torch.nn.Module, stage_index: int, num_stages: int, device: torch.device,
               example_input: torch.Tensor, example_output: torch.Tensor, group: Group) -> Any:
    """A `PipelineStage` (public API) with static shapes, so torch never runs the module for shape
    inference (which would run TP collectives and the recompute engine on dummy data)."""
    from torch.distributed.pipelining import PipelineStage

    return PipelineStage(module, stage_index, num_stages, device, input_args=(example_input,),
                         output_args=(example_output,), group=group)
