"""Models as their families describe them: loading a model file or preset with its family's defaults, the
family's own checks, parameter counts, and whether a layout can split the model. `lynx.spec` holds the data
classes only; this module is where a `ModelSpec` meets `lynx.families` (which imports spec, never the reverse).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lynx.errors import SpecError
from lynx.families import get_family
from lynx.fp8 import Fp8Recipe
from lynx.spec import DeviceSpec, Hardware, ModelSpec, ParallelSpec, check_cp, preset_names, read_spec_file, warn_once
from lynx.validate import build


def check_model(m: ModelSpec) -> None:
    """The family's own rules (e.g. family llama is SwiGLU, RMSNorm, RoPE, no biases): SpecError naming the field."""
    get_family(m.family).check_model(m)


def with_family_defaults(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The family's values for the fields a model file leaves out (``family: llama`` alone means SwiGLU,
    RMSNorm, RoPE, untied embeddings, flash attention, no dropout, no biases)."""
    if not isinstance(data, Mapping):
        raise SpecError(f"{where}: expected a mapping of fields, got {type(data).__name__}")
    fam = data.get("family", "gpt")
    if not isinstance(fam, str):
        raise SpecError(f"{where}: family must be a string, got {fam!r}")
    try:
        defaults = get_family(fam).defaults
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None
    return {**defaults, **data}


def model_from_dict(d: Mapping[str, Any], where: str = "plan: model") -> ModelSpec:
    m = build(ModelSpec, with_family_defaults(d, where), where)
    check_model(m)
    return m


def load_model(name_or_path: str) -> ModelSpec:
    """A preset name or a YAML file of ModelSpec's fields, with the family's defaults and checks."""
    where, data = read_spec_file("models", name_or_path)
    data = with_family_defaults(data, where)
    data.setdefault("name", name_or_path)
    return model_from_dict(data, where)


def check_fp8(model: ModelSpec, device: DeviceSpec) -> None:
    """SpecError when the device cannot run the model's FP8 setting."""
    f = model.fp8
    if f is None:
        return
    if device.fp8_peak_flops is None:
        raise SpecError(f"{model.name}: --fp8-format {f.format.value} on {device.name}, which has no FP8 tensor cores "
                        "(its hardware file gives no fp8_peak_flops); valid: drop --fp8-format, or an FP8 device "
                        "(H100, H200)")
    if f.recipe is Fp8Recipe.MXFP8:
        raise SpecError(f"{model.name}: --fp8-recipe mxfp8 runs on Blackwell only (MX-scaled tensor cores); lynx "
                        "prices Hopper's FP8 (H100, H200); valid: delayed, tensorwise, blockwise")


def model_presets() -> list[str]:
    return preset_names("models")


def layer_params(m: ModelSpec) -> int:
    """Parameters of one transformer layer (the family's count, TP = 1)."""
    return round(get_family(m.family).layer_params(m, 1))


def embedding_params(m: ModelSpec) -> int:
    """Word (and learned position) embeddings; a tied LM head is this word embedding."""
    return round(get_family(m.family).embedding_params(m, 1))


def total_params(m: ModelSpec) -> int:
    out = get_family(m.family).output_params(m)
    return m.num_layers * layer_params(m) + embedding_params(m) + round(out)


def validate_layout(model: ModelSpec, hw: Hardware, par: ParallelSpec, nodes: int | None = None) -> int:
    """Check that `model` is a model of its family and that `par` fits it and `hw`; return the number of nodes
    used. Every planning problem passes here (`checks.check_inputs`), so a model built in code is checked as a
    loaded one is."""
    check_model(model)
    get_family(model.family).check_layout(model, par.tp)
    check_cp(model, par)
    check_fp8(model, hw.device)
    if par.seq_length > model.max_position_embeddings:
        if model.position_embedding != "learned":
            warn_once(f"lynx: warning: {model.name}: --seq-len {par.seq_length} exceeds the model's "
                       f"max_position_embeddings {model.max_position_embeddings}; rotary positions extend (as "
                       "Megatron with --use-rope-scaling / a larger --max-position-embeddings), so lynx plans it; "
                       "the model must be trained or scaled for that length")
        else:
            raise SpecError(f"{model.name}: --seq-len {par.seq_length} exceeds the model's max_position_embeddings "
                            f"{model.max_position_embeddings} (learned positions have no entry beyond it); "
                            f"valid: 1 to {model.max_position_embeddings}")
    if model.num_layers < par.pp:
        raise SpecError(f"{model.name}: {model.num_layers} layers cannot fill {par.pp} pipeline stages")
    cap = hw.max_nodes if nodes is None else nodes
    if cap <= 0:
        raise SpecError(f"--nodes must be positive, got {cap}")
    need = -(-par.world_size // hw.devices_per_node)
    cp_text = f" x CP {par.cp}" if par.cp > 1 else ""
    if need > cap:
        raise SpecError(
            f"TP {par.tp}{cp_text} x PP {par.pp} x DP {par.dp} = {par.world_size} devices needs {need} nodes of "
            f"{hw.devices_per_node} x {hw.device.name}; only {cap} available (--nodes)"
        )
    if par.tp > hw.devices_per_node:
        # Allowed, but TP collectives then cross the inter-node link; the cost model charges for it.
        pass
    return need
