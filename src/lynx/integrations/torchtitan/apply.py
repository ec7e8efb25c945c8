"""Apply a lynx plan to one torchtitan model part (a pipeline stage's `Llama3Model`, or the whole model) after
torchtitan has parallelized it: its transformer blocks run under lynx's recompute engine
(`lynx.runtime.engine.RecomputeEngine`), each as a `TitanLayer`, with the plan's per-layer keep / recompute
decisions looked up by the block's FQN (``layers.<global id>``).

Each block's own `forward` runs that block's step of the engine (`RecomputeEngine.forward_layer`), so whatever
torchtitan wrapped around the block's call runs around its step: FSDP2's per-block hooks (``fully_shard``)
all-gather the block's parameters before it and reshard them after, and their backward hooks reduce-scatter
its gradients. A restoration that runs outside its block's own call (in the next block's backward window, in
a cool-down stall) unshards the block first (`_fence.weights`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lynx.decisions import LayerPolicy
from lynx.export.titan_assumes import PlanAssumes, assumes_of
from lynx.integrations.torchtitan import _fence, checks
from lynx.integrations.torchtitan.layer import TitanLayer
from lynx.runtime.engine import EngineStats, RecomputeEngine
from lynx.runtime.fsdp import window_after_pre_backward
from lynx.runtime.layers import tp


def plan_layer_policies(plan: str | Path) -> dict[int, LayerPolicy]:
    """Global layer id -> the plan's layer policy (every virtual stage, model order), from a plan file or the
    layer table `lynx export torchtitan` writes (`lynx.export.torchtitan.ENGINE_FILE`)."""
    return load_plan(plan)[0]


def load_plan(plan: str | Path) -> tuple[dict[int, LayerPolicy], PlanAssumes]:
    """The plan's layer policies by global layer id and what it assumed about the model (`PlanAssumes`)."""
    import json

    from lynx.decisions import Phase
    from lynx.export.source import load_source
    from lynx.export.torchtitan import dp_degrees, older_code
    from lynx.families.titan import NAME

    try:
        raw = json.loads(Path(plan).read_text())
    except (OSError, ValueError):
        raw = None
    if isinstance(raw, dict) and "layers" in raw and "model" not in raw:
        if raw.get("family") != NAME:
            raise ValueError(f"lynx.integrations.torchtitan: {plan}: family {raw.get('family')!r}, expected {NAME}")
        assumes = PlanAssumes.from_dict(raw.get("assumes"), str(plan))
        try:
            return {i: LayerPolicy(keep=frozenset(e["keep"]),
                                   recompute=tuple((str(n), Phase(int(p))) for n, p in e["recompute"]),
                                   input_checkpoint=bool(e.get("input_checkpoint", True)),
                                   offload=frozenset(e.get("offload", ())))
                    for i, e in enumerate(raw["layers"])}, assumes
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"lynx.integrations.torchtitan: {plan}: a malformed layer table ({e})") from None

    src = load_source(plan)
    if src.family != NAME:
        raise ValueError(f"lynx.integrations.torchtitan: {plan} is priced for family {src.family!r}; the "
                         f"integration runs torchtitan's block, plan it with `family: {NAME}`")
    older = older_code(src.problem.model)
    if older:  # as `lynx export torchtitan` refuses it
        raise ValueError(f"lynx.integrations.torchtitan: {plan} {older}")
    m = src.problem.model
    if m.fp8 is not None or m.compiled:  # priced for kernels the engine's eager nn.Linear blocks do not run
        what = m.fp8.describe() if m.fp8 is not None else "torch.compile"
        raise ValueError(f"lynx.integrations.torchtitan: {plan} is priced with {what}, which lynx's engine does not "
                         "run (it calls eager nn.Linear blocks, decision 0101); run it through the AC module "
                         "`lynx export torchtitan` writes, or plan without --float8-recipe / --compile")
    flat = [lp for pol in src.policies for lp in pol.layers]
    return dict(enumerate(flat)), assumes_of(src.problem, *dp_degrees(src))


