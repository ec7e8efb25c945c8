"""Which FSDP plans `lynx train` runs (`lynx.runtime.fsdp.check_fsdp`): torch FSDP2 at TP 1, PP 1, CP 1, DP > 1
without HSDP; everything else one `PlanFormatError` line naming what the plan has (the CLI prints it as
`lynx: error:`, exit 2: tests/integration/test_runtime_fsdp.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from lynx.cost.fsdp import DDP, FSDP2, DpMode, DpSharding, Sharding  # noqa: E402
from lynx.cost.titan_fsdp import Reshard  # noqa: E402
from lynx.errors import PlanFormatError  # noqa: E402
from lynx.runtime.fsdp import FsdpRun, check_fsdp  # noqa: E402


def test_ddp_is_not_fsdp_and_fsdp2_reshards_as_the_plan_prices_it() -> None:
    assert check_fsdp("p.json", DDP, 2, 2, 1, 1, 2) is None
    assert check_fsdp("p.json", FSDP2, 1, 1, 1, 1, 2) == FsdpRun(reshard_after_forward=True)
    never = DpSharding(DpMode.TORCH_FSDP2, reshard=Reshard.NEVER)
    assert check_fsdp("p.json", never, 1, 1, 1, 1, 2) == FsdpRun(reshard_after_forward=False)


@pytest.mark.parametrize(("ds", "layout", "named"), [
    (FSDP2, (2, 1, 1, 1, 2), "TP 2"),
    (FSDP2, (1, 2, 1, 1, 2), "PP 2"),
    (FSDP2, (1, 1, 2, 1, 2), "VPP 2"),
    (FSDP2, (1, 1, 1, 2, 2), "CP 2"),
    (FSDP2, (1, 1, 1, 1, 1), "DP 1"),
    (DpSharding(DpMode.TORCH_FSDP2, instances=2), (1, 1, 1, 1, 2), "HSDP replicas 2"),
    (DpSharding(DpMode.MEGATRON_FSDP, Sharding.OPTIM_GRADS), (1, 1, 1, 1, 2), "Megatron-FSDP"),
])
def test_what_the_runtime_cannot_run_is_one_line(ds: DpSharding, layout: tuple[int, int, int, int, int],
                                                 named: str) -> None:
    with pytest.raises(PlanFormatError) as e:
        check_fsdp("p.json", ds, *layout)
    msg = str(e.value)
    assert msg.startswith("p.json: ") and named in msg and "\n" not in msg, msg
