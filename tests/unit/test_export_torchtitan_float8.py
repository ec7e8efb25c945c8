"""`lynx export torchtitan` for plans priced with torch.compile and torchao's Float8 (decision 0268): the config
compiles the blocks, the registry rebuilds the model with torchtitan 0.3.0's own float8 converter, the plan runs
through the AC module (never lynx's engine), and what torchtitan cannot run is refused in one line."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from lynx.api import make_problem
from lynx.api import plan as plan_with
from lynx.errors import SpecError
from lynx.export.source import source_from
from lynx.export.torchtitan import build_torchtitan, render_registry, write_torchtitan
from lynx.fp8 import Fp8, Fp8Engine, Fp8Format, Fp8Recipe
from lynx.models import load_model
from lynx.problem import PlanOptions
from lynx.spec import ParallelSpec, load_hardware


def _source(method: str, recipe: Fp8Recipe | None = Fp8Recipe.ROWWISE, compiled: bool = True,
            all_gather: bool = False) -> Any:
    fp8 = None if recipe is None else Fp8(Fp8Format.HYBRID, recipe, all_gather, Fp8Engine.TORCHAO)
    m = dataclasses.replace(load_model("torchtitan-llama3-8b"), compiled=compiled, fp8=fp8)
    par = ParallelSpec(tp=2, pp=2, dp=2, sequence_parallel=True, micro_batch_size=1, global_batch_size=16,
                       seq_length=4096)
    problem = make_problem(m, load_hardware("h100-80g-nvlink"), par,
                           PlanOptions(precision="megatron-bf16", distributed_optimizer=True))
    return source_from(problem, plan_with(problem, method, record=False).result)


@pytest.mark.parametrize("method", ["none", "full"])
def test_float8_compiled_plan_exports_the_converter_and_compile(method: str) -> None:
    exp = build_torchtitan(_source(method))
    assert exp.config["compile"] == {"enable": True, "components": ["model"]}
    assert exp.float8 == {"recipe_name": "rowwise", "filter_fqns": ["lm_head"]}
    assert exp.engine is None  # lynx's engine refuses Float8Linear and compiled blocks
    assert any("not lynx's engine: torchao Float8 rowwise" in n for n in exp.notes)
    assert "compiled blocks, torchao Float8 rowwise" in exp.figures[1].setting
    reg = render_registry(exp)
    assert "FLOAT8: dict[str, Any] | None = {'recipe_name': 'rowwise', 'filter_fqns': ['lm_head']}" in reg


def test_a_compiled_16_bit_plan_keeps_its_selective_blocks() -> None:
    exp = build_torchtitan(_source("mc-mlp", recipe=None))
    assert exp.config["compile"]["enable"] is True and exp.float8 is None
    assert any(e["mode"] == "selective" for e in exp.ac_table["layers"])
    plain = build_torchtitan(_source("full", recipe=None, compiled=False))
    assert plain.config["compile"] == {"enable": False} and "FLOAT8: dict[str, Any] | None = None" in \
        render_registry(plain)


@pytest.mark.parametrize(("kw", "says"), [
    ({"method": "mc-mlp"}, "keep some ops and recompute others"),
    ({"method": "full", "recipe": Fp8Recipe.TENSORWISE}, "takes recipe_name rowwise or rowwise_with_gw_hp"),
    ({"method": "full", "recipe": Fp8Recipe.TENSORWISE, "all_gather": True}, "takes recipe_name"),
])
def test_what_torchtitan_cannot_run_is_refused(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(SpecError) as e:
        build_torchtitan(_source(**kw))
    assert says in str(e.value) and "\n" not in str(e.value)


def _load(exp: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    write_torchtitan(exp, tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in ("lynx_torchtitan_registry", "lynx_torchtitan_ac"):
        sys.modules.pop(mod, None)
    import lynx_torchtitan_registry  # type: ignore[import-not-found]

    return lynx_torchtitan_registry


@pytest.mark.skipif(importlib.util.find_spec("torchao") is not None, reason="torchao installed: the next test")
def test_without_torchao_torchtitans_converter_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchtitan")
    reg = _load(build_torchtitan(_source("full")), tmp_path, monkeypatch)
    with pytest.raises(ImportError, match="torchao"):
        reg.lynx_plan()


def test_with_torchao_the_blocks_linears_become_float8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan builds the exported model with torchao's Float8Linear in every block and a 16-bit output layer
    (torchao's emulation: this CPU has no FP8 tensor cores, and emulation runs uncompiled)."""
    pytest.importorskip("torchtitan")
    pytest.importorskip("torchao.float8")
    import torch

    reg = _load(build_torchtitan(_source("full", compiled=False)), tmp_path, monkeypatch)
    monkeypatch.setattr(reg, "FLOAT8", {**reg.FLOAT8, "emulate": True})
    cfg = reg.lynx_plan()
    assert cfg.compile.enable is False and cfg.model_spec.flavor == "8B"
    with torch.device("meta"):
        model = cfg.model_spec.model.build()
    gemms = [m for name, m in model.named_modules() if name.split(".")[-1] in ("wqkv", "wo", "w1", "w2", "w3")]
    assert len(gemms) == 5 * 32 and all(type(m).__name__ == "Float8Linear" for m in gemms)
    assert type(model.get_submodule("lm_head")).__name__ != "Float8Linear"


@pytest.mark.parametrize(("recipe", "compiled", "says"), [(Fp8Recipe.ROWWISE, False, "torchao Float8 rowwise"),
                                                          (None, True, "torch.compile")])
def test_lynxs_engine_refuses_a_plan_priced_for_float8_or_compile(tmp_path: Path, recipe: Fp8Recipe | None,
                                                                  compiled: bool, says: str) -> None:
    """A plan priced for Float8 or compiled blocks, applied by lynx's engine to torchtitan's eager 16-bit blocks,
    would run at another speed than priced: load_plan refuses it in one line."""
    pytest.importorskip("torch")
    from lynx.integrations.torchtitan.apply import load_plan

    src = _source("full", recipe=recipe, compiled=compiled)
    from lynx.plan import Plan

    path = tmp_path / "p.json"
    Plan.evaluate(src.problem, src.result, record=False).save(path)
    with pytest.raises(ValueError, match=f"priced with {says}, which lynx's engine does not run"):
        load_plan(path)
