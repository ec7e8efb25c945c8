"""The configuration space: every (TP, CP, PP, VPP, DP, SP, micro-batch, distributed optimizer) layout of a
cluster, with the recomputation methods each is planned with. Pure enumeration, no pricing.

Megatron-Core's rules decide what is a layout at all: TP divides the attention heads and the query groups
(`families.*.check_layout`), DP = GPUs / (TP x CP x PP), the global batch divides by micro-batch x DP, the
interleaved schedule needs PP >= 2, a multiple of PP micro-batches and whole layers per virtual stage.
Context parallelism needs flash attention and a sequence divisible by 2 x CP (`spec.check_cp`, Megatron-Core's
load-balanced causal chunks); ranks are ordered TP innermost, then CP, as Megatron orders them, so CP groups
are TP ranks apart (`spec.ParallelSpec`, the links the cost model picks).
"""

from __future__ import annotations

from dataclasses import dataclass

from lynx.errors import SpecError
from lynx.families import get_family
from lynx.search.experts import expert_values, moe_sequence_parallel
from lynx.spec import MAX_MICROBATCHES, CpCommType, Hardware, ModelSpec, ParallelSpec, check_cp

STOCK_METHODS: tuple[str, ...] = (
    "none", "selective", "full", "mc-mlp", "mc-layernorm", "mc-core_attn+mlp", "mc-mlp+layernorm",
    "mc-core_attn+mlp+layernorm",
)
"""Megatron-Core's own recompute flags, priced on its even layout (uniform with one layer per chunk is
`full`; `--recompute-modules core_attn` is `selective`, so neither is listed twice). `block` is left out
of the default search: its automatic --recompute-num-layers is itself a search (seconds per layout); pin it
with --method block (docs/decisions.md)."""
LYNX_METHOD = "lynx"
OFFLOAD_METHODS: tuple[str, ...] = ("lynx-offload", "mc-offload")
"""With a host link (`Space.offload`): lynx with offloading as HEU's third choice on its own partition, and
Megatron-Core's stock fine-grained activation offloading (a stock candidate, on its even split)."""
STOCK_OFFLOAD = "mc-offload"
MAX_SEARCHED_VPP = 4
"""Model chunks per rank tried when --vpp is not pinned. Deeper interleaving shaves the bubble further but
multiplies the schedule's actions (and the simulation's time) by VPP; `--vpp N` pins any value."""
CP_SEARCH_MIN_TOKENS = 8192
"""Context-parallel sizes searched when --cp is not pinned: powers of two that leave each CP rank at least this
many tokens of the sequence, so CP is searched from 16k sequences on (Llama 3 405B's 128k run used CP 16, 8k
tokens per rank: Dubey et al. 2024, "The Llama 3 Herd of Models", sec. 3.3.2). Shorter sequences search CP 1
only; `--cp N` pins any valid size (NVIDIA's Llama-3.1 recipes use CP 2 at 8k)."""


@dataclass(frozen=True, slots=True, order=True)
class Layout:
    """One parallel layout of the cluster (Megatron's names)."""

    tp: int
    pp: int
    vpp: int
    dp: int
    sp: bool
    mb: int
    dist_opt: bool
    cp: int = 1
    """Context parallelism (Megatron's --context-parallel-size); world size TP x CP x PP x DP."""
    ep: int = 1
    """Expert parallelism (MoE models; `search.experts`): folded into TP x CP x DP, not in the world size."""
    etp: int = 0
    """Expert tensor parallelism; 0: TP (Megatron's default)."""

    def label(self) -> str:
        cp = f" CP{self.cp}" if self.cp > 1 else ""
        ep = (f" EP{self.ep}" if self.ep > 1 else "") + (f" ETP{self.etp}" if self.etp else "")
        return (f"TP{self.tp}{cp}{ep} PP{self.pp} VPP{self.vpp} DP{self.dp} SP{int(self.sp)} mb{self.mb} "
                f"DO{int(self.dist_opt)}")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A layout planned with one method; `stock` marks Megatron-Core's even layer split and its own flags."""

    layout: Layout
    method: str
    stock: bool


