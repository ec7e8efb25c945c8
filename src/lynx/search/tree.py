"""The search's tree of candidates, expanded lazily in ascending order of lower bounds.

A `Core` (a layout with its interleaving open) is one node with the smallest bound of its layouts (1F1B on any
split, and interleaving on any split at its shallowest VPP: deeper interleaving only raises that bound). Popped,
it becomes one node per VPP for lynx's methods (any partition) and one per (VPP, Megatron split) for the stock
methods (a known partition: `bounds.partition_time_bound_s`). A node whose bound exceeds what it must beat is
pruned whole, its candidates counted and never built: the spaces of large clusters hold millions of candidates
and a few hundred reach the planner."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import IntEnum

from lynx.decisions import StageContext
from lynx.errors import LynxError
from lynx.methods.common import base_partition
from lynx.problem import PlanProblem, PlanResult
from lynx.search.bounds import (
    CHUNKED_METHODS,
    Pieces,
    frugal_reason,
    memory_bound_reason,
    method_pieces,
    partition_memory_reason,
    partition_statics,
    partition_time_bound_s,
    pieces,
    plain_s,
    policy_extra_s,
    static_memory_reason,
    step_s,
    time_bound_from,
)
from lynx.search.evaluate import LYNX_SEARCHED, Shared
from lynx.search.options import candidate_options
from lynx.search.space import Candidate, Core, Layout, Space, layout_candidates, method_sets
from lynx.search.splits import Split, chunks, stock_splits
from lynx.stack import LayerKind


class Kind(IntEnum):
    CORE = 0
    LYNX = 1
    STOCK = 2


@dataclass(frozen=True, slots=True)
class Node:
    kind: Kind
    core: Core
    layout: Layout | None = None
    split: Split | None = None
    tight: bool = False
    """A lynx interleaved node whose bound is on the dp split its screen plans (`Frontier.tighten`)."""
    plain: bool = False
    """A tight node whose bound is also the simulated time of that split recomputing nothing (`Frontier.tighten`)."""
    floored: bool = False
    """A plain node whose bound is also its candidates' smallest `Frontier.screen_bound` (`Frontier.tighten`)."""


def screened(lay: Layout) -> bool:
    """Whether lynx's candidates of the layout have one partition to bound before they are planned (`Frontier.tighten`):
    interleaved (the dp split its screen plans) or without a pipeline (every layer on the one stage). 1F1B with
    PP > 1 searches its partitions: its bound is the any-partition one."""
    return lay.vpp > 1 or lay.pp == 1


def count(space: Space, node: Node) -> int:
    """Candidates under the node (without building them)."""
    lynx, stock = method_sets(space)
    layers = space.model.num_layers
    if node.kind == Kind.LYNX:
        assert node.layout is not None
        pinned = bool(space.pins.methods) and not stock_splits(layers, node.layout.pp, node.layout.vpp)
        return len(lynx) + (len(stock) if pinned else 0)
    if node.kind == Kind.STOCK:
        return len(stock)
    total = 0
    for v in node.core.vpps:
        n = len(stock_splits(layers, node.core.layout.pp, v))
        total += len(lynx) + (len(stock) * n if n else (len(stock) if space.pins.methods is not None else 0))
    return total


FULL_FLOOR_REACH = 0.1
"""The full floors (`HeuCache.floor`) are solved only where the bound on the cheap ones, this much higher, would
prune: the cheap floor is 0.897 of the full one at the median stage (benchmarks/results/screen_bounds.json), and
where the search's lynx screens all sit near the top of the table (the Qwen3-235B search: every layout's
offloading screen close to the pick) no floor prunes and the full LPs are time spent for nothing."""


@dataclass(frozen=True, slots=True)
class _Screen:
    """`Frontier.screen_bound` so far: the bound, the stages' cheap and full floors solved (stage 0 first), their
    contexts."""

    bound: float
    cheap: tuple[float, ...]
    full: tuple[float, ...]
    ctxs: tuple[StageContext, ...]

    @property
    def done(self) -> bool:
        return len(self.full) == len(self.ctxs)


