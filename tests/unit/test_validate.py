"""The typed validator on its own: a field is checked from its annotation alone (so fields added later
are covered), ranges come from metadata, messages name the place and the field."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Literal

import pytest

from lynx.errors import PlanFormatError, SpecError
from lynx.validate import Range, build, check_instance, check_option, rng


class Act(enum.Enum):
    GELU = "gelu"
    SWIGLU = "swiglu"


@dataclass(frozen=True, slots=True)
class Inner:
    rate: float = field(default=0.5, metadata=rng(ge=0, le=1))


@dataclass(frozen=True, slots=True)
class Spec:
    name: str
    layers: int = field(metadata=rng(gt=0))
    groups: int | None = None
    act: Act = Act.GELU
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    sizes: tuple[int, ...] = ()
    inner: Inner = field(default_factory=Inner)
    scale: float = 1.0
    tied: bool = True


def test_valid_mapping_is_converted() -> None:
    s = build(Spec, {"name": "x", "layers": 2, "groups": 4, "act": "swiglu", "norm": "rmsnorm", "sizes": [1, 2],
                     "inner": {"rate": 0.1}, "scale": 3}, "f.yaml")
    assert s == Spec("x", 2, 4, Act.SWIGLU, "rmsnorm", (1, 2), Inner(0.1), 3.0, True)
    assert isinstance(s.scale, float)


@pytest.mark.parametrize(("data", "needle"), [
    ({"layers": 2}, "missing required field(s) name"),
    ({"name": "x", "layers": 2, "extra": 1}, "unknown field(s) extra"),
    ({"name": "x", "layers": 4.5}, "layers must be an integer, got 4.5"),
    ({"name": "x", "layers": True}, "layers must be an integer, got True"),
    ({"name": "x", "layers": "4"}, "layers must be an integer, got '4'"),
    ({"name": "x", "layers": 0}, "layers must be > 0, got 0"),
    ({"name": "x", "layers": 1, "groups": -1}, "groups must be >= 0"),  # default range of a new field
    ({"name": "x", "layers": 1, "groups": 1.5}, "groups must be an integer"),
    ({"name": "x", "layers": 1, "scale": math.nan}, "scale must be a finite number"),
    ({"name": "x", "layers": 1, "scale": -math.inf}, "scale must be a finite number"),
    ({"name": "x", "layers": 1, "act": "relu"}, "act must be one of gelu, swiglu"),
    ({"name": "x", "layers": 1, "norm": "batchnorm"}, "norm must be one of layernorm, rmsnorm"),
    ({"name": "x", "layers": 1, "sizes": [1, -2]}, "sizes must be >= 0, got -2"),
    ({"name": "x", "layers": 1, "sizes": 3}, "sizes must be a list"),
    ({"name": "x", "layers": 1, "inner": {"rate": 2}}, "f.yaml: inner: rate must be >= 0 and <= 1, got 2"),
    ({"name": "x", "layers": 1, "inner": 5}, "inner must be a mapping"),
    ({"name": "x", "layers": 1, "tied": "yes"}, "tied must be true or false"),
    ({"name": 3, "layers": 1}, "name must be a string"),
])
def test_bad_values_name_the_field(data: dict[str, object], needle: str) -> None:
    with pytest.raises(SpecError) as e:
        build(Spec, data, "f.yaml")
    assert str(e.value).startswith("f.yaml: ") and needle in str(e.value)


def test_error_class_and_instance_check() -> None:
    with pytest.raises(PlanFormatError, match="plan: layers"):
        build(Spec, {"name": "x", "layers": -1}, "plan", PlanFormatError)
    with pytest.raises(SpecError, match="obj: layers must be > 0"):
        check_instance(Spec("x", 0), "obj")
    with pytest.raises(SpecError, match="not a mapping|expected a mapping"):
        build(Spec, [1, 2], "f.yaml")


def test_option_check() -> None:
    assert check_option("--x", 2.5, Range(gt=0)) == 2.5
    assert check_option("--x", None, Range(gt=0)) is None
    for bad, msg in ((math.nan, "finite"), (-1.0, "> 0"), (math.inf, "finite")):
        with pytest.raises(SpecError, match=f"--x must be .*{msg}"):
            check_option("--x", bad, Range(gt=0))
    with pytest.raises(SpecError, match="--n must be an integer"):
        check_option("--n", 2.0, Range(gt=0), integer=True)


def test_a_profile_of_another_shape_says_how_to_plan_it() -> None:
    """A layer graph of gpt-tiny's shape cannot price llama3-8b: the error names the mismatching fields and
    points at a model YAML of the profiled shape (docs/profiling.md)."""
    import pytest

    from lynx.checks import check_graph_matches
    from lynx.cost.layer import build_layer_graph
    from lynx.errors import SpecError
    from lynx.models import load_model
    from lynx.spec import ParallelSpec, load_hardware

    par = ParallelSpec(tp=1, pp=1, dp=1, micro_batch_size=1, global_batch_size=1, seq_length=64)
    g = build_layer_graph(load_model("gpt-tiny"), load_hardware("a100-40g-nvlink"), par)
    with pytest.raises(SpecError, match=r"hidden_size 256 \(layout: 4096\).*model YAML of that shape"):
        check_graph_matches(g, load_model("llama3-8b"), par)
    check_graph_matches(g, load_model("gpt-tiny"), par)
