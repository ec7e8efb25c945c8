"""`lynx plan`'s command line as one frozen record (`PlanFlags(**locals())` in `plan_cmd`), and the request each
mode builds from it once (`single_request`, `search_request`): every option reaches the price through here."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lynx.cli.common import build_request
from lynx.cost.fsdp import DDP, DpSharding
from lynx.cost.static_memory import OptimizerPrecision
from lynx.errors import SpecError
from lynx.request import Request


@dataclass(frozen=True, slots=True)
class PlanFlags:
    """The options as typed (None: not given, the mode's default applies); `typed`: the names given."""

    typed: frozenset[str]
    model: str
    hardware: str
    tp: int | None
    pp: int | None
    dp: int | None
    cp: int | None
    cp_comm_type: str
    hierarchical_cp: str | None
    ep: int | None
    etp: int | None
    sp: bool | None
    micro_batch: int | None
    global_batch: int
    seq_len: int
    nodes: int | None
    method: str | None
    compare: bool
    vpp: int | None
    gpus: int | None
    allow_cross_node_tp: bool
    allow_idle_gpus: bool
    top: int
    search_png: Path | None
    target: str | None
    layers_per_stage: str | None
    budget_gb: float | None
    bytes_per_param: float | None
    precision: str | None
    distributed_optimizer: bool | None
    use_megatron_fsdp: bool
    data_parallel_sharding_strategy: str | None
    megatron_fsdp_main_params_dtype: str | None
    megatron_fsdp_main_grads_dtype: str | None
    megatron_fsdp_grad_comm_dtype: str | None
    use_torch_fsdp2: bool
    torch_fsdp2_no_reshard_after_forward: bool
    num_distributed_optimizer_instances: int | None
    busbw: float | None
    recompute_num_layers: int | None
    no_wgrad_overlap: bool
    no_cooldown_overlap: bool
    profile: str | None
    db: Path | None
    time_limit: float
    as_json: bool
    out: Path | None
    gantt: Path | None
    memory_png: Path | None
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    tp_comm_overlap: bool
    from_megatron: str | None
    decoder_first_pipeline_num_layers: int | None
    decoder_last_pipeline_num_layers: int | None
    account_for_embedding_in_pipeline_split: bool
    account_for_loss_in_pipeline_split: bool
    transformer_impl: str
    no_bias_swiglu_fusion: bool
    no_bias_gelu_fusion: bool
    no_masked_softmax_fusion: bool
    no_bias_dropout_fusion: bool
    no_rope_fusion: bool
    no_gradient_accumulation_fusion: bool
    cross_entropy_loss_fusion: bool
    offload: bool | None
    fp8_format: str | None
    fp8_recipe: str | None
    fp8_param_gather: bool
    float8_recipe: str | None
    float8_fsdp_all_gather: bool
    compile: bool
    grad_reduce_in_bf16: bool
    use_precision_aware_optimizer: bool
    main_grads_dtype: str
    main_params_dtype: str
    exp_avg_dtype: str
    exp_avg_sq_dtype: str
    no_store_param_remainders: bool
    optimizer_cpu_offload: bool
    optimizer_offload_fraction: float
    overlap_cpu_optimizer_d2h_h2d: bool
    no_production_overlaps: bool
    jobs: int | None
    search_time_limit: float

    def optimizer_precision(self) -> OptimizerPrecision:
        """The gradient-buffer and optimizer dtypes (`cli.optimizer`); Megatron's fp32 unless given."""
        from lynx.cli.optimizer import OPTIMIZER_FLAGS, optimizer_option

        return optimizer_option({n: getattr(self, n) for n in OPTIMIZER_FLAGS})

    def dp_sharding(self) -> DpSharding:
        """The data-parallel sharding the Megatron flags select (`export.megatron_fsdp.sharding_of`)."""
        from lynx.export.megatron_fsdp import sharding_of

        n = self.num_distributed_optimizer_instances
        return sharding_of({"--use-megatron-fsdp": self.use_megatron_fsdp,
                            "--data-parallel-sharding-strategy": self.data_parallel_sharding_strategy,
                            "--use-torch-fsdp2": self.use_torch_fsdp2,
                            "--torch-fsdp2-no-reshard-after-forward": self.torch_fsdp2_no_reshard_after_forward,
                            "--num-distributed-optimizer-instances": 1 if n is None else n,
                            "--megatron-fsdp-main-params-dtype": self.megatron_fsdp_main_params_dtype,
                            "--megatron-fsdp-main-grads-dtype": self.megatron_fsdp_main_grads_dtype,
                            "--megatron-fsdp-grad-comm-dtype": self.megatron_fsdp_grad_comm_dtype},
                           where="")

    def fusion_flags(self) -> dict[str, Any]:
        """Megatron's fusion flags by their names (`export.megatron_fusion.fusion_fields` reads them)."""
        return {"--transformer-impl": self.transformer_impl, "--no-bias-swiglu-fusion": self.no_bias_swiglu_fusion,
                "--no-bias-gelu-fusion": self.no_bias_gelu_fusion,
                "--no-masked-softmax-fusion": self.no_masked_softmax_fusion,
                "--no-bias-dropout-fusion": self.no_bias_dropout_fusion, "--no-rope-fusion": self.no_rope_fusion,
                "--no-gradient-accumulation-fusion": self.no_gradient_accumulation_fusion,
                "--cross-entropy-loss-fusion": self.cross_entropy_loss_fusion}

    def fusions_given(self) -> list[str]:
        """The fusion flags that differ from Megatron-Core's defaults, by name."""
        return [f"{f} {v}" if f == "--transformer-impl" else f for f, v in self.fusion_flags().items()
                if (v != "transformer_engine" if f == "--transformer-impl" else v)]


def _with_fusions(req: Request, f: PlanFlags) -> Request:
    """The model's fusion fields from Megatron's flags (`--transformer-impl local` plans Megatron-Core's local
    attention, which is unfused), the request checked again with them."""
    if not f.fusions_given():
        return req
    from lynx.checks import check_inputs
    from lynx.export.megatron_fusion import fusion_fields

    fields = fusion_fields(f.fusion_flags(), req.model.activation)
    if fields["transformer_impl"] == "local":
        fields["attention"] = "standard"
    out = replace(req, model=replace(req.model, **fields))
    check_inputs(out.model, out.hardware, out.parallel, out.options)
    return out


def _request(f: PlanFlags, tp: int, pp: int, dp: int, sp: bool, mb: int, nodes: int | None, layers: str | None,
             dist_opt: bool, cp: int, hierarchical_cp: str | None, vpp: int = 1,
             sharding: DpSharding = DDP, ep: int = 1, etp: int | None = None) -> Request:
    req = build_request(f.model, f.hardware, tp, pp, dp, sp, mb, f.global_batch, f.seq_len, nodes, layers,
                        f.budget_gb, f.bytes_per_param, f.recompute_num_layers, f.no_wgrad_overlap, None,
                        f.time_limit, cooldown_overlap=not f.no_cooldown_overlap, precision=f.precision or "paper",
                        distributed_optimizer=dist_opt, busbw_gbps=f.busbw,
                        overlap_grad_reduce=f.overlap_grad_reduce, overlap_param_gather=f.overlap_param_gather,
                        tp_comm_overlap=f.tp_comm_overlap, cp=cp, cp_comm_type=f.cp_comm_type,
                        hierarchical_cp=hierarchical_cp, vpp=vpp, method=f.method or "lynx",
                        dp_sharding=sharding, ep=ep, etp=etp, optimizer_precision=f.optimizer_precision(),
                        account_for_embedding=f.account_for_embedding_in_pipeline_split,
                        account_for_loss=f.account_for_loss_in_pipeline_split)
    return _with_fp8(_with_fusions(req, f), f)


def _with_fp8(req: Request, f: PlanFlags) -> Request:
    """The model's FP8 setting from Megatron's flags (`lynx.fp8`), the request checked again with it."""
    from lynx.cli.fp8 import fp8_option

    fp8 = fp8_option(f.fp8_format, f.fp8_recipe, f.fp8_param_gather, f.float8_recipe, f.float8_fsdp_all_gather)
    if fp8 is None and not f.compile:
        return req
    if f.profile:
        what = "--compile" if fp8 is None else "--fp8-format" if f.fp8_format else "--float8-recipe"
        raise SpecError(f"{what} with --profile: a profile measured the kernels it ran; {what} changes the "
                        "analytic model only")
    from lynx.checks import check_inputs

    out = replace(req, model=replace(req.model, fp8=fp8 or req.model.fp8, compiled=f.compile or req.model.compiled))
    check_inputs(out.model, out.hardware, out.parallel, out.options)
    return out


def single_request(f: PlanFlags, tp: int, pp: int, dp: int, cp: int) -> Request:
    """One layout's request: the single layout's defaults for what was not given, Megatron's split flags."""
    req = _request(f, tp, pp, dp, bool(f.sp), 8 if f.micro_batch is None else f.micro_batch, f.nodes,
                   f.layers_per_stage, bool(f.distributed_optimizer), cp, f.hierarchical_cp,
                   1 if f.vpp is None else f.vpp, f.dp_sharding(), 1 if f.ep is None else f.ep, f.etp)
    first, last = f.decoder_first_pipeline_num_layers, f.decoder_last_pipeline_num_layers
    emb, loss = f.account_for_embedding_in_pipeline_split, f.account_for_loss_in_pipeline_split
    if first is None and last is None and not emb and not loss:
        return req
    from lynx.checks import check_inputs

    opts = replace(req.options, decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last,
                   account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss)
    check_inputs(req.model, req.hardware, req.parallel, opts)
    return replace(req, options=opts)


def search_request(f: PlanFlags, total: int, per_node: int, sp: bool, dist_opt: bool) -> Request:
    """The options every candidate of the search shares (its layout is searched): the cluster's nodes, so a
    pinned layout as large as the cluster is checked against the cluster, not the preset's size. EP and ETP are
    searched (or pinned) per candidate (`search.experts`): the shared request has none."""
    if f.busbw is not None:  # refused by the mode check; kept for API callers
        raise SpecError("--busbw is a TP group's measured bandwidth; pin --tp to use it (not with the search)")
    return _request(f, f.tp or 1, f.pp or 1, 1, sp, 1, -(-total // per_node), None, dist_opt, 1, None)
