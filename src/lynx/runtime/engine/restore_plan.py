"""The engine's restore plan, torch-free: from a stage's layers (op names, what each op reads, the block of each
comm op) and its layer policies, what the plan drops, which restorations each window hosts, and when a
restored output may be freed. The engine (`core`) asks this plan and does the tensor work; nothing here
touches a tensor, so the rules read (and test) like the planner's.

Phases 1/2 of a micro-batch j queue here after j's forward (`queue_forward`) and are taken by a later
forward's collective of the same layer and block (`take_window`), by another chunk's forward (`take`), or in
the cool-down stall (`take_cooldown`); phases 3/4 of layer l run in layer l+1's backward collective
(`bwd_window_ops`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from lynx.decisions import LayerPolicy, Phase
from lynx.graph import LAYER_INPUT

FWD_PHASE = {"attn": Phase.FWD_ATTN, "mlp": Phase.FWD_MLP}
"""The phase a block's forward collective hosts."""
BWD_PHASE = {"mlp": Phase.BWD_MLP, "attn": Phase.BWD_ATTN}
"""The phase a block's backward collective hosts (for the layer below)."""


@dataclass(frozen=True, slots=True)
class LayerShape:
    """What the plan needs of one runtime layer: its ops in order, each op's inputs, each comm op's block."""

    op_names: tuple[str, ...]
    op_inputs: Mapping[str, tuple[str, ...]]
    op_blocks: Mapping[str, str]


Pending = tuple[int, int, str, Phase]
"""A queued forward-window restoration: (layer, micro-batch, op, phase)."""


