from __future__ import annotations

from pathlib import Path

import pytest

from lynx.errors import SpecError
from lynx.models import layer_params, load_model, model_presets, total_params, validate_layout
from lynx.spec import ParallelSpec, hardware_presets, load_hardware


def test_all_presets_load() -> None:
    assert {"gpt-300m", "gpt-1.3b", "gpt-4.7b", "gpt-7b", "gpt-13b", "gpt-23b", "gpt-175b"} <= set(model_presets())
    assert {"a100-40g-nvlink", "a100-40g-pcie", "ascend-910", "h100-80g-nvlink"} <= set(hardware_presets())
    for n in model_presets():
        load_model(n)
    for n in hardware_presets():
        hw = load_hardware(n)
        assert hw.device.usable_bytes < hw.device.memory_bytes


@pytest.mark.parametrize(
    ("name", "billions"),
    [("gpt-300m", 0.36), ("gpt-1.3b", 1.3), ("gpt-4.7b", 4.7), ("gpt-7b", 6.7), ("gpt-13b", 12.9),
     ("gpt-23b", 23.0), ("gpt-175b", 174.6)],
)
def test_parameter_counts_match_names(name: str, billions: float) -> None:
    assert total_params(load_model(name)) / 1e9 == pytest.approx(billions, rel=0.03)


def test_gpt175b_layer_params_follow_12h2() -> None:
    m = load_model("gpt-175b")
    assert layer_params(m) == pytest.approx(12 * m.hidden_size**2, rel=0.001)


@pytest.mark.parametrize(
    ("kwargs", "model", "message"),
    [
        ({"tp": 3}, "gpt-7b", "not divisible by TP 3"),
        ({"pp": 40}, "gpt-7b", "cannot fill 40 pipeline stages"),
        ({"tp": 8, "pp": 8}, "gpt-7b", "only 4 available"),
    ],
)
def test_impossible_layouts(kwargs: dict[str, int], model: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        validate_layout(load_model(model), load_hardware("a100-40g-nvlink"), ParallelSpec(**kwargs))


def test_nodes_cap_is_respected() -> None:
    m, hw = load_model("gpt-7b"), load_hardware("a100-40g-nvlink")
    assert validate_layout(m, hw, ParallelSpec(tp=4, pp=4), nodes=4) == 4
    with pytest.raises(SpecError, match="needs 4 nodes"):
        validate_layout(m, hw, ParallelSpec(tp=4, pp=4), nodes=2)


def test_global_batch_must_divide() -> None:
    with pytest.raises(SpecError, match="not divisible by micro-batch 8 x DP 2"):
        ParallelSpec(dp=2, micro_batch_size=8, global_batch_size=100)


def test_unknown_preset_lists_known() -> None:
    with pytest.raises(SpecError, match="known: .*gpt-7b"):
        load_model("gpt-8b")
    with pytest.raises(SpecError, match="known: .*a100-40g-nvlink"):
        load_hardware("tpu")


def test_user_yaml_and_malformed_yaml(tmp_path: Path) -> None:
    good = tmp_path / "mine.yaml"
    good.write_text("name: mine\nnum_layers: 4\nhidden_size: 512\nnum_attention_heads: 8\n")
    assert load_model(str(good)).ffn_hidden_size == 2048
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match=r"bad.yaml: malformed YAML \(line"):
        load_model(str(bad))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("name: x\nnum_layers: 4\nhidden_size: 512\nnum_attention_heads: 8\nwidth: 3\n")
    with pytest.raises(SpecError, match="unknown field.*width"):
        load_model(str(unknown))
    heads = tmp_path / "heads.yaml"
    heads.write_text("num_layers: 4\nhidden_size: 500\nnum_attention_heads: 8\n")
    with pytest.raises(SpecError, match="not divisible by num_attention_heads"):
        load_model(str(heads))
    hw = tmp_path / "hw.yaml"
    hw.write_text("name: h\ndevices_per_node: 2\n")
    with pytest.raises(SpecError, match="missing required field.s. device"):
        load_hardware(str(hw))


def test_tp_group_link_selection() -> None:
    hw = load_hardware("ascend-910")
    assert hw.link_for_group(4) is hw.intra_node
    assert hw.link_for_group(8) is hw.inter_group
    assert hw.link_for_group(16) is hw.inter_node
    assert hw.link_for_group(1) is hw.inter_node  # no group: no collective is ever timed on it
