"""Megatron-Core's mixture-of-experts, multi-latent attention and expert-parallel flags, both ways (docs/
decisions/0220): a lynx ModelSpec's MoE/MLA fields as Megatron-LM flags for `lynx export megatron`, and a
command line's flags as those fields for `lynx plan --from-megatron`. Names and defaults are Megatron-Core
0.16.1's (TransformerConfig, MLATransformerConfig and ModelParallelConfig fields; the flags are their names with
dashes, `--num-experts` for num_moe_experts)."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any

from lynx.errors import SpecError
from lynx.spec import ModelSpec, ParallelSpec

Flag = tuple[str, ...]

INT_FLAGS = ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size",
             "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim",
             "--mtp-num-layers", "--kv-channels", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
             "--moe-router-num-groups", "--moe-router-group-topk", "--moe-router-topk-limited-devices")
FLOAT_FLAGS = ("--moe-expert-capacity-factor", "--moe-router-topk-scaling-factor", "--moe-router-bias-update-rate",
               "--mtp-loss-scaling-factor")
STR_FLAGS = ("--moe-token-dispatcher-type", "--moe-router-load-balancing-type", "--moe-layer-freq",
             "--moe-router-dtype", "--moe-router-score-function")
BOOL_FLAGS = ("--moe-grouped-gemm", "--moe-pad-expert-input-to-capacity", "--multi-latent-attention",
              "--qk-layernorm", "--moe-router-pre-softmax", "--moe-router-enable-expert-bias")

_FIELD_OF = {"--num-experts": "num_moe_experts", "--moe-router-topk": "moe_router_topk",
             "--moe-ffn-hidden-size": "moe_ffn_hidden_size",
             "--moe-shared-expert-intermediate-size": "moe_shared_expert_intermediate_size",
             "--q-lora-rank": "q_lora_rank", "--kv-lora-rank": "kv_lora_rank", "--qk-head-dim": "qk_head_dim",
             "--qk-pos-emb-head-dim": "qk_pos_emb_head_dim", "--v-head-dim": "v_head_dim",
             "--mtp-num-layers": "mtp_num_layers", "--mtp-loss-scaling-factor": "mtp_loss_scaling_factor",
             "--kv-channels": "kv_channels",
             "--moe-expert-capacity-factor": "moe_expert_capacity_factor",
             "--moe-token-dispatcher-type": "moe_token_dispatcher_type",
             "--moe-router-load-balancing-type": "moe_router_load_balancing_type",
             "--moe-router-score-function": "moe_router_score_function",
             "--moe-router-pre-softmax": "moe_router_pre_softmax",
             "--moe-router-topk-scaling-factor": "moe_router_topk_scaling_factor",
             "--moe-router-enable-expert-bias": "moe_router_enable_expert_bias",
             "--moe-router-bias-update-rate": "moe_router_bias_update_rate",
             "--moe-router-num-groups": "moe_router_num_groups", "--moe-router-group-topk": "moe_router_group_topk",
             "--moe-grouped-gemm": "moe_grouped_gemm",
             "--moe-pad-expert-input-to-capacity": "moe_pad_expert_input_to_capacity",
             "--multi-latent-attention": "multi_latent_attention", "--qk-layernorm": "qk_layernorm"}
MAX_PATTERN = 4096


def parse_layer_freq(text: str, num_layers: int) -> tuple[int, tuple[int, ...]]:
    """--moe-layer-freq as Megatron takes it: an integer N, or a Python list expression of 0 and 1 such as
    "([0]*3+[1]*58)" or "[1,1,0,1]" (Megatron evaluates it; lynx reads only lists, *, + and integers).
    Returns (freq, pattern): the pattern empty for the integer form."""
    t = text.strip()
    if t.lstrip("-").isdigit():
        n = int(t)
        if n <= 0:
            raise SpecError(f"--moe-layer-freq {text}: must be a positive integer or a list of 0/1")
        return n, ()
    try:
        pattern = _eval(ast.parse(t, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        raise SpecError(f"--moe-layer-freq {text!r}: expected an integer or a list of 0/1 per layer, e.g. "
                        "([0]*3+[1]*58)") from None
    if len(pattern) != num_layers or any(x not in (0, 1) for x in pattern):
        raise SpecError(f"--moe-layer-freq {text!r}: the list needs one 0 or 1 per layer ({num_layers} layers), got "
                        f"{len(pattern)} entries")
    return 1, pattern


def _eval(node: ast.AST) -> tuple[int, ...]:
    if isinstance(node, ast.List):
        vals = [v.value for v in node.elts if isinstance(v, ast.Constant) and isinstance(v.value, int)]
        if len(vals) != len(node.elts):
            raise ValueError("list of integers expected")
        return tuple(vals)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _eval(node.left) + _eval(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        lst, n = (node.left, node.right) if isinstance(node.right, ast.Constant) else (node.right, node.left)
        if not (isinstance(n, ast.Constant) and isinstance(n.value, int)) or not 0 <= n.value <= MAX_PATTERN:
            raise ValueError("repetition count expected")
        out = _eval(lst) * n.value
        if len(out) > MAX_PATTERN:
            raise ValueError("too long")
        return out
    raise ValueError("unsupported expression")


def moe_fields(k: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """ModelSpec fields from a parsed command line's MoE / MLA flags (only those given)."""
    out: dict[str, Any] = {_FIELD_OF[f]: k[f] for f in _FIELD_OF if f in k}
    if "--moe-layer-freq" in k:
        freq, pattern = parse_layer_freq(str(k["--moe-layer-freq"]), num_layers)
        out["moe_layer_freq"], out["moe_layer_pattern"] = freq, pattern
    for f in ("moe_token_dispatcher_type", "moe_router_load_balancing_type", "moe_router_score_function"):
        if f in out:
            out[f] = str(out[f])
    limited = k.get("--moe-router-topk-limited-devices")
    if limited is not None:  # Megatron's deprecated spelling of device-limited routing: one group per EP rank
        if "moe_router_group_topk" in out:
            raise SpecError("--from-megatron: --moe-router-topk-limited-devices is replaced by "
                            "--moe-router-group-topk and --moe-router-num-groups; give one or the other "
                            "(Megatron's rule)")
        out["moe_router_group_topk"] = int(limited)
        out["moe_router_num_groups"] = int(k.get("--expert-model-parallel-size", 1))
    return out


