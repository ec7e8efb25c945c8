"""Stage problems solved side by side (`milp.concurrent_solves`, decision 0261): the answers, the counts and the
order are those of one solve after the other, whatever the thread count; a task's error reaches the caller."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time

import pytest

from lynx.api import make_problem
from lynx.methods.common import base_partition
from lynx.methods.heu import heu_options, lynx_search
from lynx.milp import Milp, concurrent_solves, solve_concurrently, solve_threads
from lynx.models import load_model
from lynx.partition.lynx import search_partitions
from lynx.policy.heu import HeuCache
from lynx.problem import PlanOptions, PlanProblem
from lynx.spec import ParallelSpec, load_hardware


def _knapsack(seed: int) -> Milp:
    """A small 0/1 knapsack HiGHS takes a few milliseconds on."""
    rng = random.Random(seed)
    m = Milp()
    xs = [m.binary(f"x{i}", cost=-rng.uniform(1, 10)) for i in range(30)]
    m.le({x: rng.uniform(1, 10) for x in xs}, 40.0)
    return m


def test_tasks_come_back_in_order_with_each_ones_answer() -> None:
    models = [_knapsack(s) for s in range(8)]
    alone = [m.solve().objective for m in models]
    seen: set[str] = set()

    def task(m: Milp) -> float:
        seen.add(threading.current_thread().name)
        return m.solve().objective

    with concurrent_solves(3):
        assert solve_threads() == 3
        together = solve_concurrently([lambda m=m: task(m) for m in models])
    assert solve_threads() == 1
    assert together == alone
    assert "lynx-solve" in seen  # a helper thread took some: they did run side by side


def test_one_thread_runs_the_tasks_here_one_after_the_other() -> None:
    names: list[str] = []

    def task(i: int) -> int:
        names.append(threading.current_thread().name)
        return i

    out = solve_concurrently([lambda i=i: task(i) for i in range(4)])
    assert out == [0, 1, 2, 3]
    assert set(names) == {threading.current_thread().name}


def test_the_first_failing_task_in_order_is_raised_after_every_task_ends() -> None:
    ended: list[int] = []

    def task(i: int) -> int:
        time.sleep(0.01 * (5 - i))
        ended.append(i)
        if i in (1, 3):
            raise ValueError(f"task {i}")
        return i

    with concurrent_solves(2), pytest.raises(ValueError, match="task 1"):
        solve_concurrently([lambda i=i: task(i) for i in range(5)])
    assert sorted(ended) == [0, 1, 2, 3, 4]


def test_a_nested_call_runs_in_turn_on_the_thread_that_makes_it() -> None:
    def inner() -> tuple[list[int], set[str]]:
        here = threading.current_thread().name
        names: set[str] = set()

        def task(i: int) -> int:
            names.add(threading.current_thread().name)
            return i

        got = solve_concurrently([lambda: task(1), lambda: task(2)])
        assert names == {here}  # neither handed to another thread
        return got, names

    with concurrent_solves(2):
        out = solve_concurrently([inner, inner, inner])
    assert [got for got, _ in out] == [[1, 2]] * 3


def test_a_thread_count_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"), concurrent_solves(0):
        pass


def _problem() -> PlanProblem:
    par = ParallelSpec(tp=8, pp=8, dp=1, micro_batch_size=1, global_batch_size=64, seq_length=4096)
    return make_problem(load_model("llama2-70b"), load_hardware("h100-80g-nvlink"), par,
                        PlanOptions(budget_bytes=36 * 2**30))


def test_a_pipelines_stage_problems_give_the_same_policies_and_counts_side_by_side() -> None:
    problem = _problem()
    ctxs = problem.stage_contexts(base_partition(problem))
    ctxs = ctxs + ctxs[:3]  # repeated problems: hits, as one after the other
    one = HeuCache(problem.graph, heu_options(problem, "lynx"))
    expect = [one.get(c) for c in ctxs]
    two = HeuCache(problem.graph, heu_options(problem, "lynx"))
    with concurrent_solves(2):
        got = two.get_all(ctxs)
    assert [getattr(p, "layers", p) for p in got] == [getattr(p, "layers", p) for p in expect]
    assert (two.solves, two.hits) == (one.solves, one.hits) == (8, 3)
    assert list(two.entries) != [] and set(two.entries) == set(one.entries)


def test_the_partition_search_evaluates_the_same_costs_given_them_together() -> None:
    calls: list[tuple[int, int]] = []

    def cost(stage: int, n: int) -> float:
        calls.append((stage, n))
        return n * (1.0 + 0.3 * stage) + (5.0 if n > 6 else 0.0)

    alone = search_partitions(32, 5, cost)
    batches: list[int] = []

    def many(keys):  # type: ignore[no-untyped-def]
        batches.append(len(keys))
        return [cost(s, n) for s, n in keys]

    calls.clear()
    together = search_partitions(32, 5, cost, many=many)
    assert (together.greedy, together.exact, together.evaluations) == (alone.greedy, alone.exact, alone.evaluations)
    assert len(calls) == together.evaluations  # nothing evaluated twice or beyond what the searches need
    assert batches and batches[0] == 5  # the greedy loop's starting split in one batch


def test_lynx_plans_the_same_with_two_threads() -> None:
    problem = _problem()
    one = lynx_search(problem, "lynx")[0]
    with concurrent_solves(2):
        two = lynx_search(problem, "lynx")[0]
    assert two.partition == one.partition
    assert [(p.layers, p.stats.objective) for p in two.policies] == [(p.layers, p.stats.objective)
                                                                      for p in one.policies]


def test_stdout_is_lynxs_after_solves_side_by_side() -> None:
    """Each solve builds its `Highs` with descriptor 1 pointed at /dev/null (highspy's banner); threads doing it
    at once must not leave stdout there: what the process prints afterwards arrives, and no banner does."""
    code = (
        "from lynx.milp import Milp, concurrent_solves, solve_concurrently\n"
        "m = Milp(); x = m.binary('x', cost=-1.0); m.le({x: 1.0}, 1.0)\n"
        "with concurrent_solves(4):\n"
        "    for _ in range(25):\n"
        "        solve_concurrently([m.solve for _ in range(8)])\n"
        "print('after the solves')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout == "after the solves\n"