@dataclass(frozen=True, slots=True)
class Pins:
    """Dimensions the user fixed (None: searched)."""

    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    sp: bool | None = None
    mb: int | None = None
    dist_opt: bool | None = None
    cp: int | None = None
    ep: int | None = None
    etp: int | None = None
    methods: tuple[str, ...] | None = None
    """None: lynx on its own partition plus every stock Megatron-Core flag on the even split."""


@dataclass(frozen=True, slots=True)
class Space:
    model: ModelSpec
    hardware: Hardware
    gpus: int
    global_batch: int
    seq_len: int
    pins: Pins = Pins()
    allow_cross_node_tp: bool = False
    cp_comm_type: CpCommType = "p2p"
    """Megatron's --cp-comm-type for every CP > 1 layout (not searched)."""
    offload: bool = False
    """Plan every layout with the offloading methods too (`OFFLOAD_METHODS`; `lynx plan --offload`, on by default
    when the hardware has a host link). Only without pinned methods."""


@dataclass(frozen=True, slots=True)
class Rejected:
    """A combination that is not a layout, and why (it never reaches the planner)."""

    what: str
    reason: str


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_values(space: Space) -> tuple[list[int], list[Rejected]]:
    m, fam, out, bad = space.model, get_family(space.model.family), [], []
    per_node = space.hardware.devices_per_node
    for tp in divisors(space.gpus):
        if space.pins.tp is not None and tp != space.pins.tp:
            continue
        try:
            fam.check_layout(m, tp)
        except SpecError as e:
            bad.append(Rejected(f"TP{tp}", f"does not divide: {e}"))
            continue
        if tp > per_node and not space.allow_cross_node_tp:
            bad.append(Rejected(f"TP{tp}", f"TP beyond one node of {per_node} GPUs (--allow-cross-node-tp)"))
            continue
        out.append(tp)
    return out, bad


def _vpp_values(space: Space, pp: int, nmb: int) -> list[int]:
    """Interleaving where Megatron allows it: PP >= 2, micro-batches a multiple of PP, whole layers per
    virtual stage (Megatron-Core asserts num_layers % (pp * vpp) == 0 for its even chunks)."""
    layers = space.model.num_layers
    if space.pins.vpp is not None:
        v = space.pins.vpp
        ok = v == 1 or (pp >= 2 and nmb % pp == 0 and layers % (pp * v) == 0)
        return [v] if ok else []
    out = [1]
    if pp >= 2 and nmb % pp == 0:
        out += [v for v in range(2, MAX_SEARCHED_VPP + 1) if layers % (pp * v) == 0]
    return out


