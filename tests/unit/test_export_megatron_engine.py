"""`lynx export megatron` for lynx's engine inside Megatron-Core (`export.megatron_engine`): what the integration
can run, its price (lynx's own where every window is expressible; the cool-down work on demand under Megatron-LM's
pretrain_gpt.py), the files and lines it writes, and the environment the plugin's offloading needs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lynx.api import plan as plan_with
from lynx.export.megatron import build_megatron, write_megatron
from lynx.export.megatron_engine import (
    ENGINE_ARGS_FILE,
    ENGINE_FILE,
    PLAN_COPY,
    Launcher,
    engine_args,
    engine_fit,
    engine_price,
)
from lynx.export.pricing import simulate_lynx
from lynx.export.source import source_from
from tests.conftest import problem_for


def _standard(**kw: object):  # type: ignore[no-untyped-def]
    p = problem_for(pp=4, tp=4, **kw)  # type: ignore[arg-type]
    assert p.model.attention == "standard" and p.model.family == "gpt"
    return p


@pytest.fixture(scope="module")
def lynx_plan():  # type: ignore[no-untyped-def]
    return plan_with(_standard(), "lynx", record=False)


def test_every_window_expressible_prices_as_lynxs_plan(lynx_plan) -> None:  # type: ignore[no-untyped-def]
    fig, fit = engine_price(lynx_plan.problem, lynx_plan.result, Launcher.CUSTOM_LOOP)
    assert fit.runs and fit.notes == ()
    assert fig is not None
    assert fig.iteration_time_s == simulate_lynx(lynx_plan.problem, lynx_plan.result).iteration_time_s


def test_pretrain_gpt_has_no_cooldown_window_and_is_priced_without_it() -> None:
    """The README's model at micro-batch 16 (docs/export.md): lynx hides recomputation in the cool-down stall."""
    p = plan_with(_standard(mb=16), "lynx", record=False)
    assert any(pol.cooldown_overlap for pol in p.result.policies)
    fig, fit = engine_price(p.problem, p.result, Launcher.PRETRAIN_GPT)
    assert fit.runs and not fit.cooldown and "cool-down window does not open" in fit.notes[0]
    assert fig is not None and "no cool-down window" in fig.setting
    no_cool = dataclasses.replace(p.result, policies=tuple(
        dataclasses.replace(pol, cooldown_overlap=False) for pol in p.result.policies))
    assert fig.iteration_time_s == simulate_lynx(p.problem, no_cool).iteration_time_s
    assert fig.iteration_time_s > simulate_lynx(p.problem, p.result).iteration_time_s


def test_a_plan_with_nothing_in_the_stall_loses_nothing(lynx_plan) -> None:  # type: ignore[no-untyped-def]
    fig, fit = engine_price(lynx_plan.problem, lynx_plan.result, Launcher.PRETRAIN_GPT)
    assert fig is not None and fit.notes == () and "every window" in fig.setting
    assert fig.iteration_time_s == simulate_lynx(lynx_plan.problem, lynx_plan.result).iteration_time_s


def test_a_flash_plan_runs_with_lynxs_flash_core_attention(tmp_path: Path) -> None:
    """attention: flash runs as lynx's FlashDotProductAttention in the local spec (tests/integration/
    test_megatron_core.py runs it bitwise): the row is the plan's own price, the note and the hook-up say which
    kernel runs and how the spec is built."""
    from lynx.export.megatron_engine import FLASH_NOTE
    from lynx.models import load_model
    from lynx.spec import ParallelSpec, load_hardware

    par = ParallelSpec(tp=2, pp=2, dp=1, micro_batch_size=1, global_batch_size=16, seq_length=4096)
    from lynx.api import make_problem

    p = make_problem(load_model("llama3-8b"), load_hardware("h100-80g-nvlink"), par)
    assert p.model.attention == "flash"
    done = plan_with(p, "lynx", record=False)
    fig, fit = engine_price(p, done.result, Launcher.CUSTOM_LOOP)
    assert fit.runs and FLASH_NOTE in fit.notes and fig is not None
    assert fig.iteration_time_s == simulate_lynx(p, done.result).iteration_time_s
    plan = tmp_path / "plan.json"
    done.save(plan)
    write_megatron(build_megatron(source_from(p, done.result)), tmp_path / "out", plan)
    mod = (tmp_path / "out" / ENGINE_FILE).read_text()
    assert "with_flash_attention(get_gpt_layer_local_spec(...))" in mod
    assert "from lynx.integrations.megatron.attention import with_flash_attention" in mod
    compile(mod, ENGINE_FILE, "exec")


