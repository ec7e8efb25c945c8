"""Models as their families describe them: loading a model file or preset with its family's defaults, the
family's own checks, parameter counts, and whether a layout can split the model. `lynx.spec` holds the data
classes only; this module is where a `ModelSpec` meets `lynx.families` (which imports spec, never the reverse).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lynx.errors import SpecError
from lynx.families import get_family
from lynx.fp8 import Fp8Engine, Fp8Recipe
from lynx.spec import DeviceSpec, Hardware, ModelSpec, ParallelSpec, check_cp, preset_names, read_spec_file, warn_once
from lynx.stack import layer_kinds
from lynx.validate import build

_MCORE_ONLY = ("num_moe_experts", "multi_latent_attention", "kv_channels", "qk_layernorm", "mtp_num_layers")
"""ModelSpec fields only the mcore family builds layers for (docs/decisions/0220)."""


def check_model(m: ModelSpec) -> None:
    """The family's own rules (e.g. family llama is SwiGLU, RMSNorm, RoPE, no biases): SpecError naming the field."""
    if m.family != "mcore":
        used = [f for f in _MCORE_ONLY if getattr(m, f)]
        if used:
            raise SpecError(f"model {m.name!r}: {', '.join(used)} need family mcore (family {m.family} builds dense "
                            "layers with standard attention only); valid: family: mcore")
    get_family(m.family).check_model(m)


def check_experts(model: ModelSpec, par: ParallelSpec) -> None:
    """Megatron-Core's rules for expert parallelism (megatron/training/arguments.py validate_args and
    TransformerConfig): experts divide over EP, the expert width over ETP, sequence parallelism with TP."""
    if not model.is_moe:
        if par.ep > 1 or par.etp not in (0, par.tp):
            raise SpecError(f"--expert-model-parallel-size {par.ep} / --expert-tensor-parallel-size {par.etp}: model "
                            f"{model.name} has no experts; valid: 1 and unset")
        return
    if model.num_moe_experts % par.ep:
        raise SpecError(f"--expert-model-parallel-size {par.ep}: {model.num_moe_experts} experts are not divisible by "
                        "it; valid: a divisor of num_moe_experts")
    if model.expert_ffn % par.expert_tp or (model.moe_shared_expert_intermediate_size % par.tp):
        raise SpecError(f"--expert-tensor-parallel-size {par.expert_tp}: expert FFN {model.expert_ffn} (shared "
                        f"{model.moe_shared_expert_intermediate_size}) not divisible by it / by TP {par.tp}")
    if par.tp > 1 and not par.sequence_parallel:
        raise SpecError(f"{model.name}: MoE with TP {par.tp} needs --sequence-parallel (Megatron-Core's rule for "
                        "mixture-of-experts with tensor parallelism)")


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
        opt = f"--fp8-format {f.format.value}" if f.engine is Fp8Engine.TE else f"--float8-recipe {f.recipe.value}"
        raise SpecError(f"{model.name}: {opt} on {device.name}, which has no FP8 tensor cores (its hardware file "
                        f"gives no fp8_peak_flops); valid: drop {opt.split()[0]}, or an FP8 device (H100, H200)")
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


def decoder_params(m: ModelSpec, active: bool = False) -> float:
    """The decoder layers' parameters, by kind (an MoE layer's routed experts: all of them, or with `active` the
    top-k a token runs through); the MTP layers (DeepSeek-V3) count as layers of the last layer's kind plus their
    projection of [embedding, hidden] to hidden and its two norms."""
    fam = get_family(m.family)
    kinds = layer_kinds(m)
    if not m.is_moe:
        return m.num_layers * fam.layer_params(m, 1)
    from lynx.families import mcore, moe

    experts = moe.expert_params(m) * (m.moe_router_topk / m.num_moe_experts if active else 1.0)
    per = {k: mcore.kind_params(m, 1, k) + (experts if k == "moe" else 0.0) for k in set(kinds)}
    mtp = m.mtp_num_layers * (per[kinds[-1]] + 2 * m.hidden_size * m.hidden_size + 2 * m.hidden_size)
    return sum(per[k] for k in kinds) + mtp


def total_params(m: ModelSpec) -> int:
    out = get_family(m.family).output_params(m)
    return round(decoder_params(m)) + embedding_params(m) + round(out)


def active_params(m: ModelSpec) -> int:
    """Parameters one token runs through: every dense weight, the top-k routed experts of each MoE layer."""
    out = get_family(m.family).output_params(m)
    return round(decoder_params(m, active=True)) + embedding_params(m) + round(out)


def validate_layout(model: ModelSpec, hw: Hardware, par: ParallelSpec, nodes: int | None = None) -> int:
    """Check that `model` is a model of its family and that `par` fits it and `hw`; return the number of nodes
    used. Every planning problem passes here (`checks.check_inputs`), so a model built in code is checked as a
    loaded one is."""
    check_model(model)
    get_family(model.family).check_layout(model, par.tp)
    check_experts(model, par)
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
