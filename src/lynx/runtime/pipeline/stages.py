"""One pipeline stage (one chunk of one rank) as a module: the embedding on the first stage, a contiguous
slice of the model's layers run through a `RecomputeEngine` under that stage's policy, and the final
norm with the LM head on the last stage, for any model family: the layer config names its family, whose
runtime module gives the layer and the model's ends (`lynx.runtime.layers.ends`). Weights are drawn exactly
as the family's single-process model draws them, so a pipeline's stages together are that model (the
correctness tests compare them bit for bit).

The pipeline schedule calls `forward(x)`; the micro-batch and the micro-batches whose phase-1/2 work this
forward hosts are set just before by the schedule's forward function (`set_microbatch`), because
`PipelineStage` passes only tensors to the module.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, cast

import torch

from lynx.decisions import RecomputePolicy
from lynx.runtime.engine import RecomputeEngine
from lynx.runtime.fsdp import window_after_pre_backward
from lynx.runtime.layers import mtp
from lynx.runtime.layers.ends import lm_loss
from lynx.runtime.layers.family import runtime_of
from lynx.runtime.layers.tp import Group


@dataclass(frozen=True, slots=True)
class StageSpec:
    """What one virtual stage holds."""

    index: int
    num_stages: int
    first_layer: int
    num_layers: int
    policy: RecomputePolicy | None
    """None: no engine (every activation kept by autograd, the reference)."""

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


class StageModule(torch.nn.Module):
    def __init__(self, spec: StageSpec, cfg: Any, vocab_size: int, group: Group = None,
                 device: torch.device | str | None = None, seed: int = 1234, ep_group: Group = None) -> None:
        """`ep_group`: the expert-parallel group, for a family whose layer has experts (`RuntimeFamily.experts`)."""
        super().__init__()
        self.spec, self.cfg, self.group, self.seed = spec, cfg, group, seed
        family = runtime_of(cfg)
        self.ends = family.ends
        # the last stage's multi-token prediction (`lynx.runtime.layers.mtp`) embeds tokens: it holds the embedding
        # too, and the two copies' gradients are summed as a tied embedding's (`tied`)
        has_mtp = family.mtp is not None and bool(getattr(cfg, "mtp_layers", 0))
        self.ends.build(self, cfg, vocab_size, seed, spec.is_first or (spec.is_last and has_mtp), spec.is_last,
                        device)
        self.tied: tuple[str, ...] = self.ends.tied + (self.ends.first_params if has_mtp else ())
        """Parameters this stage shares with the other end of the pipeline: their gradients are summed."""
        self.batch: tuple[torch.Tensor, torch.Tensor] | None = None
        """With MTP on the last stage: the next forward's (tokens, labels), set by the schedule's forward hook."""
        self.mtp_grad_scale = 1.0
        """The weight of the main loss's backward (1 / micro-batches): the MTP loss's is the same."""
        # keyed by the global layer index: parameter names equal the model's ("layers.3.qkv.weight")
        extra = {"ep_group": ep_group} if family.experts else {}
        stack = [family.layer(cfg, group, layer_index=i, device=device, seed=seed, **extra)
                 for i in range(spec.first_layer, spec.first_layer + spec.num_layers)]
        self.layers = torch.nn.ModuleDict({str(layer.layer_index): cast(torch.nn.Module, layer) for layer in stack})
        self.engine = RecomputeEngine(stack, spec.policy) if spec.policy is not None and stack else None
        self.mtp: mtp.MultiTokenPrediction | None = family.mtp(cfg, group, device=device, seed=seed, **extra) \
            if has_mtp and spec.is_last and family.mtp is not None else None
        self.microbatch = 0
        self.autocast: torch.dtype | None = None
        """Mixed precision: the forward runs under autocast to this dtype, parameters stay as built (fp32
        master weights; `lynx train --precision megatron-bf16`). None: no autocast."""
        self.hosts: frozenset[int] = frozenset()
        self.sharded = False
        """Wrapped in FSDP2 (`lynx.runtime.fsdp.shard_stage`): each layer is called as a module, so FSDP's hooks
        run, and its call hands the step to the engine."""
        self.guest: tuple[RecomputeEngine, int] | None = None

    def set_microbatch(self, microbatch: int, hosts: Collection[int] = (),
                       guest: tuple[RecomputeEngine, int] | None = None) -> None:
        """The next forward's micro-batch, the micro-batches of this stage whose phase-1/2 work its windows
        host, and (engine, j) of another chunk's backward it hosts."""
        self.microbatch, self.hosts, self.guest = microbatch, frozenset(hosts), guest

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.autocast is None:
            return self._forward(x)
        dev = next(self.parameters()).device.type
        with torch.autocast(dev, dtype=self.autocast):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        mb = self.microbatch
        if self.spec.is_first:
            x = self.ends.embed(self, x, mb, self.group)
        if self.engine is not None and self.sharded:
            for li, layer in enumerate(self.layers.values()):
                x = layer(x, mb)
                window_after_pre_backward(self.engine, li, x, mb)
        elif self.engine is not None:
            x = self.engine.forward(x, mb, self.hosts, self.guest)
        else:
            for layer in self.layers.values():
                x = layer(x, mb)
        if self.spec.is_last:
            if self.mtp is not None:
                if self.batch is None:
                    raise RuntimeError("the last stage's multi-token prediction needs the micro-batch's tokens and "
                                       "labels (`StageModule.batch`, set by the runner) before its forward")
                tokens, labels = self.batch
                logits, extra = self.mtp.head(self, self.ends, x, tokens, labels, self.group, mb)
                out: torch.Tensor = mtp.AttachLoss.apply(logits, extra, self.mtp_grad_scale)  # type: ignore[no-untyped-call]
                return out
            return self.ends.head(self, x, self.group)
        return x

    def example_io(self, vocab_size: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Input and output of one micro-batch (shapes, dtypes, requires_grad) for a static PipelineStage."""
        c = self.cfg
        s_local = c.seq_length // (c.tp if c.sequence_parallel else 1)
        hidden = torch.empty(s_local, c.micro_batch_size, c.hidden_size, dtype=c.dtype, device=device)
        if self.spec.is_first:
            inp = torch.zeros(c.micro_batch_size, c.seq_length, dtype=torch.long, device=device)
        else:
            inp = hidden.clone().requires_grad_(True)
        if self.spec.is_last:
            # this TP rank's vocabulary shard of the logits (the head is vocabulary-parallel)
            v_local = vocab_size // (1 if self.group is None else torch.distributed.get_world_size(self.group))
            # under autocast the head's GEMM gives the logits in the autocast dtype
            out = torch.empty(c.seq_length, c.micro_batch_size, v_local, dtype=self.autocast or c.dtype,
                              device=device)
        else:
            out = hidden.clone()
        return inp, out.requires_grad_(True)


class HostStaged(torch.nn.Module):
    """A stage whose p2p runs through host memory (`--backend gloo` on CUDA: gloo sends and receives CPU
    tensors only; NCCL refuses two ranks on one GPU). The `PipelineStage` around this module lives on the
    host (`comm`): its receive buffers and what it sends are host tensors. The `StageModule` inside keeps its
    parameters, compute and `RecomputeEngine` on `compute`; the received activation is copied there at entry
    and the output back to the host at exit. Both copies are autograd ops, so the gradient from the next
    stage goes to the device the same way and the input gradient comes back to the host for sending.

    The last stage's output (the logits) stays on `compute`: the loss runs there, next to the labels, and no
    logits cross the bus. `copy=True` makes both copies real even when `compute` is the host (the CPU tests
    run this path with `--host-staged`)."""

    def __init__(self, inner: StageModule, compute: torch.device, comm: torch.device) -> None:
        super().__init__()
        self.inner, self.compute, self.comm = inner, compute, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.inner.spec.is_first:  # the first stage's tokens come from the batch, already on `compute`
            x = x.to(self.compute, copy=True)
        y: torch.Tensor = self.inner(x)
        return y if self.inner.spec.is_last else y.to(self.comm, copy=True)


def make_loss_fn(num_microbatches: int, record: list[float], group: Group = None) -> Any:
    """The last stage's loss: mean cross-entropy / num_microbatches (a single-process run backpropagates
    loss / m for each micro-batch; gradients are then equal without rescaling), over logits sharded by
    vocabulary over the TP `group`. Records each micro-batch's mean cross-entropy in `record`."""

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(logits, labels, group)
        record.append(float(loss.detach()))
        return loss / num_microbatches

    return loss_fn
