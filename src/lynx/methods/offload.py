"""Planning methods with activation offloading (docs/offload.md): `lynx-offload` (lynx with offload as HEU's
third choice), `mc-offload` (Megatron-Core's stock fine-grained activation offloading) and `offload-all`
(keep everything, offload everything). All are priced by the same simulator."""

from __future__ import annotations

from lynx.errors import SpecError
from lynx.methods.common import megatron_partition, one_kind_only, per_stage
from lynx.methods.heu import lynx_search
from lynx.policy.megatron_offload import STOCK_MODULES, megatron_offload_policy, offload_all_policy
from lynx.policy.offload import offload_link
from lynx.problem import PlanProblem, PlanResult

NO_ATTN_NORM = ("attn_norm (the layer input) is not modelled: lynx always stores it, Megatron would offload it "
                "too (docs/offload.md)")


def _need_link(problem: PlanProblem, method: str) -> None:
    if offload_link(problem.hardware) is None:
        raise SpecError(f"{method}: hardware {problem.hardware.name!r} has no host link; give host_link "
                        "(d2h_Bps, h2d_Bps, ...) in the hardware file")


def plan_lynx_offload(problem: PlanProblem) -> PlanResult:
    one_kind_only(problem, "lynx-offload")
    _need_link(problem, "lynx-offload")
    return lynx_search(problem, "lynx-offload")[0]


def plan_mc_offload(problem: PlanProblem) -> PlanResult:
    one_kind_only(problem, "mc-offload")
    _need_link(problem, "mc-offload")
    res = per_stage(problem, "mc-offload", lambda c, g: megatron_offload_policy(c, g, STOCK_MODULES),
                    megatron_partition(problem))
    note = (f"--fine-grained-activation-offloading --offload-modules {' '.join(STOCK_MODULES)} "
            "--activation-offload-fraction 1.0 --delta-offload-bytes-across-pp-ranks 0; " + NO_ATTN_NORM)
    return PlanResult(res.method, res.partition, res.policies, (note,), res.search_time_s)


def plan_offload_all(problem: PlanProblem) -> PlanResult:
    one_kind_only(problem, "offload-all")
    _need_link(problem, "offload-all")
    return per_stage(problem, "offload-all", offload_all_policy, megatron_partition(problem))
