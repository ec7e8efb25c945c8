"""Shared fixtures: small problems built from presets."""

from __future__ import annotations

import pytest

from lynx.api import make_problem
from lynx.problem import PlanOptions, PlanProblem
from lynx.spec import ParallelSpec, load_hardware, load_model


def problem_for(model: str = "gpt-7b", hardware: str = "a100-40g-nvlink", tp: int = 4, pp: int = 4, mb: int = 8,
                gb: int = 128, seq: int = 1024, sp: bool = False, **opts: object) -> PlanProblem:
    par = ParallelSpec(tp=tp, pp=pp, micro_batch_size=mb, global_batch_size=gb, seq_length=seq, sequence_parallel=sp)
    return make_problem(load_model(model), load_hardware(hardware), par, PlanOptions(**opts))  # type: ignore[arg-type]


@pytest.fixture
def gpt7b_problem() -> PlanProblem:
    return problem_for()


@pytest.fixture
def one_torch_thread():  # type: ignore[no-untyped-def]
    """Tiny shapes: one intra-op thread is fastest, and OpenMP threads spinning against other jobs on a
    2-core machine made the runtime tests 50x slower."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
