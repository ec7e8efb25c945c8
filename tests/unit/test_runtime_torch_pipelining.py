"""The private torch.distributed.pipelining API lynx uses is where runtime/_torch_pipelining.py expects it;
this test fails with the module's message when torch changes underneath."""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

from lynx.runtime import _torch_pipelining as tpp  # noqa: E402


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