class RestorePlan:
    """The stage's policies read as restoration rules (see the module docstring)."""

    def __init__(self, layers: Sequence[LayerShape], policies: Sequence[LayerPolicy]) -> None:
        if len(policies) != len(layers):
            raise ValueError(f"policy has {len(policies)} layers, the stage has {len(layers)}")
        self.layers, self.policies = tuple(layers), tuple(policies)
        # Offloading: a policy's per-layer `offload` set of op names (a LayerPolicy without the field offloads
        # nothing). The layer's last op may be in it: what it saves beside its output (the residual dropout mask)
        # is offloaded, its output never (it is the next layer's input, which the planner counts as always
        # stored, `LayerGraph.keep_bytes`).
        self.offload = tuple(frozenset(getattr(p, "offload", frozenset())) for p in self.policies)
        self.out_op = tuple(layer.op_names[-1] for layer in self.layers)
        self.any_offload = any(self.offload)
        # Per layer, fixed for the engine's life: who reads each op, and what the policy recomputes.
        self.users = tuple({n: tuple(c for c, ins in layer.op_inputs.items() if n in ins) for n in layer.op_names}
                           for layer in self.layers)
        self.planned = tuple(frozenset(p.recomputed()) for p in self.policies)
        self._queue: list[Pending] = []

    # -- what the policy drops ------------------------------------------------------------------------------
    def checkpointed_input(self, li: int) -> bool:
        """Is layer li's input held for its backward (the stage's first layer always is)?"""
        return li == 0 or self.policies[li].input_checkpoint

    def dropped(self, li: int, op: str, output: bool) -> bool:
        """Does the policy drop op's output (`output`) or what op's forward saves beside it?"""
        if op == LAYER_INPUT:
            return False
        if output and op == self.out_op[li]:  # a layer output is the next layer's input
            nxt = li + 1
            if nxt < len(self.layers):
                return not self.policies[nxt].input_checkpoint
            return False
        return op not in self.policies[li].keep

    def offloaded(self, li: int, op: str, output: bool) -> bool:
        """Does the policy copy this to the host (a layer's output never: it is the next layer's input)?"""
        return op in self.offload[li] and not (output and op == self.out_op[li])

    def kept_output(self, li: int, op: str) -> bool:
        """Is op's output held as a kept tensor of its record (not the layer output, not offloaded)?"""
        return op in self.policies[li].keep and op != self.out_op[li] and op not in self.offload[li]

    # -- forward windows (phases 1/2) ------------------------------------------------------------------------
    def queue_forward(self, li: int, mb: int) -> None:
        self._queue.extend((li, mb, n, p) for n, p in self.policies[li].recompute if p in FWD_PHASE.values())

    def _take(self, chosen: list[Pending]) -> list[Pending]:
        self._queue = [t for t in self._queue if t not in chosen]
        return chosen

    def take_window(self, li: int, block: str, mb: int, hosts: Collection[int] | None) -> list[Pending]:
        """The queued restorations layer li's forward collective of `block` hosts while micro-batch mb runs
        (`hosts`: only those micro-batches; None: any other)."""
        phase = FWD_PHASE[block]
        return self._take([t for t in self._queue if t[0] == li and t[3] == phase and t[1] != mb
                           and (hosts is None or t[1] in hosts)])

    def take(self, mb: int, phase: Phase, layers: Collection[int]) -> list[Pending]:
        """Micro-batch mb's queued `phase` restorations in `layers` (another chunk's forward hosts them)."""
        return self._take([t for t in self._queue if t[1] == mb and t[3] == phase and t[0] in layers])

    def take_cooldown(self, mb: int) -> list[Pending]:
        """Every queued restoration of micro-batch mb, bottom layer first, as the windows would have run them."""
        todo = sorted((t for t in self._queue if t[1] == mb), key=lambda t: (t[0], t[3].value))
        self._queue = [t for t in self._queue if t[1] != mb]
        return todo

    def queued(self, mb: int) -> int:
        return sum(1 for t in self._queue if t[1] == mb)

    def forget(self, li: int, mb: int) -> None:
        """Layer li's backward for mb ran: nothing of it is waiting any more."""
        self._queue = [t for t in self._queue if (t[0], t[1]) != (li, mb)]

    def clear(self) -> None:
        self._queue.clear()

    # -- backward windows (phases 3/4) -----------------------------------------------------------------------
    @staticmethod
    def bwd_phase(block: str) -> Phase:
        return BWD_PHASE[block]

    def bwd_window_ops(self, li: int, block: str) -> list[tuple[str, Phase]]:
        """The restorations of layer li - 1 that layer li's backward collective of `block` hosts."""
        phase = BWD_PHASE[block]
        return [(n, p) for n, p in self.policies[li - 1].recompute if p == phase]

    # -- FSDP's backward all-gather window ------------------------------------------------------------------
    def fsdp_window_ops(self, li: int, restored: Collection[str]) -> list[str]:
        """Layer li's planned restorations not done yet, in op order: what layer li's FSDP backward window hosts
        (the planner's `cost.pricing.fsdp_window` hides the layer's on-demand work). A comm op among them replays
        its collective inside FSDP2's pre-backward hook, which every rank of the TP group runs at the same point of
        the same graph, in the same op order."""
        return [n for n in self.layers[li].op_names if n in self.planned[li] and n not in restored]

    # -- freeing restored outputs ----------------------------------------------------------------------------
    def chunk_top(self, li: int) -> bool:
        """Is layer li's output restored for the layer above rather than held (its input is not checkpointed)?"""
        return li + 1 < len(self.layers) and not self.policies[li + 1].input_checkpoint

    def pending(self, li: int, restored: Collection[str], handed_out: Collection[str]) -> set[str]:
        """Ops of layer li still to restore: planned ones and those whose output backward will unpack (a dropped
        comm op, e.g. the SP all-gather whose output the next GEMM saved, is restored through its inputs)."""
        return set((self.planned[li] | set(handed_out)) - set(restored))

    def still_read(self, li: int, name: str, restored: Collection[str], pending: Collection[str]) -> bool:
        """Does restoring a pending op read `name`, directly or through ops that are neither kept nor restored
        (they would be restored on the way)?"""
        layer, keep = self.layers[li], self.policies[li].keep
        stack, seen = list(pending), set()
        while stack:
            op = stack.pop()
            if op in seen:
                continue
            seen.add(op)
            for d in layer.op_inputs[op]:
                if d == name:
                    return True
                if d != LAYER_INPUT and d not in restored and d not in keep:
                    stack.append(d)
        return False
