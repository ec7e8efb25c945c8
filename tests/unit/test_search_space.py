"""The configuration search's larger space and what it prints: published recipes priced as their own rows,
Megatron's production overlaps assumed per layout (and switched off), methods that cannot beat a cheaper one that
fits, the full-recomputation feasibility check, the MFU convention, and the plain progress line."""

from __future__ import annotations

import math

import pytest

from lynx.models import load_model
from lynx.problem import PlanOptions
from lynx.search import Pins, Space, search
from lynx.search.options import candidate_options
from lynx.search.recipes import applicable
from lynx.search.space import Layout
from lynx.search.splits import Split
from lynx.spec import GiB, load_hardware

H100 = "h100-80g-nvlink"


def test_published_recipes_apply_to_their_jobs() -> None:
    hw = load_hardware(H100)
    (nv,) = applicable(Space(load_model("llama3-70b"), hw, 64, 128, 8192))
    assert nv.candidate is not None and nv.candidate.stock and nv.candidate.recipe == "NVIDIA llama3_70b"
    assert nv.candidate.layout == Layout(4, 4, 5, 2, True, 1, True, 2, "p2p")  # TP4 PP4 VPP5 CP2, DP 64 / 32
    big = {a.recipe.name: a for a in applicable(Space(load_model("llama3.1-405b"), hw, 1024, 2048, 8192))}
    perf = big["NVIDIA llama31_405b 1024xH100"].candidate
    assert perf is not None and perf.split == Split(embedding=True, loss=True) and perf.layout.vpp == 8
    assert big["NVIDIA dgxc llama3.1 405b"].candidate is None  # TP8 PP9 CP2 = 144 does not divide 1,024 GPUs
    assert "does not divide" in big["NVIDIA dgxc llama3.1 405b"].reason
    assert not applicable(Space(load_model("llama3-70b"), hw, 64, 128, 4096))  # no recipe at 4k tokens
    assert not applicable(Space(load_model("gpt-7b"), hw, 64, 128, 8192))


def test_recipes_are_rows_of_their_own_not_the_stock_row() -> None:
    hw = load_hardware(H100)
    space = Space(load_model("llama3-8b"), hw, 8, 16, 8192, Pins(tp=1, cp=2, pp=1, mb=1, sp=False, dist_opt=True,
                                                                  methods=("none", "full")), cp_comm_type="p2p")
    res = search(space, PlanOptions(budget_bytes=200 * GiB))
    assert res.recipes and all(o is not None and o.candidate.recipe for _, o in res.recipes)
    assert res.best_stock is not None and not res.best_stock.candidate.recipe
    recipe = res.best_recipe
    assert recipe is not None and recipe.fits
    # the same layout and method found by the search prices the same: one pricing path
    same = next(o for o in res.ranked if o.candidate.layout == recipe.candidate.layout
                and o.candidate.method == recipe.candidate.method and o.candidate.split == recipe.candidate.split)
    assert same.iteration_s == recipe.iteration_s

    # --target megatron prices the recipes in its first batch, beside the finalists (one round over the processes,
    # not one more after the ranking), and every recipe row is priced for the target
    from lynx.request import Target
    from lynx.search.prices import price_in_turn
    from lynx.search.targets import rank_for_target

    batches: list[list[object]] = []

    def pricer(outs, target, variants=True):  # noqa: ANN001, ANN202
        batches.append(list(outs))
        return price_in_turn(outs, target, variants)

    ranked = rank_for_target(res, Target.MEGATRON, 5, pricer)
    planned = [o for _, o in res.recipes if o is not None and o.plan is not None]
    assert planned and all(any(o is x for x in batches[0]) for o in planned)
    assert all(o is not None and o.priced_for == "megatron" for _, o in ranked.recipes)


def test_production_overlaps_where_megatron_allows_them() -> None:
    hw = load_hardware(H100)
    space = Space(load_model("llama3-8b"), hw, 8, 16, 8192)
    base = PlanOptions()
    on = candidate_options(base, space, Layout(2, 1, 1, 4, True, 1, True), None)
    assert on.overlap_grad_reduce and on.overlap_param_gather and on.tp_comm_overlap
    plain = candidate_options(base, space, Layout(2, 1, 1, 4, False, 1, False), None)
    assert plain.overlap_grad_reduce and not plain.overlap_param_gather and not plain.tp_comm_overlap
    off = Space(load_model("llama3-8b"), hw, 8, 16, 8192, production_overlaps=False)
    none = candidate_options(base, off, Layout(2, 1, 1, 4, True, 1, True), None)
    assert not (none.overlap_grad_reduce or none.overlap_param_gather or none.tp_comm_overlap)
    given = candidate_options(PlanOptions(overlap_grad_reduce=True), off, Layout(2, 1, 1, 4, True, 1, True), None)
    assert given.overlap_grad_reduce  # a flag the user gives holds for every candidate
    split = candidate_options(base, space, Layout(1, 4, 1, 2, False, 1, True), Split(first=7, last=7))
    assert (split.decoder_first_pipeline_num_layers, split.decoder_last_pipeline_num_layers) == (7, 7)