class Frontier:
    """The heap of open nodes, (bound, insertion order, node); `pop` gives the smallest bound first."""

    def __init__(self, shared: Shared, floors: bool = True) -> None:
        self.shared = shared
        self.floors = floors
        """Tighten plain nodes by their screen bounds (their LPs; an exhaustive search prunes nothing by them)."""
        self.heap: list[tuple[float, int, Node]] = []
        self.seq = itertools.count()
        self.invalid: list[tuple[Node, str]] = []
        self.memory: dict[tuple[Kind, Layout | None, Split | None, object], str] = {}
        self.statics: dict[tuple[Layout, Split | None], tuple[float, ...]] = {}
        """Each rank's static memory on a stock node's split (`bounds.partition_statics`), for its methods' bounds."""
        self.pieces: dict[tuple[object, ...], Pieces] = {}
        self.layout_pieces: dict[Layout, Pieces] = {}
        self.steps: dict[Layout, dict[tuple[int, int, tuple[LayerKind, ...] | None], float]] = {}
        self.static: dict[tuple[object, ...], str] = {}
        self.methods: dict[tuple[Node, str], float] = {}
        self.screens: dict[tuple[Layout, str], _Screen] = {}
        self.core_bounds: dict[tuple[object, ...], float] = {}

    def push(self, node: Node) -> None:
        try:
            bound = self._bound(node)
        except LynxError as e:
            self.invalid.append((node, str(e).splitlines()[0]))
            return
        heapq.heappush(self.heap, (bound, next(self.seq), node))

    def push_at(self, node: Node, bound: float, seq: int) -> None:
        """The node with its bound known (`bound`) and its insertion number given: a core taken in bound order
        (`run._Run._claim`) pops before every node pushed since the start at the same bound."""
        heapq.heappush(self.heap, (bound, seq, node))

    def bound(self, node: Node) -> float:
        """The node's bound (`push`'s); raises `LynxError` for a node whose problem is refused."""
        return self._bound(node)

    def pop(self) -> tuple[float, Node]:
        bound, _, node = heapq.heappop(self.heap)
        return bound, node

    def __len__(self) -> int:
        return len(self.heap)

    def tighten(self, node: Node, bound: float, prunes: Callable[[float], bool] | None = None) -> bool:
        """A lynx node with one partition to bound (`screened`: interleaved, or without a pipeline) popped on its
        any-split bound is pushed back with the bound of the dp split its screen plans
        (`methods.heu._interleaved_search` without refinement; the one stage without a pipeline), and popped on
        that, pushed back once more with the simulated time of the split keeping every activation (`plain_s`)
        unless the memory bounds refuse all its candidates, and popped on that, a last time with its candidates'
        smallest `screen_bound` (with
        `floors`); True when it was."""
        if node.kind != Kind.LYNX or node.floored or node.layout is None or not screened(node.layout):
            return False
        if node.plain:
            if not self.floors:
                return False
            methods = {c.method for c in self.candidates(node) if not self.memory_reason(node, c)}
            if "lynx-offload" in methods:  # its models relax lynx's (no offloading is one of its choices)
                methods.discard("lynx")
            floor = min((self.screen_bound(node, m, prunes) if m in LYNX_SEARCHED else 0.0 for m in methods),
                        default=0.0)
            heapq.heappush(self.heap, (max(bound, floor), next(self.seq), replace(node, floored=True)))
            return True
        problem = self.shared.problem(node.layout, None)
        part = base_partition(problem)
        if node.tight:
            if all(self.memory_reason(node, c) for c in self.candidates(node)):
                return False  # refused by the memory bounds when planned: no simulation spent on it
            # without a pipeline the split's bound is already the plain step's sum (no bubble to simulate)
            tighter = bound if node.layout.pp == 1 else max(bound, plain_s(problem, part))
            heapq.heappush(self.heap, (tighter, next(self.seq), replace(node, plain=True)))
            return True
        tight = max(bound, self._partition_bound(node.layout, problem, part.chunks or part.layers_per_stage))
        heapq.heappush(self.heap, (tight, next(self.seq), replace(node, tight=True)))
        return True

    def _bound(self, node: Node) -> float:
        sh = self.shared
        if node.kind == Kind.LYNX:
            assert node.layout is not None
            return time_bound_from(self._pieces(node.layout, sh.problem(node.layout, None)), node.layout.vpp)
        if node.kind == Kind.STOCK:  # the split's own checks run when the node is planned (`split_reason`)
            assert node.layout is not None and node.split is not None
            return self._partition_bound(node.layout, self._layout_problem(node), self.chunks(node))
        return self._core_bound(node.core)

    def split_reason(self, node: Node) -> str:
        """Why Megatron refuses a stock node's split ('' when it runs it): its problem's checks."""
        assert node.layout is not None
        try:
            self.shared.problem(node.layout, node.split)
        except LynxError as e:
            return str(e).splitlines()[0]
        return ""

    def _pieces(self, lay: Layout, problem: PlanProblem) -> Pieces:
        """`bounds.pieces` of the layout, once for all its VPPs (none of them depends on interleaving)."""
        key = replace(lay, vpp=1)
        p = self.layout_pieces.get(key)
        if p is None:
            p = self.layout_pieces[key] = pieces(problem)
        return p

    def _partition_bound(self, lay: Layout, problem: PlanProblem, chunks: tuple[int, ...]) -> float:
        """`partition_time_bound_s` with the layout's pieces and optimizer steps priced once."""
        return partition_time_bound_s(problem, chunks, self._pieces(lay, problem), self._step(lay, problem))

    def _step(self, lay: Layout, problem: PlanProblem) -> Callable[[int, int, tuple[LayerKind, ...] | None], float]:
        """`bounds.step_s` of the layout's ranks (of any VPP: a rank's step depends on its layers), each priced once."""
        flat = replace(lay, vpp=1)
        steps = self.steps.get(flat)
        if steps is None:
            steps = self.steps[flat] = {}

        def after(rank: int, layers: int, kinds: tuple[LayerKind, ...] | None) -> float:
            key = (rank, layers, kinds)  # the layout's own table: no layout hashed per rank
            got = steps.get(key)
            if got is None:
                got = steps[key] = step_s(problem, rank, layers, kinds)
            return got

        return after

    def _layout_problem(self, node: Node) -> PlanProblem:
        """The problem a stock node's bound is priced on: the layout's own (the pieces and the optimizer step do
        not depend on the split flags), or the split's where lynx's own partition is refused for the layout."""
        assert node.layout is not None
        try:
            return self.shared.problem(node.layout, None)
        except LynxError:
            return self.shared.problem(node.layout, node.split)

    def _core_bound(self, core: Core) -> float:
        """The smallest bound of the core's layouts: 1F1B, and interleaving at its shallowest VPP (the start-up,
        drain and chain terms only grow with VPP). The pieces are priced once per graph, DP and PP > 1 on an
        unchecked problem: nothing is planned from it, and a layout the checks refuse is refused when its own
        node is built."""
        sh, lay = self.shared, core.layout
        key = (lay.tp, lay.cp, lay.cp_comm_type, lay.sp, lay.mb, lay.ep, lay.etp, lay.dp, lay.pp > 1)
        if key not in self.pieces:
            opts = candidate_options(sh.base, sh.space, lay, None)
            problem = PlanProblem(sh.space.model, sh.space.hardware, sh.parallel(lay), sh.graph(lay), opts,
                                  sh.kinds(lay))
            self.pieces[key] = pieces(problem, fsdp=False)  # FSDP's terms depend on PP and micro-batches
        deep = min((v for v in core.vpps if v > 1), default=0)
        bkey = (key, lay.pp, 1 in core.vpps, deep)  # the cores of one layout's optimizer shardings share it
        got = self.core_bounds.get(bkey)
        if got is None:
            nmb = sh.space.global_batch // (lay.dp * lay.mb)
            p = replace(self.pieces[key], pp=lay.pp, nmb=nmb)
            got = self.core_bounds[bkey] = min(time_bound_from(p, v) for v in ((1,) if 1 in core.vpps else ())
                                               + ((deep,) if deep else ()))
        return got

    def method_bound(self, node: Node, cand: Candidate) -> float:
        """A stock candidate's own bound (0 where it has none beyond its node's): its split's
        `partition_time_bound_s` with every layer's step lengthened by the on-demand recomputation its method
        places in each layer (`rules.fixed_layer_policy`: none, full, selective, the module lists). The simulator
        charges that recomputation before each backward (`cost.pricing.layer_recompute`: Megatron's recompute is
        on demand, no window hosts it) beyond what an FSDP window hides (`Pieces.fsdp_win`, already in the layer's
        step); in a model of several layer kinds each layer its kind's (`bounds.method_pieces`)."""
        assert node.layout is not None
        key = (node, cand.method)
        if key not in self.methods:
            problem = self._layout_problem(node)
            longer = method_pieces(problem, cand.method, self._pieces(node.layout, problem))
            self.methods[key] = 0.0 if longer is None else partition_time_bound_s(
                problem, self.chunks(node), longer, self._step(node.layout, problem))
        return self.methods[key]

    def screen_bound(self, node: Node, method: str, prunes: Callable[[float], bool] | None = None) -> float:
        """A lynx interleaved candidate's bound on its screen (HEU on the dp split, as `tighten`'s): the split's
        `partition_time_bound_s` with each rank's on-demand recomputation per micro-batch at least its stage
        model's LP floor (`policy.heu.demand_floor`), the least any policy HEU can choose there charges. Within a
        few percent of the screen where memory binds (keeping everything does not fit), where the plain bound is
        tens of percent below; 0 where no floor is known (several layer kinds). The floors are solved stage by stage
        (stage 0, the most in flight, first), each first on its cheap relaxation (`HeuCache.floor`), then in full;
        once the bound with what is solved so far (the rest at 0) is one `prunes` accepts, the rest wait: the
        incumbents only get faster, so it prunes for good (decision 0255)."""
        assert node.layout is not None
        key = (node.layout, method)
        got = self.screens.get(key)
        if got is not None and (got.done or (prunes is not None and prunes(got.bound))):
            return got.bound
        sh = self.shared
        problem = sh.problem(node.layout, None)
        if problem.heterogeneous:
            self.screens[key] = _Screen(0.0, (), (), ())
            return 0.0
        part = base_partition(problem)
        chunks = part.chunks or part.layers_per_stage
        ctxs = got.ctxs if got is not None else tuple(problem.stage_contexts(part))
        cache = sh.heu_cache(problem, node.layout, method)
        levels = [list(got.cheap), list(got.full)] if got is not None else [[], []]
        bound = got.bound if got is not None else 0.0
        n = len(ctxs)
        for level, solved in enumerate(levels):
            if level == 1 and prunes is not None and not prunes(bound * (1 + FULL_FLOOR_REACH)):
                break  # the full floors would not prune it now (stays not done: asked again as incumbents improve)
            while len(solved) < n:
                solved.append(cache.floor(ctxs[len(solved)], cheap=level == 0))
                if solved[-1] > 0:
                    extra = tuple(max((lv[r] for lv in levels if r < len(lv)), default=0.0) for r in range(n))
                    bound = max(bound, partition_time_bound_s(problem, chunks, self._pieces(node.layout, problem),
                                                              self._step(node.layout, problem), extra))
                if prunes is not None and prunes(bound):
                    self.screens[key] = _Screen(bound, tuple(levels[0]), tuple(levels[1]), ctxs)
                    return bound
        self.screens[key] = _Screen(bound, tuple(levels[0]), tuple(levels[1]), ctxs)
        return bound

    def policy_bound(self, node: Node, problem: PlanProblem, result: PlanResult) -> float:
        """A stock node's split bound with the on-demand recomputation its method's policies place on each rank
        (`bounds.policy_extra_s`): Megatron's block, whose N is known only once the method has chosen it."""
        assert node.layout is not None
        p = self._pieces(node.layout, problem)
        return partition_time_bound_s(problem, self.chunks(node), p, self._step(node.layout, problem),
                                      policy_extra_s(problem, result, p))

    def static_reason(self, core: Core) -> str:
        """Why no candidate of the core fits on static memory alone ('' when one might: `bounds.static_memory_reason`),
        once per sharding of the parameters (what static memory depends on)."""
        sh, lay = self.shared, core.layout
        key = (lay.tp, lay.cp, lay.pp, lay.dp, lay.dist_opt, lay.fsdp, lay.ep, lay.etp)
        if key not in self.static:
            problem = PlanProblem(sh.space.model, sh.space.hardware, sh.parallel(lay), sh.graph(lay),
                                  candidate_options(sh.base, sh.space, lay, None), sh.kinds(lay))
            self.static[key] = static_memory_reason(problem)
        return self.static[key]

    def chunks(self, node: Node) -> tuple[int, ...]:
        assert node.layout is not None and node.split is not None
        lay = node.layout
        c = chunks(node.split, self.shared.space.model.num_layers, lay.pp, lay.vpp)
        assert c is not None  # stock nodes are made from valid splits only
        return c

    def expand(self, node: Node) -> None:
        """A core's children: lynx's node per VPP (shallow first: ties pop in that order), stock nodes per split."""
        layers = self.shared.space.model.num_layers
        for v in node.core.vpps:
            lay = node.core.at(v)
            self.push(Node(Kind.LYNX, node.core, lay))
            for split in stock_splits(layers, lay.pp, v):
                self.push(Node(Kind.STOCK, node.core, lay, split))

    def candidates(self, node: Node) -> list[Candidate]:
        """A lynx or stock node's candidates."""
        assert node.layout is not None
        own, stock = layout_candidates(self.shared.space, node.layout)
        if node.kind == Kind.LYNX:
            return own
        return [c for c in stock if c.split == node.split]

    def memory_reason(self, node: Node, cand: Candidate) -> str:
        """Why no plan of the candidate can fit ('' when one might): `bounds`' memory bound, on the known
        partition for stock candidates."""
        assert node.layout is not None
        # the bound differs only for chunked methods; it reads the node's layout and split, not how far its time
        # bound has been tightened (a lynx node is asked again once tight, and once plain)
        # a stock candidate's bound reads its method's fixed layer policy (`bounds.partition_memory_reason`)
        how: object = cand.method if node.kind == Kind.STOCK else cand.method in CHUNKED_METHODS
        key = (node.kind, node.layout, node.split, how)
        if key not in self.memory:
            problem = self.shared.problem(node.layout, node.split if node.kind == Kind.STOCK else None)
            if node.kind == Kind.STOCK:
                skey = (node.layout, node.split)
                statics = self.statics.get(skey)
                if statics is None:
                    statics = self.statics[skey] = partition_statics(problem, self.chunks(node))
                self.memory[key] = partition_memory_reason(problem, self.chunks(node), cand.method, statics)
            else:
                self.memory[key] = memory_bound_reason(problem, cand.method) or self._frugal(problem, cand)
        return self.memory[key]

    @staticmethod
    def _frugal(problem: PlanProblem, cand: Candidate) -> str:
        """lynx's interleaved screen plans the dp split (`methods.heu`): no HEU policy fits it where full
        recomputation does not (`bounds.frugal_reason`)."""
        if cand.method not in LYNX_SEARCHED or problem.options.vpp == 1:
            return ""
        return frugal_reason(problem, base_partition(problem))
