"""Apply a lynx plan to a Megatron-Core model chunk built by Megatron-Core (`GPTModel` from its local layer
spec): each `TransformerLayer` of the chunk runs its step of lynx's recompute engine
(`RecomputeEngine.forward_layer`) as its forward, a `MegatronLayer` over the layer's own modules, with the
plan's keep / recompute / offload decisions for that layer (by its global layer number) and the windows in
Megatron's own TP collectives.

The seam is the layer's ``forward`` (an instance attribute set here, removed by `remove`): Megatron's
TransformerBlock still calls each layer, under its own RNG fork and offloading contexts, and everything
Megatron wraps around the model (its DDP's gradient hooks, its pipeline schedules' p2p, `finalize_model_grads`)
runs unchanged; the forward pre-hooks on the linears the engine computes itself (where Megatron's DDP waits for
a bucket's parameter gather with ``overlap_param_gather``) are run by `MegatronLayer`. Megatron's DDP
collectives host no restoration: nothing waits for them before the backward ends (docs/decisions/0162). The
cool-down window of the 1F1B schedule opens through the schedule's own ``p2p_communicator`` argument
(`CooldownP2P`). A user adds two lines to the model provider (what
`lynx export megatron` writes): build the model as always, then ``apply_lynx_plan(model, "plan.json")``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lynx.export.source import ExportSource, load_source
from lynx.integrations.megatron import _fence
from lynx.integrations.megatron.check import check_layers, check_model, check_shape
from lynx.integrations.megatron.layer import MegatronLayer
from lynx.runtime.engine import EngineStats, RecomputeEngine

_UNSUPPORTED = ("context", "context_mask", "attention_bias", "inference_context", "packed_seq_params",
                "sequence_len_offset", "rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin", "inference_params")


def unwrap(model: Any) -> Any:
    """The GPTModel inside Megatron's wrappers (DDP, Float16Module: each keeps it as ``.module``)."""
    from megatron.core.models.gpt import GPTModel  # type: ignore[import-untyped]

    m = model
    for _ in range(8):
        if isinstance(m, GPTModel):
            return m
        m = getattr(m, "module", None)
    raise TypeError(f"lynx.integrations.megatron: {type(model).__name__} is not (a wrapper of) Megatron-Core's "
                    "GPTModel")