def router_dtype_warnings(k: Mapping[str, Any]) -> list[str]:
    """--moe-router-dtype: lynx prices the router's scores in fp32 (`lynx.families.moe.ROUTER_BYTES`, what fp32 and
    the DeepSeek-V3 / Qwen3 recipes run); another value is read and said."""
    dtype = k.get("--moe-router-dtype")
    if dtype is None or dtype == "fp32":
        return []
    if dtype != "fp64":
        raise SpecError(f"--from-megatron: --moe-router-dtype {dtype}: Megatron takes fp32 or fp64")
    return ["--moe-router-dtype fp64: lynx prices the router's top-k scores in fp32, half the bytes fp64 keeps "
            "(a few bytes per token and expert choice: the memory is slightly under-priced)"]


def expert_parallel(k: Mapping[str, Any]) -> tuple[int, int]:
    """(EP, ETP; 0 = TP) from --expert-model-parallel-size and --expert-tensor-parallel-size."""
    return int(k.get("--expert-model-parallel-size", 1)), int(k.get("--expert-tensor-parallel-size", 0))


def moe_flags(m: ModelSpec) -> list[Flag]:
    """The MoE and MLA flags that train `m` as lynx priced it (nothing for a dense model with standard heads)."""
    out: list[Flag] = []
    if m.kv_channels:
        out.append(("--kv-channels", str(m.kv_channels)))
    if m.qk_layernorm:
        out.append(("--qk-layernorm",))
    if m.multi_latent_attention:
        out += [("--multi-latent-attention",), ("--q-lora-rank", str(m.q_lora_rank)),
                ("--kv-lora-rank", str(m.kv_lora_rank)), ("--qk-head-dim", str(m.qk_head_dim)),
                ("--qk-pos-emb-head-dim", str(m.qk_pos_emb_head_dim)), ("--v-head-dim", str(m.v_head_dim))]
    if not m.is_moe:
        return out
    out += [("--num-experts", str(m.num_moe_experts)), ("--moe-router-topk", str(m.moe_router_topk)),
            ("--moe-ffn-hidden-size", str(m.expert_ffn)),
            ("--moe-token-dispatcher-type", m.moe_token_dispatcher_type),
            ("--moe-router-load-balancing-type", m.moe_router_load_balancing_type)]
    out += router_flags(m)
    if m.moe_shared_expert_intermediate_size:
        out.append(("--moe-shared-expert-intermediate-size", str(m.moe_shared_expert_intermediate_size)))
    if m.moe_layer_pattern:
        out.append(("--moe-layer-freq", _pattern_text(m.moe_layer_pattern)))
    elif m.moe_layer_freq != 1:
        out.append(("--moe-layer-freq", str(m.moe_layer_freq)))
    if m.moe_grouped_gemm:
        out.append(("--moe-grouped-gemm",))
    if m.moe_expert_capacity_factor is not None:
        out.append(("--moe-expert-capacity-factor", f"{m.moe_expert_capacity_factor:g}"))
    if m.moe_pad_expert_input_to_capacity:
        out.append(("--moe-pad-expert-input-to-capacity",))
    if m.mtp_num_layers:
        out.append(("--mtp-num-layers", str(m.mtp_num_layers)))
        if m.mtp_loss_scaling_factor != 0.1:
            out.append(("--mtp-loss-scaling-factor", f"{m.mtp_loss_scaling_factor:g}"))
    return out