def test_what_the_integration_cannot_run_is_named() -> None:
    p = problem_for(pp=2, tp=2)
    cp = dataclasses.replace(p, parallel=dataclasses.replace(p.parallel, cp=2))
    res = plan_with(p, "full", record=False).result
    fit = engine_fit(cp, res)
    assert not fit.runs and "context parallelism" in fit.why_not
    fig, _ = engine_price(cp, res)
    assert fig is None


@pytest.mark.parametrize(("preset", "what"), [("deepseek-v3", "mixture-of-experts"), ("qwen3-30b-a3b", "mixture"),
                                              ("mixtral-8x7b", "mixture-of-experts")])
def test_models_the_integration_does_not_build_get_no_engine_row(preset: str, what: str) -> None:
    """MoE (and MLA, q/k norms, MTP, FP8) plans: the integration reads Megatron-Core's dense layer only, so no engine
    row is priced and `--target megatron` falls back to the plugin's."""
    from lynx.export.megatron_engine import layer_why
    from lynx.models import load_model

    m = load_model(preset)
    assert what in layer_why(m)
    dense = load_model("llama3-8b")
    assert layer_why(dense) == ""
    assert "multi-latent" in layer_why(dataclasses.replace(dense, multi_latent_attention=True))
    assert "q/k layernorm" in layer_why(dataclasses.replace(dense, qk_layernorm=True))

def test_engine_args_drop_megatrons_own_recomputation_and_offloading() -> None:
    args = (("--tensor-model-parallel-size", "2"), ("--recompute-granularity", "full"),
            ("--recompute-method", "block"), ("--fine-grained-activation-offloading",),
            ("--offload-modules", "core_attn"), ("--transformer-impl", "transformer_engine"), ("--bf16",))
    assert engine_args(args) == (("--tensor-model-parallel-size", "2"), ("--bf16",), ("--transformer-impl", "local"))


def test_export_writes_the_hookup_and_the_plan_copy(tmp_path: Path, lynx_plan) -> None:  # type: ignore[no-untyped-def]
    plan = tmp_path / "plan.json"
    lynx_plan.save(plan)
    exp = build_megatron(source_from(lynx_plan.problem, lynx_plan.result))
    assert exp.engine is not None and exp.engine.label == "megatron+lynx engine"
    names = {p.name for p in write_megatron(exp, tmp_path / "out", plan)}
    assert {ENGINE_FILE, PLAN_COPY, ENGINE_ARGS_FILE} <= names
    mod = (tmp_path / "out" / ENGINE_FILE).read_text()
    assert f'PLAN = Path(__file__).with_name("{PLAN_COPY}")' in mod and "def apply_plan" in mod
    compile(mod, ENGINE_FILE, "exec")
    assert (tmp_path / "out" / PLAN_COPY).read_text() == plan.read_text()
    report = json.loads((tmp_path / "out" / "megatron_report.json").read_text())
    assert report["engine"]["runs"] and report["engine"]["figures"]["label"] == "megatron+lynx engine"
    assert "--recompute-granularity" not in (tmp_path / "out" / ENGINE_ARGS_FILE).read_text()