class LynxTorchtitan:
    """lynx's engine on one torchtitan model part. Call `end_step()` after the last backward of a step."""

    def __init__(self, model_part: nn.Module, policies: Mapping[int, LayerPolicy], group: Any = None,
                 sequence_parallel: bool | None = None, assumes: PlanAssumes | None = None) -> None:
        _fence.check_versions()
        blocks: Sequence[tuple[str, nn.Module]] = list(model_part.get_submodule("layers").named_children())
        if not blocks:
            raise ValueError("lynx.integrations.torchtitan: the model part has no blocks under `layers`")
        for name, _block in blocks:
            if int(name) not in policies:
                raise ValueError(f"lynx.integrations.torchtitan: the plan has no layer {name} "
                                 f"({len(policies)} layers planned)")
        # what the plan assumed, against what torchtitan made of the model (one line each way it differs)
        checks.check_blocks(blocks)
        facts = checks.read_model(model_part, [b for _, b in blocks])
        sp = checks.check_parallel(facts, assumes, None if group is None else tp.world(group), sequence_parallel)
        if group is None and facts.tp > 1:
            if facts.parallel_dims is None:
                raise ValueError(f"lynx.integrations.torchtitan: the blocks are TP {facts.tp}: pass their TP group")
            group = facts.parallel_dims.get_mesh("tp").get_group()  # torchtitan's own
        self.assumes, self.facts, self.sequence_parallel = assumes, facts, sp
        self._first = True
        self.blocks = [b for _, b in blocks]
        self.layers = [TitanLayer(b, int(n), group, sp) for n, b in blocks]
        if any(_fence.is_fsdp(b) for b in self.blocks) and group is not None and tp.world(group) > 1:
            # the blocks' sizes are read from sharded DTensors here; apply the plan before FSDP (as torchtitan's
            # trainer does, `trainer.LynxEngineAC`) to combine TP and FSDP
            raise TypeError("lynx.integrations.torchtitan: FSDP-wrapped blocks with tensor parallelism: apply "
                            "the plan after TP and before FSDP")
        pols = [policies[int(n)] for n, _ in blocks]
        for layer, pol in zip(self.layers, pols, strict=True):
            unknown = (set(pol.keep) | {n for n, _ in pol.recompute} | set(pol.offload)) - set(layer.op_names)
            if unknown:
                raise ValueError(f"lynx.integrations.torchtitan: layer {layer.layer_index}'s policy names ops "
                                 f"the block does not have: {', '.join(sorted(unknown))}")
            if not pol.offload <= pol.keep:  # the engine offloads only what it keeps: the rest would stay priced off
                raise ValueError(f"lynx.integrations.torchtitan: layer {layer.layer_index}'s policy offloads ops it "
                                 f"does not keep: {', '.join(sorted(pol.offload - pol.keep))}")
        # FSDP (now, or applied after this, as torchtitan's trainer does): the module holds sharded DTensors
        # between calls; the unsharded parameters its ops read are the engine's live parameters, layer by layer
        params: list[Any] = [p for layer in self.layers for p in layer.block_parameters() if not _fence.is_dtensor(p)]
        # the blocks' buffers are not activations either: RoPE's table is saved by the complex product, and was
        # held (and counted) as rope's side state (8 MiB per block of the debug model)
        params += [b for block in self.blocks for b in block.buffers() if not _fence.is_dtensor(b)]
        self._storages = [t.untyped_storage().data_ptr() for t in params]
        self.engine = RecomputeEngine(self.layers, pols, params,
                                      live_params=lambda li: self.layers[li].live_parameters())
        self._microbatch = 0
        self._fsdp_hooked: dict[int, Any] = {}
        """FSDP2: per block, the forward hook that puts lynx's window after FSDP2's pre-backward."""
        self.auto_step = True
        """Start a new step (micro-batch 0) when the part's first block runs with nothing held for backward (a
        training loop that never calls `end_step`, such as torchtitan's trainer)."""
        self._install()

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def _install(self) -> None:
        own = [b.forward for b in self.blocks]  # torchtitan's (its parallelize may have wrapped them)
        self._own = own
        for li, b in enumerate(self.blocks):
            b.forward = self._step(li, own[li])
            checks.guard_compile(b)

    def _step(self, li: int, own: Any) -> Any:
        """Block li's forward: its step of the engine (the part's first block starts a micro-batch)."""
        def run(x: torch.Tensor, attention_masks: Any = None, positions: Any = None) -> torch.Tensor:
            if x.is_meta or not torch.is_grad_enabled():
                # torch.distributed.pipelining's shape inference, or an evaluation: nothing kept for backward
                return own(x, attention_masks, positions)  # type: ignore[no-any-return]
            if li == 0:
                if self._first:
                    self._check_first(x)
                if self.auto_step and self.engine.idle():
                    self.end_step()  # every backward of the last step ran: a new step starts here
                self._microbatch += 1
            mb = self._microbatch - 1
            self.layers[li].context[mb] = (attention_masks, positions)
            if li not in self._fsdp_hooked and _fence.is_fsdp(self.blocks[li]):
                # appended now, after FSDP2's post-forward (fully_shard before or after the plan): it sees the
                # output once FSDP2 has put its pre-backward on it, this call included (`lynx.runtime.fsdp`)
                self._fsdp_hooked[li] = self.blocks[li].register_forward_hook(self._fsdp_window(li))
            return self.engine.forward_layer(li, x, mb)
        return run

    def _fsdp_window(self, li: int) -> Any:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and torch.is_grad_enabled():
                window_after_pre_backward(self.engine, li, output, self._microbatch - 1)
        return post

    def _check_first(self, x: torch.Tensor) -> None:
        """The first forward: the plan's batch and dtype; the parameters still the ones the engine was given
        (a cast or move after `apply_lynx_plan` replaces their storage; FSDP's own swap is expected)."""
        self._first = False
        if not any(_fence.is_fsdp(b) for b in self.blocks):
            params = [p for layer in self.layers for p in layer.block_parameters() if not _fence.is_dtensor(p)]
            if [p.untyped_storage().data_ptr() for p in params] != self._storages[:len(params)]:
                raise checks.PlanMismatch("lynx.integrations.torchtitan: the blocks' parameters were replaced after "
                                          "the plan was applied (a cast or move): cast / move the model first")
        if self.assumes is not None:
            checks.check_batch(self.assumes, x, self.facts.tp, self.sequence_parallel)

    def end_step(self) -> None:
        """Forget the step's records (after its last backward); the next forward is micro-batch 0."""
        self.engine.end_step()
        self._microbatch = 0
        for layer in self.layers:
            layer.end_step()

    def remove(self) -> None:
        """Give the blocks their own forward back."""
        for b, f in zip(self.blocks, self._own, strict=True):
            b.forward = f
            checks.unguard_compile(b)
        for h in self._fsdp_hooked.values():
            h.remove()
        self._fsdp_hooked.clear()


def apply_lynx_plan(model_part: nn.Module, plan: str | Path | Mapping[int, LayerPolicy],
                    group: Any = None, sequence_parallel: bool | None = None) -> LynxTorchtitan:
    """Run `model_part`'s blocks under the plan (a plan file of family torchtitan-llama3 or the layer table
    `lynx export torchtitan` writes, checked against the model: `checks`; or bare layer policies by global
    layer id, which say nothing about the model). `group`: the tensor-parallel process group (None: read from
    torchtitan's ParallelDims; TP 1 without one); `sequence_parallel`: None reads it from torchtitan's module
    plans, a value must agree with them."""
    if isinstance(plan, Mapping):
        return LynxTorchtitan(model_part, plan, group, sequence_parallel)
    pols, assumes = load_plan(plan)
    return LynxTorchtitan(model_part, pols, group, sequence_parallel, assumes)