def router_flags(m: ModelSpec) -> list[Flag]:
    """The router's switches where they differ from Megatron-Core's defaults (softmax after the top-k, no scaling,
    no expert bias, no group limit), so the exported command line routes tokens as the model does."""
    out: list[Flag] = []
    if m.moe_router_score_function != "softmax":
        out.append(("--moe-router-score-function", m.moe_router_score_function))
    if m.moe_router_pre_softmax:
        out.append(("--moe-router-pre-softmax",))
    if m.moe_router_topk_scaling_factor is not None:
        out.append(("--moe-router-topk-scaling-factor", f"{m.moe_router_topk_scaling_factor:g}"))
    if m.moe_router_enable_expert_bias:
        out.append(("--moe-router-enable-expert-bias",))
        if m.moe_router_bias_update_rate != 1e-3:
            out.append(("--moe-router-bias-update-rate", f"{m.moe_router_bias_update_rate:g}"))
    if m.moe_router_group_topk:
        out += [("--moe-router-num-groups", str(m.moe_router_num_groups)),
                ("--moe-router-group-topk", str(m.moe_router_group_topk))]
    return out


def _pattern_text(p: tuple[int, ...]) -> str:
    """Runs of one value as Megatron's recipes write them: ([0]*3+[1]*58)."""
    runs: list[tuple[int, int]] = []
    for x in p:
        if runs and runs[-1][0] == x:
            runs[-1] = (x, runs[-1][1] + 1)
        else:
            runs.append((x, 1))
    return "(" + "+".join(f"[{x}]*{n}" for x, n in runs) + ")"


def parallel_flags(par: ParallelSpec) -> list[Flag]:
    """--expert-model-parallel-size and --expert-tensor-parallel-size when the layout uses them."""
    out: list[Flag] = []
    if par.ep > 1:
        out.append(("--expert-model-parallel-size", str(par.ep)))
    if par.etp:
        out.append(("--expert-tensor-parallel-size", str(par.etp)))
    return out