def test_the_plugins_offloading_names_its_environment() -> None:
    p = _standard()
    exp = build_megatron(source_from(p, plan_with(p, "mc-offload", record=False).result))
    assert ("NVTE_CPU_OFFLOAD_V1", "1") in exp.environment
    assert any(n.startswith("environment: NVTE_CPU_OFFLOAD_V1=1") for n in exp.notes)
    assert exp.to_dict()["environment"] == {"NVTE_CPU_OFFLOAD_V1": "1"}
    plain = build_megatron(source_from(p, plan_with(p, "full", record=False).result), simulate=False)
    assert plain.environment == ()


def _dp2(**opts: object):  # type: ignore[no-untyped-def]
    """PP 1 at DP 2 (the DP collectives on the critical path of the only stage), with Megatron's DP options."""
    from lynx.api import make_problem
    from lynx.models import load_model
    from lynx.problem import PlanOptions
    from lynx.spec import ParallelSpec, load_hardware

    par = ParallelSpec(tp=4, pp=1, dp=2, micro_batch_size=4, global_batch_size=64, seq_length=1024)
    return make_problem(load_model("gpt-7b"), load_hardware("a100-40g-nvlink"), par,
                        PlanOptions(**opts))  # type: ignore[arg-type]


@pytest.mark.parametrize("opts", [
    {"overlap_grad_reduce": True, "ddp_bucket_size": 10_000_000},
    {"overlap_grad_reduce": True, "overlap_param_gather": True, "distributed_optimizer": True},
])
def test_ddp_overlaps_price_as_lynxs_plan(opts: dict[str, object]) -> None:
    """Megatron's DDP gradient (and distributed-optimizer parameter) collectives with their overlaps on: lynx
    places no restoration in them and the integration runs the plan's on-demand work while they are in flight
    (tests/integration/test_megatron_ddp.py), so the engine's row is lynx's plan, and the overlaps count."""
    p = _dp2(**opts)
    res = plan_with(p, "lynx", record=False).result
    fig, fit = engine_price(p, res, Launcher.PRETRAIN_GPT)
    assert fit.runs and fit.notes == () and fig is not None and "every window" in fig.setting
    assert fig.iteration_time_s == simulate_lynx(p, res).iteration_time_s
    off = _dp2(**{k: v for k, v in opts.items() if not k.startswith("overlap")})
    assert fig.iteration_time_s < simulate_lynx(off, res).iteration_time_s  # the overlaps hide DP time


@pytest.mark.parametrize("mode", ["megatron-fsdp", "torch-fsdp2"])
def test_fsdp_is_named_as_not_run(mode: str) -> None:
    from lynx.cost.fsdp import DpMode, DpSharding

    p = _dp2(dp_sharding=DpSharding(DpMode(mode)))
    res = plan_with(p, "full", record=False).result
    fit = engine_fit(p, res)
    assert not fit.runs and mode in fit.why_not and "DDP" in fit.why_not
    assert engine_price(p, res)[0] is None


def test_an_interleaved_plan_opens_the_cool_down_window_in_a_custom_loop() -> None:
    """Interleaved 1F1B: the integration hosts each backward's phase-1/2 work where the plan's schedule puts it (of
    the chunk's own or another chunk's forward) and, given every chunk's schedule_kwargs, the cool-down stall
    (tests/integration/test_megatron_core.py counts them): the row is lynx's own price in a custom loop, and under
    pretrain_gpt.py the stall's work runs on demand, priced so."""
    p = _standard(vpp=2, mb=4)
    res = plan_with(p, "lynx", record=False).result
    assert any(pol.cooldown_overlap for pol in res.policies)
    fig, fit = engine_price(p, res, Launcher.CUSTOM_LOOP)
    assert fit.runs and fit.cooldown and fig is not None and "every window" in fig.setting
    assert fig.iteration_time_s == simulate_lynx(p, res).iteration_time_s
    fig2, fit2 = engine_price(p, res, Launcher.PRETRAIN_GPT)
    assert fig2 is not None and not fit2.cooldown
    assert fig2.iteration_time_s >= fig.iteration_time_s