class LynxMegatron:
    """lynx's engine on one Megatron-Core model chunk (one pipeline stage, or one virtual stage)."""

    def __init__(self, model: Any, src: ExportSource, vp_stage: int | None = None) -> None:
        _fence.check_versions()
        from megatron.core import parallel_state as ps  # type: ignore[import-untyped]

        self.gpt = gpt = unwrap(model)
        check_model(src, gpt)
        self.src = src
        blocks = list(gpt.decoder.layers)
        pp = src.layout.pp
        rank = ps.get_pipeline_model_parallel_rank() if pp > 1 else 0
        v = (vp_stage or getattr(gpt, "vp_stage", None) or 0) * pp + rank
        check_layers(src, v, [int(b.layer_number) - 1 for b in blocks])
        graph = src.problem.graph
        names = graph.names
        inputs = {o.name: o.inputs for o in graph.ops}
        kinds = {o.name: o.block for o in graph.ops}
        self.blocks = blocks
        self.layers = [MegatronLayer(b, names, inputs, kinds) for b in blocks]
        pols = list(src.policies[v].layers)
        # Megatron moves the parameters after the model provider returns (Float16Module's cast, DDP's contiguous
        # buffers: `param.data` gets new storage), so their storages are read when each layer's step or
        # recomputation runs, never fixed here
        self.engine = RecomputeEngine(self.layers, pols, (),
                                      live_params=lambda li: self.layers[li].block_parameters())
        self.virtual_stage = v
        self._microbatch = 0
        self._fwd_order: list[int] = []
        self._backwards = 0
        self._checked_shape = False
        self.auto_step = True
        """Start a new step (micro-batch 0) when the chunk's first layer runs with nothing held for backward
        (Megatron's training loop never calls `end_step`)."""
        self._own = [b.forward for b in blocks]
        for li, b in enumerate(blocks):
            b.forward = self._step(li, self._own[li])

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def _step(self, li: int, own: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
            x = args[0] if args else kwargs["hidden_states"]
            layer = self.layers[li]
            if not torch.is_grad_enabled() or not layer.parts.layer.training:
                return own(*args, **kwargs)  # type: ignore[no-any-return]  # evaluation: nothing kept
            bad = [k for k in _UNSUPPORTED if kwargs.get(k) is not None]
            if bad or len(args) > 1:
                what = ", ".join(bad) or "positional arguments"
                raise TypeError(f"lynx.integrations.megatron: the layer was called with {what}; lynx's engine runs "
                                "decoder self-attention in training only")
            if li == 0:
                self._start_microbatch(x)
            mb = self._microbatch - 1
            layer.context[mb] = (kwargs.get("attention_mask"), kwargs.get("rotary_pos_emb"))
            layer.forwarding = (layer.layer_index, mb)
            try:
                out = self.engine.forward_layer(li, x, mb)
            finally:
                layer.forwarding = None
            return out, kwargs.get("context")
        return run

    def _start_microbatch(self, x: torch.Tensor) -> None:
        if self.auto_step and self.engine.idle():
            self.end_step()  # every backward of the last step ran: a new step starts here
        if not self._checked_shape:
            tp = self.src.problem.parallel.tp if self.gpt.config.sequence_parallel else 1
            check_shape(self.src, int(x.shape[0]) * tp, int(x.shape[1]))
            self._checked_shape = True
        self._fwd_order.append(self._microbatch)
        self._microbatch += 1

    def cooldown_next(self) -> int | None:
        """The next backward's micro-batch is about to wait for its gradient from the next stage: restore now
        what of it no forward window hosted (the cool-down stall). Returns that micro-batch."""
        if self._backwards >= len(self._fwd_order):
            return None
        mb = self._fwd_order[self._backwards]
        self._backwards += 1
        self.engine.cooldown(mb)
        return mb

    def end_step(self) -> None:
        """Forget the step's records (after its last backward); the next forward is micro-batch 0."""
        self.engine.end_step()
        self._microbatch, self._fwd_order, self._backwards = 0, [], 0
        for layer in self.layers:
            layer.end_step()

    def remove(self) -> None:
        """Give the layers their own forward back."""
        for b in self.blocks:
            if "forward" in vars(b):
                del b.forward


def apply_lynx_plan(model: Any, plan: str | Path | ExportSource, vp_stage: int | None = None) -> LynxMegatron:
    """Run `model`'s layers (a Megatron-Core GPTModel chunk, possibly wrapped by DDP / Float16Module) under the
    plan (a plan file written by `lynx plan`). `vp_stage`: the chunk's virtual pipeline stage (None: the
    model's own ``vp_stage``, or 0). Refuses a plan that does not describe the model (`check.PlanMismatch`)."""
    src = plan if isinstance(plan, ExportSource) else load_source(plan)
    return LynxMegatron(model, src, vp_stage)


def cooldown_p2p(lynx: LynxMegatron | Sequence[LynxMegatron], pp_group: Any, config: Any) -> Any:
    """A Megatron-Core `P2PCommunicator` for ``forward_backward_pipelining_without_interleaving``'s
    ``p2p_communicator`` argument: before each backward waits for its gradient from the next stage
    (``recv_backward``, ``send_forward_recv_backward``), the engine restores that micro-batch's pending
    phase-1/2 ops (the cool-down window). Nothing else changes in the schedule."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # type: ignore[import-untyped]

    chunks = [lynx] if isinstance(lynx, LynxMegatron) else list(lynx)
    if len(chunks) != 1:
        raise ValueError("lynx.integrations.megatron: the cool-down window is wired for the non-interleaved "
                         f"1F1B schedule (one model chunk), got {len(chunks)} chunks")
    eng = chunks[0]

    class CooldownP2P(P2PCommunicator):  # type: ignore[misc]
        def recv_backward(self, tensor_shapes: Any, is_last_stage: bool) -> Any:
            self._cooldown(is_last_stage)
            return super().recv_backward(tensor_shapes, is_last_stage)

        def send_forward_recv_backward(self, output_tensors: Any, tensor_shapes: Any, is_last_stage: bool) -> Any:
            self._cooldown(is_last_stage)
            return super().send_forward_recv_backward(output_tensors, tensor_shapes, is_last_stage)

        @staticmethod
        def _cooldown(is_last_stage: bool) -> None:
            if is_last_stage:  # no gradient to wait for: the backward follows at once
                eng._backwards += 1
            else:
                eng.cooldown_next()

    return CooldownP2P(pp_group=pp_group, config=config)


def schedule_kwargs(lynx: LynxMegatron | Sequence[LynxMegatron], config: Any) -> dict[str, Any]:
    """The keyword arguments that open the cool-down window in Megatron-Core's 1F1B schedule:
    ``forward_backward_func(..., **schedule_kwargs(lynx, config))``. Megatron takes a custom
    ``p2p_communicator`` only with the process groups beside it (``pg_collection``): its own, from
    ``parallel_state``. Empty without pipeline parallelism (no p2p, no cool-down)."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection  # type: ignore[import-untyped]

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return {}
    return {"p2p_communicator": cooldown_p2p(lynx, ps.get_pipeline_model_parallel_group(), config),
            "pg_collection": ProcessGroupCollection.use_mpu_process_groups()}


__all__ = ["LynxMegatron", "apply_lynx_plan", "cooldown_p2p", "schedule_kwargs", "unwrap"]
