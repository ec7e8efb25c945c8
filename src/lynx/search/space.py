"""The configuration space: every (TP, CP, PP, VPP, DP, SP, micro-batch, distributed optimizer) layout of a
cluster, with the recomputation methods each is planned with. Pure enumeration, no pricing.

Megatron-Core's rules decide what is a layout at all: TP divides the attention heads and the query groups
(`families.*.check_layout`), DP = GPUs / (TP x CP x PP), the global batch divides by micro-batch x DP, the
interleaved schedule needs PP >= 2 and a multiple of PP micro-batches; lynx's partition needs a layer per
virtual stage, Megatron's splits (`splits`) whole layers per virtual stage as its knobs give them. Context
parallelism (every size dividing the cluster, at every sequence length, with each --cp-comm-type) needs flash
attention, a sequence divisible by 2 x CP (`spec.check_cp`, Megatron-Core's load-balanced causal chunks) and, for
the all-to-all, whole heads per rank; ranks are ordered TP innermost, then CP, as Megatron orders them, so CP groups
are TP ranks apart (`spec.ParallelSpec`, the links the cost model picks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

from lynx.cost.fsdp import FSDP2, DpSharding
from lynx.errors import SpecError
from lynx.families import get_family
from lynx.families.titan import NAME as TITAN_FAMILY
from lynx.search.experts import expert_reason, expert_values, moe_sequence_parallel
from lynx.search.splits import EVEN, Split, stock_splits
from lynx.spec import MAX_MICROBATCHES, CpCommType, Hardware, ModelSpec, ParallelSpec, check_cp

STOCK_METHODS: tuple[str, ...] = (
    "none", "selective", "full", "block", "mc-mlp", "mc-layernorm", "mc-core_attn+mlp", "mc-core_attn+layernorm",
    "mc-mlp+layernorm", "mc-core_attn+mlp+layernorm",
)
"""Megatron-Core's own recompute flags, priced on the splits Megatron expresses (`splits.stock_splits`): uniform
with one layer per chunk is `full`; `--recompute-modules core_attn` is `selective`, so neither is listed twice;
`block` is Megatron's --recompute-method block with the smallest --recompute-num-layers that fits each stage
(what a user finds by trial runs, `methods.rules`)."""
LYNX_METHOD = "lynx"
OFFLOAD_METHODS: tuple[str, ...] = ("lynx-offload", "mc-offload")
"""With a host link (`Space.offload`): lynx with offloading as HEU's third choice on its own partition, and
Megatron-Core's stock fine-grained activation offloading (a stock candidate, on Megatron's splits)."""
STOCK_OFFLOAD = "mc-offload"
TITAN_STOCK_METHODS: tuple[str, ...] = ("none", "full", "titan-sac")
"""torchtitan's own activation checkpointing, the stock methods of a search ranked for torchtitan (`Stock`):
``activation_checkpoint.mode`` none, full, and selective with ``selective_ac_option = "op"`` (`titan-sac`, its
per-op policy, on torchtitan's block only: family torchtitan-llama3 in 16 bits). torchtitan's
``module_fqns_per_model_part`` expresses any split, so its stock candidates run on the splits Megatron's knobs
give too (`splits.stock_splits`)."""


class Stock(Enum):
    """Whose own settings a search's stock candidates are: the baseline its pick is compared with."""

    MEGATRON = "Megatron-Core"
    """Megatron-Core's recompute flags and its fine-grained offloading (`STOCK_METHODS`, `STOCK_OFFLOAD`)."""
    TORCHTITAN = "torchtitan"
    """torchtitan's activation checkpointing (`TITAN_STOCK_METHODS`): `lynx plan --gpus --target torchtitan`."""
CP_COMM_TYPES: tuple[CpCommType, ...] = ("p2p", "all_gather", "a2a")
"""Megatron's --cp-comm-type values searched for every CP > 1 layout unless --cp-comm-type is given (a2a+p2p needs
its hierarchical sizes, a layout of its own: give it with --tp --pp --cp)."""


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
    cp_comm_type: CpCommType = "p2p"
    """Megatron's --cp-comm-type (p2p when CP is 1)."""
    fsdp: bool = False
    """Fully sharded data parallelism (parameters, gradients and optimizer state over DP x CP: `Space.fsdp`'s
    sharding); `dist_opt` is then False."""
    ep: int = 1
    """Expert parallelism (MoE models; `search.experts`): folded into TP x CP x DP, not in the world size."""
    etp: int = 0
    """Expert tensor parallelism; 0: TP (Megatron's default)."""

    def label(self) -> str:
        cp = f" CP{self.cp}" + (f"({self.cp_comm_type})" if self.cp_comm_type != "p2p" else "") if self.cp > 1 else ""
        ep = (f" EP{self.ep}" if self.ep > 1 else "") + (f" ETP{self.etp}" if self.etp else "")
        shard = "FSDP" if self.fsdp else f"DO{int(self.dist_opt)}"
        return f"TP{self.tp}{cp}{ep} PP{self.pp} VPP{self.vpp} DP{self.dp} SP{int(self.sp)} mb{self.mb} {shard}"


@dataclass(frozen=True, slots=True)
class Candidate:
    """A layout planned with one method. `stock`: the stock framework's own settings (`Space.stock`: Megatron-Core's
    flags, or torchtitan's activation checkpointing) on one of Megatron's splits (`split`);
    otherwise lynx's method on lynx's own partition. `recipe`: the published recipe it prices ('' if none)."""

    layout: Layout
    method: str
    stock: bool
    split: Split = EVEN
    recipe: str = ""


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
    """None: lynx on its own partition plus every stock Megatron-Core flag on Megatron's splits."""
    fsdp: bool | None = None
    """True: FSDP layouts only; False: none; None: searched beside DDP with and without the distributed
    optimizer, unless `dist_opt` is pinned."""


@dataclass(frozen=True, slots=True)
class Space:
    model: ModelSpec
    hardware: Hardware
    gpus: int
    global_batch: int
    seq_len: int
    pins: Pins = Pins()
    allow_cross_node_tp: bool = False
    cp_comm_type: CpCommType | None = None
    """Megatron's --cp-comm-type for every CP > 1 layout; None: each of `CP_COMM_TYPES` the heads allow."""
    offload: bool = False
    """Plan every layout with the offloading methods too (`OFFLOAD_METHODS`; `lynx plan --offload`, on by default
    when the hardware has a host link). Only without pinned methods."""
    production_overlaps: bool = True
    """Megatron's production overlaps on every candidate where Megatron allows them (`options.candidate_options`):
    --overlap-grad-reduce, --overlap-param-gather with the distributed optimizer, --tp-comm-overlap with SP.
    `lynx plan --gpus N --no-production-overlaps` turns them off (flags the user gives stay on)."""
    fsdp: DpSharding = FSDP2
    """The sharding an FSDP layout runs (`Layout.fsdp`): torch FSDP2 unless the user names Megatron-FSDP's."""
    stock: Stock = Stock.MEGATRON
    """Whose settings the stock candidates are (the search's baseline row): Megatron-Core's, or torchtitan's for a
    search ranked for torchtitan."""


@dataclass(frozen=True, slots=True)
class Rejected:
    """A combination that is not a layout, and why (it never reaches the planner)."""

    what: str
    reason: str


def divisors(n: int) -> list[int]:
    """Ascending; trial division up to sqrt(n), so a count of any size a user types answers at once."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


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


def lynx_vpp_values(space: Space, pp: int, nmb: int) -> list[int]:
    """Interleaving for lynx's own partition: every VPP Megatron-Core runs with a
    --pipeline-model-parallel-layout (PP >= 2, a multiple of PP micro-batches: its default
    --microbatch-group-size-per-virtual-pipeline-stage is PP, schedules.py; a layer per virtual stage)."""
    layers = space.model.num_layers
    if space.pins.vpp is not None:
        v = space.pins.vpp
        return [v] if v == 1 or (pp >= 2 and nmb % pp == 0 and layers >= pp * v) else []
    if pp < 2 or nmb % pp:
        return [1]
    return list(range(1, layers // pp + 1))


def cp_values(space: Space, tp: int) -> tuple[list[tuple[int, CpCommType]], list[Rejected]]:
    """(CP, comm type) beside TP `tp`: the pinned CP or every size dividing the rest of the cluster, each with the
    pinned comm type or every one of `CP_COMM_TYPES`, checked as Megatron-Core checks them (flash attention,
    sequence divisible by 2 x CP, whole heads per rank for the all-to-all). A size the model cannot take is a
    reason only when CP is pinned: searched freely, it is simply not in the space (so a reason that stops every
    layout, a batch that does not divide, is the one the user is told)."""
    rest = space.gpus // tp
    pinned = space.pins.cp is not None
    sizes = [space.pins.cp] if space.pins.cp is not None else divisors(rest)
    types = (space.cp_comm_type,) if space.cp_comm_type is not None else CP_COMM_TYPES
    out: list[tuple[int, CpCommType]] = []
    bad = []
    for cp in sizes:
        if rest % cp:
            continue
        if cp == 1:
            out.append((1, "p2p"))
            continue
        if space.seq_len % (2 * cp):
            if pinned:
                bad.append(Rejected(f"CP{cp}", f"--seq-len {space.seq_len} is not divisible by 2 x CP = {2 * cp}"))
            continue
        for kind in types:
            try:
                check_cp(space.model, ParallelSpec(tp=tp, cp=cp, seq_length=space.seq_len, cp_comm_type=kind,
                                                   global_batch_size=space.global_batch))
            except SpecError as e:
                if pinned:
                    bad.append(Rejected(f"CP{cp} {kind}", str(e)))
                continue
            out.append((cp, kind))
    return out, bad


@dataclass(frozen=True, slots=True)
class Core:
    """A layout with its interleaving open: `layout` at VPP 1 and every VPP it may take (`vpps`)."""

    layout: Layout
    vpps: tuple[int, ...]

    def at(self, vpp: int) -> Layout:
        return replace(self.layout, vpp=vpp)


def cores(space: Space) -> tuple[list[Core], list[Rejected]]:
    """Every layout of the space with VPP left open (pins applied), and the combinations refused with their
    reason."""
    tps, rejected = tp_values(space)
    m, gb = space.model, space.global_batch
    out: list[Core] = []
    for tp in tps:
        cps, bad = cp_values(space, tp)
        rejected += [Rejected(f"TP{tp} {r.what}", r.reason) for r in bad]
        for cp, kind in cps:
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
                out += _cores_of(space, tp, pp, dp, rejected, cp, kind)
    return out, rejected


def layouts(space: Space) -> tuple[list[Layout], list[Rejected]]:
    """Every layout of the space (pins applied, every VPP), and the combinations refused with their reason."""
    cs, rejected = cores(space)
    return [c.at(v) for c in cs for v in c.vpps], rejected


def _cores_of(space: Space, tp: int, pp: int, dp: int, rejected: list[Rejected], cp: int = 1,
              kind: CpCommType = "p2p") -> list[Core]:
    pins, out = space.pins, list[Core]()
    sps = [False, True] if tp > 1 else [False]
    if pins.sp is not None:
        sps = [pins.sp] if (tp > 1 or not pins.sp) else [False]
    sps = moe_sequence_parallel(space.model, tp, [s for s in sps if not s or space.seq_len % (tp * cp) == 0])
    dos = [False, True] if dp * cp > 1 else [False]  # it shards over DP x CP: with both 1, nothing
    if pins.dist_opt is not None:
        dos = [pins.dist_opt]
    if pins.fsdp:
        dos = []
    experts = expert_values(space.model, pins.ep, pins.etp, tp, cp, dp)
    if not experts:  # only where EP or ETP is pinned: searched, (EP 1, ETP = TP) always fits
        rejected.append(Rejected(f"TP{tp}{f' CP{cp}' if cp > 1 else ''} PP{pp} DP{dp}", expert_reason(
            space.model, pins.ep, pins.etp, tp, cp, dp)))
        return out
    per_rank = space.global_batch // dp
    if pins.mb is not None and per_rank % pins.mb:
        rejected.append(Rejected(f"TP{tp} PP{pp} DP{dp} mb{pins.mb}", f"--micro-batch {pins.mb} does not divide the "
                                 f"{per_rank} samples per DP rank (global batch {space.global_batch} / DP {dp})"))
    for mb in [pins.mb] if pins.mb is not None and per_rank % pins.mb == 0 else divisors(per_rank):
        if pins.mb is not None and mb != pins.mb:
            continue
        nmb = space.global_batch // (dp * mb)
        if nmb > MAX_MICROBATCHES:
            rejected.append(Rejected(f"TP{tp} PP{pp} DP{dp} mb{mb}", f"{nmb} micro-batches (over {MAX_MICROBATCHES})"))
            continue
        vpps = tuple(lynx_vpp_values(space, pp, nmb))
        if not vpps:
            rejected.append(Rejected(f"TP{tp} PP{pp} DP{dp} mb{mb} VPP{pins.vpp}",
                                     "interleaving needs PP >= 2, a multiple of PP micro-batches and "
                                     "a layer per virtual stage"))
            continue
        out += [Core(Layout(tp, pp, 1, dp, sp, mb, do, cp, kind, ep=ep, etp=etp), vpps) for sp in sps for do in dos
                for ep, etp in experts]
        # the data-parallel sharding dimension; pinning the optimizer (--distributed-optimizer or not) pins it
        if dp * cp > 1 and not space.model.is_moe and (pins.fsdp or (pins.fsdp is None and pins.dist_opt is None)):
            if dp * cp % space.fsdp.instances:
                rejected.append(Rejected(f"TP{tp} PP{pp} DP{dp} FSDP", f"--num-distributed-optimizer-instances "
                                         f"{space.fsdp.instances} does not divide DP x CP = {dp * cp}"))
                continue
            out += [Core(Layout(tp, pp, 1, dp, sp, mb, False, cp, kind, fsdp=True, ep=ep, etp=etp), vpps)
                    for sp in sps for ep, etp in experts]
    return out


def method_sets(space: Space) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(lynx's methods, the stock framework's methods) the space plans (`Space.stock`). Ranked for torchtitan,
    Megatron's module lists, block and offloading are not planned: torchtitan cannot be told them (lynx's own
    methods cover what they would keep), and titan-sac only where torchtitan's block is priced in 16 bits."""
    if space.pins.methods is not None:
        names = space.pins.methods
    elif space.stock is Stock.TORCHTITAN:
        sac = space.model.family == TITAN_FAMILY and space.model.fp8 is None
        names = (LYNX_METHOD, *(n for n in TITAN_STOCK_METHODS if sac or n != "titan-sac")) + \
            (("lynx-offload",) if space.offload else ())
    else:
        names = (LYNX_METHOD, *STOCK_METHODS) + (OFFLOAD_METHODS if space.offload else ())
    return (tuple(n for n in names if not is_stock(n, space.stock)),
            tuple(n for n in names if is_stock(n, space.stock)))


def is_stock(method: str, stock: Stock = Stock.MEGATRON) -> bool:
    """Is `method` one of the framework's own settings (a stock candidate on its splits)?"""
    if stock is Stock.TORCHTITAN:
        return method in TITAN_STOCK_METHODS
    return method in STOCK_METHODS or method == STOCK_OFFLOAD


def layout_candidates(space: Space, lay: Layout) -> tuple[list[Candidate], list[Candidate]]:
    """(lynx's candidates, stock candidates) of one layout: lynx's methods once, each stock method once per split
    Megatron can express for the layout's (PP, VPP). Where no split fits, a stock method the user pinned is planned
    on lynx's partition instead (not stock); otherwise stock candidates need a split: deeper interleaving than any
    split allows is lynx's alone."""
    lynx, stock = method_sets(space)
    splits = stock_splits(space.model.num_layers, lay.pp, lay.vpp)
    own = [Candidate(lay, n, False) for n in lynx]
    if not splits:
        return own + ([Candidate(lay, n, False) for n in stock] if space.pins.methods is not None else []), []
    return own, [Candidate(lay, n, True, sp) for sp in splits for n in stock]


def candidates(space: Space) -> tuple[list[Candidate], list[Rejected]]:
    """Every (layout, method, split) of the space (`layout_candidates` of every layout)."""
    lays, rejected = layouts(space)
    out: list[Candidate] = []
    for lay in lays:
        own, stock = layout_candidates(space, lay)
        out += own + stock
    return out, rejected
