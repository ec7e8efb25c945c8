"""The private torch.distributed.pipelining API lynx uses is where runtime/_torch_pipelining.py expects it;
this test fails with the module's message when torch changes underneath."""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

from lynx.runtime.pipeline import _torch_pipelining as tpp  # noqa: E402


def test_installed_torch_is_a_tested_version_with_the_private_api() -> None:
    tpp.check_torch()  # raises TorchPipeliningError naming what is missing


def test_an_untested_version_is_refused_with_one_clear_line() -> None:
    with pytest.raises(tpp.TorchPipeliningError, match=r"torch 2\.99\.0: .*tested with torch 2\.11, 2\.13 only"):
        tpp.check_torch("2.99.0")


def test_the_runtime_internals_we_reimplement_are_unchanged() -> None:
    """Our custom F/B functions mirror _PipelineScheduleRuntime's own branches: the attributes and
    signatures they touch must still exist."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import _PipelineStageBase

    rt = schedules._PipelineScheduleRuntime
    src = inspect.getsource(rt._step_microbatches)
    for name in ("fwd_recv_ops", "bwd_recv_ops", "backward_counter", "_comp_type_to_function_map",
                 "set_local_fwd_input", "set_local_bwd_input", "get_local_bwd_output"):
        assert name in src, name
    assert "save_forward_output" in inspect.signature(_PipelineStageBase.forward_one_chunk).parameters
    assert {"loss", "full_backward", "last_backward"} <= set(
        inspect.signature(_PipelineStageBase.backward_one_chunk).parameters)
    assert list(inspect.signature(rt._maybe_compute_loss).parameters)[1:5] == [
        "stage", "output", "target_mbs", "mb_index"]


def test_receives_are_posted_before_the_sends_ahead_of_them_and_keep_their_order() -> None:
    """torch lowers `0F2 0SEND_F2 0RECV_B1`; over gloo the gradient would then wait for the forward and the
    activation to cross first. lynx posts each receive as early as it can; receives keep their order among
    themselves (gloo matches them to sends in posting order), and sends and compute actions keep theirs."""
    from torch.distributed.pipelining import schedules as S

    rows = {r: [S._Action.from_str(a) for a in row.split()] for r, row in
            enumerate(["0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3", "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"])}
    lowered = S._add_send_recv(rows, stage_to_rank=lambda s: s, num_stages=2)
    assert " ".join(map(str, lowered[0][6:9])) == "0F2 0SEND_F2 0RECV_B1"  # torch's order (what this fixes)
    for order in lowered.values():
        fixed = tpp.receives_before_sends(order)
        assert sorted(map(str, fixed)) == sorted(map(str, order))
        kinds = [a.computation_type.name for a in order]
        assert [str(a) for a in fixed if "RECV" in str(a)] == [str(a) for a in order if "RECV" in str(a)]
        assert [str(a) for a in fixed if a.computation_type.name in ("FORWARD", "FULL_BACKWARD")] == \
            [str(a) for a, k in zip(order, kinds, strict=True) if k in ("FORWARD", "FULL_BACKWARD")]
        for i in range(1, len(fixed)):
            assert not ("SEND" in fixed[i - 1].computation_type.name and "RECV" in fixed[i].computation_type.name)
        others = [str(a) for a in order if "RECV" not in a.computation_type.name]
        assert [str(a) for a in fixed if "RECV" not in a.computation_type.name] == others
    fixed0 = [str(a) for a in tpp.receives_before_sends(lowered[0])]
    assert fixed0.index("0RECV_B1") < fixed0.index("0F2") < fixed0.index("0SEND_F2")
