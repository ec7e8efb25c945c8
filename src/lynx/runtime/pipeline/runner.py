"""The pipeline runtime: a plan's TP x PP x DP layout on torch.distributed, executing the plan's action list
with torch.distributed.pipelining (`_torch_pipelining` holds the private parts).

Ranks are numbered as Megatron does, TP fastest, then DP, then PP: rank = (pp_rank * dp + dp_rank) * tp +
tp_rank. Virtual stage s (chunk s // pp) lives on pipeline rank s % pp, as torch's interleaved schedules
place it. Each rank holds one `StageModule` per chunk, each with its own `RecomputeEngine` under that
stage's policy.

Where recomputation runs (docs/runtime.md, "Pipelines"): the action list says, per rank, which forward
hosts the phase-1/2 work of which backward (`order.rank_order`: the forward just before it, any chunk); the
engine restores only that in the forward's collectives. A backward with no host (cool-down) restores its
phase-1/2 work before waiting for the next stage's gradient when the stage's policy has `cooldown_overlap`,
else on demand.
Phases 3/4 run in the backward collectives of the layer above and phase 5 on demand, as with PP = 1.
"""

from __future__ import annotations

import datetime
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lynx.decisions import RecomputePolicy
from lynx.errors import LynxError
from lynx.runtime.fsdp import FsdpRun, LiveParams, shard_stage
from lynx.runtime.layers.moe import MoELayer
from lynx.runtime.layers.moe_dispatch import updated_expert_bias
from lynx.runtime.layers.tp import partial_over_tp
from lynx.runtime.pipeline import _torch_pipelining as tpp
from lynx.runtime.pipeline.order import check_executable, rank_order
from lynx.runtime.pipeline.stages import HostStaged, StageModule, StageSpec, make_loss_fn
from lynx.schedule import Schedule, save_csv


