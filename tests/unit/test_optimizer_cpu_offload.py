"""Megatron-Core's optimizer CPU offload (`cost.optimizer_offload`): the GPU keeps HybridDeviceOptimizer's fp32
state for the part it steps, the host steps the rest after copying its gradients down and before copying its
parameters up, and the flags are read by `lynx plan`, `--from-megatron` and written by `lynx export megatron`."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lynx.api import plan as plan_with
from lynx.checks import check_inputs
from lynx.cost.optimizer_offload import HOST_BYTES, CpuOffload, host_bytes, host_step_s
from lynx.cost.static_memory import OptimizerPrecision, recipe_for
from lynx.errors import SpecError
from lynx.export.megatron import build_megatron, run_flags
from lynx.export.megatron_args import parse_megatron_args
from lynx.export.megatron_optimizer import optimizer_of
from lynx.export.source import source_from
from lynx.spec import HostLink, load_hardware
from tests.conftest import problem_for

PAO = OptimizerPrecision(use_precision_aware_optimizer=True)


def offload(fraction: float = 1.0, overlap: bool = False, **kw: object) -> OptimizerPrecision:
    return replace(PAO, cpu_offload=CpuOffload(fraction, overlap), **kw)  # type: ignore[arg-type]


def test_the_gpu_keeps_fp32_state_for_what_it_steps() -> None:
    # bf16 params, fp32 grads, and (1 - f) of the fp32 main params and moments: 2 + 4 + 12 (1 - f) / DP
    for f in (0.0, 0.25, 1.0):
        r = recipe_for("megatron-bf16", None, offload(f))
        assert r.bytes_per_param(4, True) == pytest.approx(6 + 12 * (1 - f) / 4)
    # HybridDeviceOptimizer builds its Adams without the precision-aware dtypes: 12 bytes whatever they say
    low = offload(0.5, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16", main_params_dtype="fp16")
    assert recipe_for("megatron-bf16", None, low).state_bytes == pytest.approx(6.0)
    assert host_bytes(CpuOffload(0.5), 1e9) == pytest.approx(0.5e9 * HOST_BYTES)


def test_the_host_step_with_and_without_the_overlap() -> None:
    host = HostLink(d2h_Bps=20e9, h2d_Bps=10e9, gpus_per_link=2, cpu_adam_elements_per_s=1e9)
    n, gpu = 2e9, 0.05
    d2h, h2d, cpu = 0.5 * n * 4 / 10e9, 0.5 * n * 2 / 5e9, 0.5 * n / 1e9  # two GPUs share each direction
    assert host_step_s(CpuOffload(0.5), n, 2.0, gpu, host, 8) == pytest.approx(d2h + max(0.5 * gpu, cpu) + h2d)
    assert host_step_s(CpuOffload(0.5, True), n, 2.0, gpu, host, 8) == pytest.approx(max(0.5 * gpu, d2h, cpu, h2d))
    assert host_step_s(CpuOffload(0.0), n, 2.0, gpu, host, 8) == pytest.approx(gpu)


def test_a_plan_prices_the_host_step_and_frees_the_state() -> None:
    base = problem_for(model="gpt-7b", tp=2, pp=2, mb=1, gb=32, precision="megatron-bf16", distributed_optimizer=True)
    base = replace(base, parallel=replace(base.parallel, dp=2))
    on = replace(base, options=replace(base.options, optimizer_precision=offload(1.0)))
    overlapped = replace(base, options=replace(base.options, optimizer_precision=offload(1.0, True)))
    a, b, c = (plan_with(p, "full").sim for p in (base, on, overlapped))
    assert b.iteration_time_s > c.iteration_time_s > a.iteration_time_s
    static = [on.stage_context(s, n).static_bytes for s, n in enumerate((16, 16))]
    assert static[0] < base.stage_context(0, 16).static_bytes
    # the added time is about the host step of the first stage's shard (the stages step at once; its GPU step,
    # a few ms, is what the host step replaces)
    host = on.hardware.host()
    assert host is not None
    elements = (base.stage_context(0, 16).static_bytes - static[0]) / 12.0  # 12 B freed per element of the shard
    one = elements * (4 / (host.d2h_Bps / host.gpus_per_link) + 1 / host.cpu_adam_elements_per_s
                      + 2 / (host.h2d_Bps / host.gpus_per_link))
    assert b.iteration_time_s - a.iteration_time_s == pytest.approx(one, rel=0.05)


def test_checks_name_the_flag() -> None:
    p = problem_for(precision="megatron-bf16", distributed_optimizer=True)
    with pytest.raises(SpecError, match="needs --use-precision-aware-optimizer"):
        check_inputs(p.model, p.hardware, p.parallel,
                     replace(p.options, optimizer_precision=replace(offload(), use_precision_aware_optimizer=False)))
    with pytest.raises(SpecError, match="--optimizer-cpu-offload: Megatron's bf16 recipe only"):
        q = problem_for(precision="paper")
        check_inputs(q.model, q.hardware, q.parallel, replace(q.options, optimizer_precision=offload()))
    with pytest.raises(SpecError, match="with --bytes-per-param"):
        check_inputs(p.model, p.hardware, p.parallel,
                     replace(p.options, optimizer_precision=offload(), bytes_per_param=20.0))
    ascend = load_hardware("ascend-910")
    assert ascend.host() is None
    with pytest.raises(SpecError, match="'ascend-910' has no host link"):
        check_inputs(p.model, ascend, p.parallel, replace(p.options, optimizer_precision=offload()))
    for bad in ("1.5", "-0.1", "half"):
        with pytest.raises(SpecError, match=f"--optimizer-offload-fraction '{bad}'; valid: a fraction from 0 to 1"):
            optimizer_of({"--optimizer-cpu-offload": True, "--optimizer-offload-fraction": bad})
    # Megatron's argparse default is the whole optimizer; the followers alone change nothing
    assert optimizer_of({"--optimizer-cpu-offload": True}).cpu_offload == CpuOffload(1.0, False)
    assert optimizer_of({"--overlap-cpu-optimizer-d2h-h2d": True}).cpu_offload is None


def test_export_writes_the_flags_and_from_megatron_reads_them_back() -> None:
    prob = problem_for(mb=4, precision="megatron-bf16", distributed_optimizer=True)
    opt = offload(0.25, True)
    prob = replace(prob, options=replace(prob.options, optimizer_precision=opt))
    flags = run_flags(prob.options, prob.parallel)
    assert ("--optimizer-cpu-offload",) in flags and ("--optimizer-offload-fraction", "0.25") in flags
    assert ("--overlap-cpu-optimizer-d2h-h2d",) in flags
    exp = build_megatron(source_from(prob, plan_with(prob, "none").result), simulate=False)
    cmd = parse_megatron_args(" ".join(" ".join(f) for f in exp.args))
    assert cmd.run.optimizer_precision == opt
    assert not any("--optimizer-cpu-offload" in w for w in cmd.warnings)  # read, not named as unpriced


def test_the_torchtitan_export_says_the_offload_is_not_carried() -> None:
    from lynx.export.torchtitan import build_torchtitan

    prob = problem_for(model="llama3-8b", hardware="h100-80g-nvlink", tp=2, pp=1, mb=1, gb=16, seq=2048, sp=True,
                       precision="megatron-bf16", distributed_optimizer=True, optimizer_precision=offload(0.5, True))
    prob = replace(prob, parallel=replace(prob.parallel, dp=4))
    exp = build_torchtitan(source_from(prob, plan_with(prob, "full").result))
    said = [n for n in exp.notes if n.startswith("not carried")]
    assert said == ["not carried: Megatron's optimizer CPU offload of 50% (copies overlapped); torchtitan's FSDP2 "
                    "keeps fp32 state and steps it on the GPU (the torchtitan row prices that)"]


def test_lynx_plan_takes_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from tests.harness.cli import run_main

    args = ["plan", "-m", "gpt-tiny", "-H", "h100-80g-nvlink", "--tp", "1", "--pp", "1", "--dp", "2",
            "--micro-batch", "1", "--global-batch", "8", "--precision", "megatron-bf16", "--distributed-optimizer",
            "--seq-len", "512", "--method", "none", "--json"]
    code, _, err = run_main([*args, "--optimizer-cpu-offload"], capsys)
    assert code == 2 and "needs --use-precision-aware-optimizer" in err and len(err.strip().splitlines()) == 1
    code, out, _ = run_main([*args, "--use-precision-aware-optimizer", "--optimizer-cpu-offload",
                             "--optimizer-offload-fraction", "0.5"], capsys)
    assert code == 0
    d = json.loads(out)
    assert d["options"]["optimizer_precision"]["cpu_offload"] == {"fraction": 0.5, "overlap": False}