def test_dominated_methods_are_no_faster_than_the_cheaper_one_that_fits() -> None:
    """The dominance the search prunes by, checked on an exhaustive search: on every (layout, split) where a method
    recomputing a subset fits, the larger one is no faster."""
    from lynx.search.dominance import dominated
    from lynx.search.evaluate import Outcome

    space = Space(load_model("gpt-tiny"), load_hardware("a100-40g-nvlink"), 4, 16, 512, Pins(vpp=1), offload=True)
    res = search(space, PlanOptions(budget_bytes=0.08 * GiB), exhaustive=True)
    nodes: dict[tuple[object, ...], dict[str, Outcome]] = {}
    for o in res.outcomes:
        if o.fits:
            nodes.setdefault((o.candidate.layout, o.candidate.split, o.candidate.stock), {})[o.candidate.method] = o
    checked = 0
    for fits in nodes.values():
        for m, o in fits.items():
            cheaper = dominated(m, {k: v for k, v in fits.items() if k != m}).split(" ")[0]
            if cheaper:
                assert o.iteration_s >= fits[cheaper].iteration_s * (1 - 1e-12), (m, cheaper)
                checked += 1
    assert checked > 10


def test_mfu_names_its_convention_and_the_causal_figure() -> None:
    from lynx.search.mfu import causal_fraction, shows_causal

    m = load_model("llama3-70b")
    assert causal_fraction(m, 131072) == pytest.approx(0.644, abs=0.002)  # 67.6% counted full: 43.5% executed
    assert 0.9 < causal_fraction(m, 8192) < 1.0
    assert shows_causal(m, 8192) and not math.isclose(causal_fraction(m, 8192), 1.0)


def test_pareto_front_is_the_non_dominated_set() -> None:
    from lynx.search.evaluate import Outcome
    from lynx.search.plot import pareto_front
    from lynx.search.space import Candidate

    lay = Layout(1, 1, 1, 1, False, 1, False)

    def o(t: float, peak: float) -> Outcome:
        return Outcome(Candidate(lay, "lynx", False), "planned", 0.0, iteration_s=t, stage_peak_gib=(peak,))

    pts = [o(3.0, 10.0), o(2.0, 20.0), o(2.5, 30.0), o(1.0, 40.0), o(1.5, 35.0)]
    front = pareto_front(pts)
    assert [(x.iteration_s, x.stage_peak_gib[0]) for x in front] == [(3.0, 10.0), (2.0, 20.0), (1.5, 35.0),
                                                                     (1.0, 40.0)]


def test_plain_progress_lines_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    from lynx.cli import main

    argv = ["plan", "--model", "gpt-tiny", "--hardware", "a100-40g-nvlink", "--gpus", "2", "--global-batch", "4",
            "--seq-len", "256", "--vpp", "1", "--method", "full", "--json"]
    try:
        main(argv)
    except SystemExit as e:
        assert e.code in (0, None)
    _, err = capsys.readouterr()
    assert "lynx: searching:" in err and "candidates decided" in err and "\x1b" not in err


def test_no_production_overlaps_is_a_search_switch(capsys: pytest.CaptureFixture[str]) -> None:
    from lynx.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "gpt-tiny", "--tp", "1", "--pp", "1", "--no-production-overlaps"])
    assert e.value.code == 2
    _, err = capsys.readouterr()
    assert "lynx: error: --no-production-overlaps" in err and "Traceback" not in err


def test_megatron_partition_builds_the_split_knobs_with_interleaving() -> None:
    """`methods.common.megatron_partition` (what every stock method plans on) builds Megatron-Core's chunks for the
    split knobs with VPP too, as `splits.chunks` enumerates them, and refuses what Megatron-Core refuses."""
    from dataclasses import replace

    from lynx.api import make_problem
    from lynx.errors import SpecError
    from lynx.methods.common import megatron_partition
    from lynx.search.splits import chunks
    from lynx.spec import ParallelSpec

    m, hw = load_model("llama3.1-405b"), load_hardware(H100)
    par = ParallelSpec(tp=8, pp=8, dp=8, cp=2, sequence_parallel=True, micro_batch_size=1, global_batch_size=1024,
                       seq_length=8192)
    opts = PlanOptions(vpp=8, nodes=128, account_for_embedding_in_pipeline_split=True,
                       account_for_loss_in_pipeline_split=True)
    part = megatron_partition(make_problem(m, hw, par, opts))
    assert part.chunks == chunks(Split(embedding=True, loss=True), 126, 8, 8)
    first = make_problem(m, hw, par, replace(opts, vpp=2, account_for_embedding_in_pipeline_split=False,
                                             account_for_loss_in_pipeline_split=False,
                                             decoder_first_pipeline_num_layers=16, decoder_last_pipeline_num_layers=14))
    assert megatron_partition(first).chunks == chunks(Split(first=16, last=14), 126, 8, 2)
    odd = make_problem(m, hw, par, replace(opts, vpp=4))  # (126 + 2) / 8 = 16 per rank, 4 per chunk: fine
    assert megatron_partition(odd).chunks[0] == 3
    with pytest.raises(SpecError, match="Megatron refuses"):
        megatron_partition(make_problem(m, hw, par, replace(opts, vpp=3)))  # 16 layers per rank over 3 chunks
