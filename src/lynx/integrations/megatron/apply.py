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
cool-down window of the 1F1B and interleaved 1F1B schedules opens through the schedule's own ``p2p_communicator``
argument (`cooldown_p2p`). Interleaved, the chunks of a rank know each other (`_RankChunks`, per plan file and
rank): each forward's windows host the backward the plan's schedule gives them, of its own chunk or another. A
user adds two lines to the model provider (what `lynx export megatron` writes): build the model as always, then
``apply_lynx_plan(model, "plan.json")``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lynx.export.source import ExportSource, load_source
from lynx.integrations.megatron import _fence
from lynx.integrations.megatron.check import PlanMismatch, check_layers, check_model, check_shape
from lynx.integrations.megatron.layer import MegatronLayer
from lynx.runtime.engine import EngineStats, RecomputeEngine
from lynx.runtime.pipeline.order import RankOrder, layout_schedule, rank_order

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


class _RankChunks:
    """The model chunks of one pipeline rank under an interleaved plan, and what the plan's schedule says of them
    (`lynx.runtime.pipeline.order.rank_order` of the schedule lynx plans for, Megatron-Core's interleaved 1F1B with
    its default micro-batch groups of PP): which forward's windows host which backward's phase-1/2 work (of its own
    chunk or of another chunk on the rank), which backwards' work fills the cool-down stall, and the rank's
    backwards that wait for a gradient from the next stage, in order (every backward but the last virtual stage's,
    which computes its own loss)."""

    def __init__(self, src: ExportSource, pp_rank: int) -> None:
        lay = src.layout
        sched = layout_schedule(lay.pp, lay.vpp, src.problem.parallel.num_microbatches)
        self.order: RankOrder = rank_order(sched, pp_rank)
        last = lay.pp * lay.vpp - 1
        self.receives = [(a.virtual_stage(lay.pp), a.microbatch) for a in sched.ranks[pp_rank]
                         if a.kind.name == "B" and a.virtual_stage(lay.pp) != last]
        self.chunks: dict[int, LynxMegatron] = {}
        self.received = 0

    def hosting(self, stage: int, mb: int) -> tuple[tuple[int, ...], tuple[RecomputeEngine, int] | None]:
        """(hosts, guest) of the forward of `mb` on virtual stage `stage` (`RecomputeEngine.forward_layer`)."""
        hosted = self.order.hosts.get((stage, mb))
        if hosted is None:
            return (), None
        if hosted[0] == stage:
            return (hosted[1],), None
        guest = self.chunks.get(hosted[0])
        return (), (None if guest is None else (guest.engine, hosted[1]))

    def before_grad_wait(self) -> None:
        """The rank is about to wait for the next backward's gradient: if the plan's schedule puts that backward's
        phase-1/2 work in the cool-down stall (no later forward hosts it), restore it now (as the 1F1B path does)."""
        if self.received >= len(self.receives):
            return
        stage, mb = self.receives[self.received]
        self.received += 1
        eng = self.chunks.get(stage)
        if eng is not None and (stage, mb) in self.order.cooldown:
            eng.engine.cooldown(mb)


_RANKS: dict[tuple[object, int], _RankChunks] = {}
"""Per (plan, pipeline rank): the chunks applied in this process (`apply_lynx_plan` is called once per chunk)."""


class LynxMegatron:
    """lynx's engine on one Megatron-Core model chunk (one pipeline stage, or one virtual stage)."""

    def __init__(self, model: Any, src: ExportSource, vp_stage: int | None = None, plan_key: object = None) -> None:
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
        self.rank_chunks: _RankChunks | None = None
        """Interleaved (PP > 1, VPP > 1): this rank's chunks and the plan's hosting (`_RankChunks`)."""
        if pp > 1 and src.layout.vpp > 1:
            key = (id(src) if plan_key is None else plan_key, rank)
            rc = _RANKS.get(key)
            if rc is None or v in rc.chunks:  # a new model of the rank: start over
                rc = _RANKS[key] = _RankChunks(src, rank)
            rc.chunks[v] = self
            self.rank_chunks = rc
        self._hosting: tuple[tuple[int, ...] | None, tuple[RecomputeEngine, int] | None] = (None, None)
        self._each_microbatch_alone = self.rank_chunks is None and rank == pp - 1
        """1F1B's last stage (or PP 1): nothing held between micro-batches (`_start_microbatch`)."""
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
                out = self.engine.forward_layer(li, x, mb, *self._hosting)
            finally:
                layer.forwarding = None
            return out, kwargs.get("context")
        return run

    def _chunks_of_rank(self) -> list[LynxMegatron]:
        return [self] if self.rank_chunks is None else list(self.rank_chunks.chunks.values())

    def _start_microbatch(self, x: torch.Tensor) -> None:
        m = self.src.problem.parallel.num_microbatches
        # every backward of the last step ran on the rank: a new step starts here. A pipeline rank holds a micro-batch
        # from its first forward of a step to its last backward (one interleaved chunk alone may hold none between
        # two of its forwards, so the rank's chunks are asked together), except 1F1B's last stage (and PP 1), which
        # runs each micro-batch's backward right after its forward and so holds none between micro-batches: there
        # every micro-batch starts afresh (no forward window or stall spans two of them) and the count is not seen
        if self.auto_step and all(c.engine.idle() for c in self._chunks_of_rank()):
            for c in self._chunks_of_rank():
                if not self._each_microbatch_alone and c._microbatch not in (0, m):
                    raise _count_mismatch(m, c._microbatch)
                c.end_step()
            if self.rank_chunks is not None:
                self.rank_chunks.received = 0
        if self._microbatch >= m:  # more forwards in one step than the plan's micro-batches
            raise _count_mismatch(m, self._microbatch + 1)
        if not self._checked_shape:
            tp = self.src.problem.parallel.tp if self.gpt.config.sequence_parallel else 1
            check_shape(self.src, int(x.shape[0]) * tp, int(x.shape[1]))
            self._checked_shape = True
        self._fwd_order.append(self._microbatch)
        if self.rank_chunks is not None:
            self._hosting = self.rank_chunks.hosting(self.virtual_stage, self._microbatch)
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