def cp_values(space: Space, tp: int) -> tuple[list[int], list[Rejected]]:
    """CP sizes beside TP `tp`: the pinned one, or the powers of two `CP_SEARCH_MIN_TOKENS` allows,
    each checked as Megatron-Core checks it (flash attention, sequence divisible by 2 x CP)."""
    rest = space.gpus // tp
    if space.pins.cp is not None:
        wanted = [space.pins.cp] if rest % space.pins.cp == 0 else []
    else:
        wanted = [c for c in (1 << k for k in range(17)) if rest % c == 0
                  and (c == 1 or space.seq_len // c >= CP_SEARCH_MIN_TOKENS)]
    out, bad = [], []
    for cp in wanted:
        if cp == 1:
            out.append(cp)
            continue
        if space.seq_len % (2 * cp):
            bad.append(Rejected(f"CP{cp}", f"--seq-len {space.seq_len} is not divisible by 2 x CP = {2 * cp}"))
            continue
        try:
            check_cp(space.model, ParallelSpec(tp=tp, cp=cp, seq_length=space.seq_len, cp_comm_type=space.cp_comm_type,
                                               global_batch_size=space.global_batch))
        except SpecError as e:
            bad.append(Rejected(f"CP{cp}", str(e)))
            continue
        out.append(cp)
    return out, bad


def layouts(space: Space) -> tuple[list[Layout], list[Rejected]]:
    """Every layout of the space (pins applied), and the combinations refused with their reason."""
    tps, rejected = tp_values(space)
    m, gb = space.model, space.global_batch
    out: list[Layout] = []
    for tp in tps:
        cps, bad = cp_values(space, tp)
        rejected += [Rejected(f"TP{tp} {r.what}", r.reason) for r in bad]
        for cp in cps:
            for pp in divisors(space.gpus // (tp * cp)):
                if space.pins.pp is not None and pp != space.pins.pp:
                    continue
                what = f"TP{tp}{f' CP{cp}' if cp > 1 else ''} PP{pp}"
                if pp > m.num_layers:
                    rejected.append(Rejected(what, f"{m.num_layers} layers cannot fill {pp} stages"))
                    continue
                dp = space.gpus // (tp * cp * pp)
                if gb % dp:
                    rejected.append(Rejected(f"{what} DP{dp}", f"global batch {gb} does not divide by DP {dp}"))
                    continue
                out += _layouts_of(space, tp, pp, dp, rejected, cp)
    return out, rejected


def _layouts_of(space: Space, tp: int, pp: int, dp: int, rejected: list[Rejected], cp: int = 1) -> list[Layout]:
    pins, out = space.pins, []
    sps = [False, True] if tp > 1 else [False]
    if pins.sp is not None:
        sps = [pins.sp] if (tp > 1 or not pins.sp) else [False]
    sps = moe_sequence_parallel(space, tp, [s for s in sps if not s or space.seq_len % (tp * cp) == 0])
    dos = [False, True] if dp * cp > 1 else [False]  # it shards over DP x CP: with both 1, nothing
    if pins.dist_opt is not None:
        dos = [pins.dist_opt]
    for mb in divisors(space.global_batch // dp):
        if pins.mb is not None and mb != pins.mb:
            continue
        nmb = space.global_batch // (dp * mb)
        if nmb > MAX_MICROBATCHES:
            rejected.append(Rejected(f"TP{tp} PP{pp} DP{dp} mb{mb}", f"{nmb} micro-batches (over {MAX_MICROBATCHES})"))
            continue
        vpps = _vpp_values(space, pp, nmb)
        if not vpps:
            rejected.append(Rejected(f"TP{tp} PP{pp} DP{dp} mb{mb} VPP{pins.vpp}",
                                     "interleaving needs PP >= 2, a multiple of PP micro-batches and "
                                     "whole layers per virtual stage"))
        for vpp in vpps:
            out += [Layout(tp, pp, vpp, dp, sp, mb, do, cp, ep, etp) for sp in sps for do in dos
                    for ep, etp in expert_values(space, tp, cp, dp)]
    return out


def even_split(model: ModelSpec, layout: Layout) -> bool:
    """Megatron-Core's default split: the same number of layers on every (virtual) stage."""
    return model.num_layers % (layout.pp * layout.vpp) == 0


def candidates(space: Space) -> tuple[list[Candidate], list[Rejected]]:
    lays, rejected = layouts(space)
    methods = space.pins.methods
    out: list[Candidate] = []
    for lay in lays:
        names = methods if methods is not None else (
            (LYNX_METHOD, *STOCK_METHODS) + (OFFLOAD_METHODS if space.offload else ()))
        for name in names:
            stock = name in STOCK_METHODS or name == STOCK_OFFLOAD
            if stock and not even_split(space.model, lay):
                if methods is None:
                    rejected.append(Rejected(f"{lay.label()} {name}", "Megatron-Core splits layers evenly; "
                                             f"{space.model.num_layers} layers over {lay.pp * lay.vpp} stages"))
                    continue
                stock = False  # a user's pinned baseline on lynx's parameter-balanced split
            out.append(Candidate(lay, name, stock))
    return out, rejected