class LayoutError(LynxError):
    """A plan whose layout this world cannot run."""


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    tp: int
    pp: int
    dp: int
    vpp: int
    layers_per_stage: tuple[int, ...]
    """Per virtual stage (pp * vpp entries)."""
    policies: tuple[RecomputePolicy | None, ...]
    """Per virtual stage; None runs the stage without the engine (the reference)."""
    num_microbatches: int
    ep: int = 1
    """Expert parallelism, folded into each stage's TP x DP ranks in Megatron-Core's expert order (ETP innermost,
    then EP, then expert-DP): rank i of a stage (i = dp_rank * TP + tp_rank) is ETP rank i % ETP, EP rank
    (i // ETP) % EP and expert-DP rank i // (ETP x EP)."""
    etp: int = 1
    """Expert tensor parallelism: 1, or TP (the ETP group is then the TP group)."""
    experts: bool = False
    """The model has experts: their gradients are reduced over the expert-DP group (EP 1 included)."""

    def __post_init__(self) -> None:
        if (self.tp * self.dp) % (self.ep * self.etp):
            raise LayoutError(f"EP {self.ep} x ETP {self.etp} must divide TP {self.tp} x DP {self.dp} (experts fold "
                              "into them)")
        if self.etp not in (1, self.tp):
            raise LayoutError(f"ETP {self.etp}: the runtime splits experts over the TP group (ETP {self.tp}) or not "
                              "at all (ETP 1)")
        n = self.pp * self.vpp
        if len(self.layers_per_stage) != n or len(self.policies) != n:
            raise LayoutError(f"PP={self.pp} x VPP={self.vpp} needs {n} stages, the plan has "
                              f"{len(self.layers_per_stage)} partitions and {len(self.policies)} policies")
        for s, (k, pol) in enumerate(zip(self.layers_per_stage, self.policies, strict=True)):
            if k < 1:
                raise LayoutError(f"virtual stage {s} has {k} layers: lynx train needs a transformer layer in each "
                                  "(a split that leaves the embedding or the loss alone is for planning and export)")
            if pol is not None and len(pol.layers) != k:
                raise LayoutError(f"stage {s}: {k} layers but its policy has {len(pol.layers)}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        return rank // (self.tp * self.dp), (rank // self.tp) % self.dp, rank % self.tp

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def stage_specs(self) -> tuple[StageSpec, ...]:
        first, out = 0, []
        for s, k in enumerate(self.layers_per_stage):
            out.append(StageSpec(s, self.num_stages, first, k, self.policies[s]))
            first += k
        return tuple(out)


def check_world(layout: PipelineLayout, world: int, where: str) -> None:
    """Refuse a layout that does not match the world size, before any process group exists."""
    if layout.world_size != world:
        raise LayoutError(f"{where}: TP {layout.tp} x PP {layout.pp} x DP {layout.dp} = {layout.world_size} "
                          f"ranks, but {world} were started (torchrun --nproc-per-node / --nnodes)")


@dataclass
class Groups:
    tp: Any
    pp: Any
    dp: Any
    embedding: Any
    """The first and last pipeline ranks of this (dp, tp) column: the tied embedding's gradient."""
    ep: Any = None
    """The expert-parallel group (the token all-to-alls); None with EP 1."""
    edp: Any = None
    """The expert-data-parallel group (expert gradients); None when it is one rank."""


def make_groups(layout: PipelineLayout, rank: int, timeout_s: float | None = None) -> Groups:
    """Every rank creates every group in the same order (torch.distributed requires it). `timeout_s` bounds
    every collective of every group (a new group does not inherit the default group's timeout: gloo's own
    default is 30 minutes, so a cut link would hang a TP all-reduce that long)."""
    L = layout
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)

    def new_group(ranks: list[int]) -> Any:
        return dist.new_group(ranks, timeout=timeout)

    mine: dict[str, Any] = {}
    for d in range(L.dp):
        for p in range(L.pp):
            g = new_group([L.rank_of(p, d, t) for t in range(L.tp)])
            if rank in [L.rank_of(p, d, t) for t in range(L.tp)]:
                mine["tp"] = g
    for d in range(L.dp):
        for t in range(L.tp):
            members = [L.rank_of(p, d, t) for p in range(L.pp)]
            g = new_group(members)
            emb = new_group(sorted({members[0], members[-1]}))
            if rank in members:
                mine["pp"], mine["embedding"] = g, emb
    for p in range(L.pp):
        for t in range(L.tp):
            members = [L.rank_of(p, d, t) for d in range(L.dp)]
            g = new_group(members)
            if rank in members:
                mine["dp"] = g
    stage, x = L.tp * L.dp, L.etp
    edp = stage // (L.ep * x)
    for p in range(L.pp) if L.ep > 1 else ():
        for e in range(edp):
            for r in range(x):
                members = [p * stage + (e * L.ep + j) * x + r for j in range(L.ep)]
                g = new_group(members)
                if rank in members:
                    mine["ep"] = g
    for p in range(L.pp) if edp > 1 and L.experts else ():
        for j in range(L.ep * x):  # the ranks holding the same experts (and the same ETP shard of them)
            members = [p * stage + e * L.ep * x + j for e in range(edp)]
            g = new_group(members)
            if rank in members:
                mine["edp"] = g
    return Groups(tp=mine["tp"] if L.tp > 1 else None, pp=mine["pp"], dp=mine["dp"] if L.dp > 1 else None,
                  embedding=mine["embedding"] if L.pp > 1 else None, ep=mine.get("ep"), edp=mine.get("edp"))