def _count_mismatch(plan: int, ran: int) -> PlanMismatch:
    """The schedule runs another number of micro-batches per step than the plan (its windows and cool-down are
    planned per micro-batch: they would land elsewhere, and the price would not be this run's)."""
    return PlanMismatch(f"lynx.integrations.megatron: micro-batches per step: the plan has {plan}, the schedule ran "
                        f"{ran} (run the plan's global batch and micro-batch size, or plan this one)")


def apply_lynx_plan(model: Any, plan: str | Path | ExportSource, vp_stage: int | None = None) -> LynxMegatron:
    """Run `model`'s layers (a Megatron-Core GPTModel chunk, possibly wrapped by DDP / Float16Module) under the
    plan (a plan file written by `lynx plan`). `vp_stage`: the chunk's virtual pipeline stage (None: the
    model's own ``vp_stage``, or 0). Refuses a plan that does not describe the model (`check.PlanMismatch`)."""
    if isinstance(plan, ExportSource):
        return LynxMegatron(model, plan, vp_stage)
    return LynxMegatron(model, load_source(plan), vp_stage, plan_key=str(Path(plan).resolve()))


def cooldown_p2p(lynx: LynxMegatron | Sequence[LynxMegatron], pp_group: Any, config: Any) -> Any:
    """A Megatron-Core `P2PCommunicator` for the schedule's ``p2p_communicator`` argument: before each backward
    waits for its gradient from the next stage, the engine restores that micro-batch's pending phase-1/2 ops where
    the plan puts them in the cool-down stall. Nothing else changes in the schedule.

    One model chunk (``forward_backward_pipelining_without_interleaving``): at ``recv_backward`` and
    ``send_forward_recv_backward``. Every chunk of the rank (``forward_backward_pipelining_with_interleaving``): at
    each call that receives a backward's gradient (``recv_backward``, ``send_backward_recv_backward`` and
    ``send_forward_backward_recv_forward_backward`` with ``recv_next``), the rank's next backward that receives
    one in the plan's schedule (`_RankChunks`), which is Megatron's own order with its default micro-batch
    groups."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # type: ignore[import-untyped]

    chunks = [lynx] if isinstance(lynx, LynxMegatron) else list(lynx)
    if len(chunks) > 1:
        return _interleaved_p2p(chunks, pp_group, config)
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


def _interleaved_p2p(chunks: list[LynxMegatron], pp_group: Any, config: Any) -> Any:
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    ranks = {id(c.rank_chunks) for c in chunks}
    found = chunks[0].rank_chunks
    if found is None or len(ranks) != 1 or len(chunks) != len(found.chunks):
        raise ValueError("lynx.integrations.megatron: the interleaved cool-down window needs every model chunk of "
                         f"this rank under one interleaved plan (got {len(chunks)} chunks)")
    if getattr(config, "microbatch_group_size_per_vp_stage", None) not in (None, config.pipeline_model_parallel_size):
        raise ValueError("lynx.integrations.megatron: the plan's interleaved schedule groups micro-batches by PP "
                         "(Megatron's default); the config has microbatch_group_size_per_vp_stage "
                         f"{config.microbatch_group_size_per_vp_stage}")
    rc: _RankChunks = found

    class InterleavedCooldownP2P(P2PCommunicator):  # type: ignore[misc]
        def recv_backward(self, tensor_shapes: Any, is_last_stage: bool) -> Any:
            if not is_last_stage:
                rc.before_grad_wait()
            return super().recv_backward(tensor_shapes, is_last_stage)

        def send_backward_recv_backward(self, input_tensor_grad: Any, recv_next: bool, tensor_shape: Any,
                                        overlap_p2p_comm: bool = False) -> Any:
            if recv_next:
                rc.before_grad_wait()
            return super().send_backward_recv_backward(input_tensor_grad, recv_next, tensor_shape, overlap_p2p_comm)

        def send_forward_backward_recv_forward_backward(self, output_tensor: Any, input_tensor_grad: Any,
                                                        recv_prev: bool, recv_next: bool, tensor_shape: Any) -> Any:
            if recv_next:
                rc.before_grad_wait()
            return super().send_forward_backward_recv_forward_backward(output_tensor, input_tensor_grad, recv_prev,
                                                                       recv_next, tensor_shape)

    return InterleavedCooldownP2P(pp_group=pp_group, config=config)


def schedule_kwargs(lynx: LynxMegatron | Sequence[LynxMegatron], config: Any) -> dict[str, Any]:
    """The keyword arguments that open the cool-down window in Megatron-Core's 1F1B schedule (`lynx`: the rank's
    chunk) or interleaved 1F1B schedule (`lynx`: every chunk of the rank):
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