class PipelineRunner:
    """This rank's stages and the schedule that runs them; `step` runs one iteration's forward and backward
    and reduces the gradients (tied embedding, sequence-parallel LayerNorms, DP)."""

    def __init__(self, layout: PipelineLayout, schedule: Schedule, cfg: Any, vocab: int, rank: int,
                 groups: Groups, device: torch.device, seed: int = 1234, workdir: str | None = None,
                 timeout_s: float | None = None, host_staged: bool = False,
                 autocast: torch.dtype | None = None, fsdp: FsdpRun | None = None) -> None:
        """`host_staged`: p2p through host memory (`HostStaged`): the PipelineStages and their buffers on the
        CPU, the stage modules on `device` (gloo on CUDA, several ranks on one GPU). `autocast`: mixed
        precision, every stage's forward under autocast to that dtype with the parameters as built (fp32
        master weights and gradients; recomputation replays under the same autocast state). `fsdp`: every stage
        wrapped in FSDP2 over the DP group (`lynx.runtime.fsdp`), which then reduces the gradients itself."""
        L = layout
        check_executable(schedule, L.pp, L.vpp, L.num_microbatches)
        cfg = replace(cfg, num_layers=sum(L.layers_per_stage))  # Megatron's scaled init reads the depth
        self.layout, self.cfg, self.vocab, self.rank, self.groups, self.device = L, cfg, vocab, rank, groups, device
        self.pp_rank, self.dp_rank, self.tp_rank = L.coords(rank)
        order = rank_order(schedule, self.pp_rank)
        self.hosts, self.cool, self.in_flight = order.hosts, order.cooldown, order.in_flight
        specs = [s for s in L.stage_specs() if s.index % L.pp == self.pp_rank]
        self.modules = {s.index: StageModule(s, cfg, vocab, groups.tp, device, seed, groups.ep) for s in specs}
        self.fsdp = fsdp
        self.live: dict[int, LiveParams] = {}
        """FSDP2: per stage, the engine's live-parameter callback (its `unshards` per layer)."""
        for s, mod in self.modules.items():
            mod.autocast = autocast
            if fsdp is not None:
                if groups.dp is None:
                    raise LayoutError("FSDP needs DP > 1")
                live = shard_stage(mod, groups.dp, fsdp)
                mod.sharded = True
                if live is not None:
                    self.live[s] = live
        self.losses: list[float] = []
        self.events: list[tuple[str, str, float, float, int]] = []
        """(category, name, t0, t1, stage) while `tracing`: stage is the one whose action was running."""
        self.tracing = False
        self.current_stage = -1
        for mod in self.modules.values():
            if mod.engine is not None:
                mod.engine.tracer = lambda n, a, b: self.event("recompute", n, a, b, None)
                mod.engine.copy_tracer = lambda n, a, b: self.event("copy", n, a, b, None)
        self.loss_fn = make_loss_fn(L.num_microbatches, self.losses, groups.tp)
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        """The step's micro-batches (the last stage's multi-token prediction reads its tokens and labels)."""
        for mod in self.modules.values():
            mod.mtp_grad_scale = 1.0 / L.num_microbatches
        self.stages: list[Any] = []
        """This rank's PipelineStages (on the CPU when host-staged; none under FSDP, `_fsdp_step`)."""
        self.schedule: Any = None
        if fsdp is not None:
            return
        stages = []
        comm = torch.device("cpu") if host_staged else device
        for s, mod in self.modules.items():
            inp, out = mod.example_io(vocab, device)
            if host_staged:  # what crosses the p2p link is a host tensor; the logits stay on `device`
                inp = inp if mod.spec.is_first else inp.detach().to(comm).requires_grad_(True)
                out = out if mod.spec.is_last else out.detach().to(comm).requires_grad_(True)
            wrapped = HostStaged(mod, device, comm) if host_staged else mod
            stages.append(tpp.make_stage(wrapped, s, L.num_stages, comm, inp, out, groups.pp))
        hooks = tpp.Hooks(before_forward=self.before_forward, before_grad_wait=self._before_grad_wait,
                          span=lambda n, a, b, s: self.event("pipeline", n, a, b, s),
                          peer_rank=lambda s: L.rank_of(s % L.pp, self.dp_rank, self.tp_rank), timeout_s=timeout_s)
        self.schedule_hooks = hooks
        self.stages = stages
        with tempfile.TemporaryDirectory(prefix="lynx-pp-") as tmp:  # torch loads the list from a CSV file
            csv_path = Path(workdir or tmp) / f"actions-rank{rank}.csv"
            save_csv(schedule, csv_path)
            self.schedule = tpp.build_schedule(stages, L.num_microbatches, self.loss_fn, str(csv_path), hooks)

    # -- hooks ---------------------------------------------------------------------------------------
    def event(self, cat: str, name: str, t0: float, t1: float, stage: int | None = None) -> None:
        """A timeline event of `stage` (None: the stage whose action is running)."""
        if self.tracing:
            self.events.append((cat, name, t0, t1, self.current_stage if stage is None else stage))

    def before_forward(self, stage: int, mb: int) -> None:
        self.current_stage = stage
        if self.modules[stage].mtp is not None:
            self.modules[stage].batch = self.batches[mb]
        hosted = self.hosts.get((stage, mb))
        if hosted is None:
            self.modules[stage].set_microbatch(mb)
        elif hosted[0] == stage:
            self.modules[stage].set_microbatch(mb, (hosted[1],))
        else:  # interleaved: this forward hosts a backward of another chunk on this rank
            guest = self.modules[hosted[0]].engine
            self.modules[stage].set_microbatch(mb, (), (guest, hosted[1]) if guest is not None else None)

    def _before_grad_wait(self, stage: int, mb: int) -> None:
        self.current_stage = stage
        mod = self.modules[stage]
        pol = mod.spec.policy
        # only a stage that waits for a gradient has a stall to fill (the last stage computes its own loss)
        if (mod.engine is not None and pol is not None and pol.cooldown_overlap and not mod.spec.is_last
                and (stage, mb) in self.cool):
            mod.engine.cooldown(mb)

    # -- one iteration -------------------------------------------------------------------------------
    @property
    def has_first(self) -> bool:
        return 0 in self.modules

    @property
    def has_last(self) -> bool:
        return self.layout.num_stages - 1 in self.modules

    def reset_stats(self) -> None:
        """Start a new iteration's engine statistics on every stage."""
        for mod in self.modules.values():
            if mod.engine is not None:
                mod.engine.stats.reset()

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Forward and backward of `batches` (one (tokens, labels) per micro-batch; only the first stage
        reads tokens and the last labels), then the gradient reductions. No optimizer step."""
        self.losses.clear()
        self.batches = batches
        for mod in self.modules.values():
            mod.train()
            if mod.mtp is not None:
                mod.mtp.losses.clear()
        if self.schedule is None:
            self._fsdp_step(batches)
        else:
            self._schedule_step(batches)
        for mod in self.modules.values():
            if mod.engine is not None:
                mod.engine.end_step()
        self._reduce_grads()

    def _schedule_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        tokens = torch.cat([t for t, _ in batches]) if self.has_first else None
        labels = torch.cat([lab for _, lab in batches]) if self.has_last else None
        args = (tokens,) if tokens is not None else ()
        try:
            self.schedule.step(*args, target=labels, return_outputs=False)
        except tpp.PeerError:
            raise
        except RuntimeError as e:  # a send to a peer that died fails inside torch's own p2p actions
            if self.layout.pp == 1:
                raise
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise tpp.PeerError(f"the pipeline step failed (p2p peers of this rank: {self._peers()}): "
                                f"{cause}") from None

    def _fsdp_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One stage under FSDP2 (`lynx.runtime.fsdp`: PP 1), without torch's pipeline schedule, whose FSDP support
        gathers the whole stage before its first action and reshards it after its last (no per-layer all-gather
        left to host anything). Each micro-batch's forward, then its backward (1F1B on one stage); FSDP2
        reduce-scatters each layer's gradient after its backward, as the planner prices it."""
        (s, mod), = self.modules.items()
        for j, (tokens, labels) in enumerate(batches):
            self.before_forward(s, j)
            t0 = time.perf_counter()
            loss = self.loss_fn(mod(tokens), labels)
            t1 = time.perf_counter()
            self.event("pipeline", f"F{j}", t0, t1, s)
            loss.backward()
            self.event("pipeline", f"B{j}", t1, time.perf_counter(), s)

    def _peers(self) -> str:
        """The neighbouring stages on other ranks, with the rank that runs each."""
        L = self.layout
        near = sorted({n for s in self.modules for n in (s - 1, s + 1)
                       if 0 <= n < L.num_stages and n not in self.modules})
        return ", ".join(f"stage {n} (rank {L.rank_of(n % L.pp, self.dp_rank, self.tp_rank)})" for n in near)

    def _reduce_grads(self) -> None:
        t0 = time.perf_counter()
        g = self.groups
        params = [p for m in self.modules.values() for p in m.parameters() if p.grad is not None]
        experts = [p for p in params if getattr(p, "expert_parallel", False)]
        params = [p for p in params if not getattr(p, "expert_parallel", False)]
        if g.tp is not None:  # replicated weights with a partial gradient per TP rank: SP norms, q/k norms
            for p in params:
                if partial_over_tp(p, bool(self.cfg.sequence_parallel)):
                    dist.all_reduce(p.grad, group=g.tp)
        if g.embedding is not None:
            for m in self.modules.values():  # a tied embedding / head: both ends' parts summed
                for name in m.tied if m.spec.is_first or m.spec.is_last else ():
                    grad = getattr(m, name).grad
                    if grad is not None:
                        dist.all_reduce(grad, group=g.embedding)
        if g.dp is not None and self.fsdp is None:  # FSDP2 reduce-scattered them (`lynx.runtime.fsdp`)
            grads = [p.grad for p in params if p.grad is not None]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=g.dp)
            flat.div_(self.layout.dp)
            for dst, src in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
                dst.copy_(src)
        self._reduce_expert_grads(experts)
        self._update_expert_bias()
        self.event("collective", "gradient all-reduce (tied embedding, SP, DP)", t0, time.perf_counter())

    def _update_expert_bias(self) -> None:
        """DeepSeek-V3's expert bias (`moe_router_enable_expert_bias`), as Megatron-Core's finalize_model_grads moves
        it after the gradients' reduction: each MoE layer's copies per expert over the step, summed over the
        stage's TP and DP ranks (every token of the global batch; without SP the TP ranks count the same tokens, a
        common factor the update's sign ignores), then `moe_dispatch.updated_expert_bias`. Every rank of the stage
        computes the same bias."""
        layers = [(layer, layer.expert_bias) for m in self.modules.values() for layer in m.modules()
                  if isinstance(layer, MoELayer) and layer.expert_bias is not None]  # the MTP layers' included
        if not layers:
            return
        tokens = torch.stack([layer.step_tokens() for layer, _ in layers])
        for group in (self.groups.tp, self.groups.dp):
            if group is not None:
                dist.all_reduce(tokens, group=group)
        for (layer, bias), row in zip(layers, tokens, strict=True):
            bias.copy_(updated_expert_bias(bias, row, layer.moe.expert_bias_rate))

    def _reduce_expert_grads(self, experts: list[torch.nn.Parameter]) -> None:
        """An expert's gradient on its rank already sums the tokens of every EP rank, each a share of its own DP
        replica's loss: summed over the ranks holding the same experts (expert-DP) it is every rank's tokens,
        so divided by DP it is the gradient of the mean loss, as the dense parameters' DP average is."""
        if not experts:
            return
        grads = [p.grad for p in experts if p.grad is not None]
        if self.groups.edp is not None:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.groups.edp)
            for dst, src in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
                dst.copy_(src)
        for grad in grads:
            grad.div_(self.layout.dp)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for m in self.modules.values() for p in m.parameters()]

    def named_grads(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for m in self.modules.values():
            for n, p in m.named_parameters():
                if p.grad is not None:
                    out[n] = p.grad.detach().clone()
        return out
