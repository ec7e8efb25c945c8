"""Megatron-Core 0.16.1 on CPU over gloo, for tests only: the seams around its CUDA assumptions
(/work/shared/notes/megatron-core-on-cpu.md lists each, measured; docs/decisions/0160-megatron-cpu-test-seams.md
records the choice). Nothing here edits an installed file; every seam is an attribute or a configuration field,
set once per test process (`install`).

Where Megatron-Core assumes CUDA -> the seam here:

* the RNG tracker (``tensor_parallel/random.py``: ``CudaRNGStatesTracker.add``, ``_get/_set_cuda_rng_state``)
  -> `_CpuTracker` installed as the module's tracker; the two state functions on the CPU generator;
* buffers on ``torch.cuda.current_device()`` (global memory buffer, SP mappings, p2p shapes, DDP)
  -> ``torch.cuda.current_device`` returns the CPU device;
* ``device="cuda"`` in the pipeline schedules -> the schedules module's ``torch`` is a proxy whose ``zeros``
  maps cuda to cpu;
* ``torch.cuda.synchronize()`` in p2p -> config ``batch_p2p_sync=False`` (`config`);
* the default causal mask built on cuda -> an explicit mask (`causal_mask`) passed to ``GPTModel.forward``;
* the local norm refuses SP (``transformer/torch_norm.py``) -> `SPLayerNorm` / `SPRMSNorm` in the layer spec
  and as the block's final norm (`layer_spec`);
* tied embeddings with PP call ``.cuda()`` -> ``Tensor.cuda`` returns the tensor while the model is built.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

from tests.harness.megatron_plans import Shape

_INSTALLED: list[bool] = []


def install() -> None:
    """Install the process-wide seams (idempotent). Call after `torch.distributed` is initialised and before
    Megatron-Core's parallel state."""
    if _INSTALLED:
        return
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom

    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu  # type: ignore[assignment,return-value]
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)

    class _CpuTracker(mrandom.CudaRNGStatesTracker):  # type: ignore[misc]
        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

    mrandom._CUDA_RNG_STATE_TRACKER = _CpuTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom.initialize_rng_tracker = lambda *a, **k: None

    real = schedules.torch

    class _SchedulesTorch(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def zeros(*a: Any, **k: Any) -> torch.Tensor:
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return real.zeros(*a, **k)

    schedules.torch = _SchedulesTorch("torch")
    _INSTALLED.append(True)


@contextlib.contextmanager
def no_cuda_calls() -> Iterator[None]:
    """``Tensor.cuda`` returns the tensor (Megatron-Core's tied embeddings with PP move the word embedding)."""
    own = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = own  # type: ignore[method-assign]


def _sp_norm(base: type) -> type:
    class Norm(base):  # type: ignore[misc,valid-type]
        """torch's norm that Megatron's SP accepts: its parameters are tagged ``sequence_parallel`` so
        `finalize_model_grads` all-reduces their gradients over TP."""

        def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
            super().__init__(hidden_size, eps=eps)
            for p in self.parameters():
                p.sequence_parallel = bool(config.sequence_parallel)

    Norm.__name__ = f"SP{base.__name__}"
    return Norm


SPLayerNorm = _sp_norm(torch.nn.LayerNorm)
SPRMSNorm = _sp_norm(torch.nn.RMSNorm)


def config(t: Shape, tp: int = 1, pp: int = 1, sp: bool = False, full_recompute: bool = False,
           vpp: int | None = None) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: dict[str, Any] = dict(
        num_layers=t.layers, hidden_size=t.hidden, num_attention_heads=t.heads, ffn_hidden_size=t.ffn,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
        virtual_pipeline_model_parallel_size=vpp,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, batch_p2p_sync=False,
        hidden_dropout=t.dropout, attention_dropout=t.dropout, init_method_std=0.02,
        deallocate_pipeline_outputs=True,  # as Megatron-LM sets it: a stage frees its output once sent
    )
    if t.llama:
        kw.update(normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                  add_bias_linear=False, num_query_groups=t.groups)
    if full_recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(**kw)


def layer_spec(t: Shape, sp: bool, chunks: int = 1) -> Any:
    """Megatron-Core's own local GPT layer spec (`get_gpt_layer_local_spec`); with SP its two norms and the
    block's final norm are `SPLayerNorm` / `SPRMSNorm` (the rest of the spec unchanged), as a block spec of
    the layers one of `chunks` model chunks (PP x VPP) builds."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(normalization="RMSNorm" if t.llama else "LayerNorm")
    if t.flash:
        from lynx.integrations.megatron.attention import with_flash_attention

        spec = with_flash_attention(spec)
    if not sp:
        return spec
    norm = SPRMSNorm if t.llama else SPLayerNorm
    sub = dataclasses.replace(spec.submodules, input_layernorm=norm, pre_mlp_layernorm=norm)
    layer = dataclasses.replace(spec, submodules=sub)
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=[layer] * (t.layers // chunks),
                                                            layer_norm=norm))


def build_gpt(t: Shape, cfg: Any, spec: Any, seed: int = 1234, vp_stage: int | None = None) -> Any:
    """Megatron-Core's GPTModel for this rank's stage (seeded as Megatron seeds it)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    with no_cuda_calls():
        return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=t.vocab, max_sequence_length=t.seq,
                        pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
                        post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
                        share_embeddings_and_output_weights=not t.llama,
                        position_embedding_type="rope" if t.llama else "learned_absolute", vp_stage=vp_stage)


def causal_mask(seq: int) -> torch.Tensor:
    """Megatron's causal mask (True: masked), built on the CPU."""
    return torch.triu(torch.ones(seq, seq), diagonal=1).bool().view(1, 1, seq, seq)




def wrap_ddp(cfg: Any, model: Any, t: Shape | None = None) -> Any:
    """Megatron-Core's own DDP around one model chunk (gradients in its main_grad buffers), with the shape's
    DDP switches (`Shape.overlap_grad_reduce`, `Shape.distributed_optimizer`)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                        overlap_grad_reduce=t is not None and t.overlap_grad_reduce,
                                        use_distributed_optimizer=t is not None and t.distributed_optimizer,
                                        overlap_param_gather=t is not None and t.overlap_param_gather,
                                        bucket_size=None if t is None else t.bucket_size)
    return DistributedDataParallel(cfg, ddp, model)


def batches(t: Shape, n: int, mbs: int = 2, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` micro-batches of (tokens, labels), the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, t.vocab, (mbs, t.seq + 1), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def train_step(t: Shape, cfg: Any, chunks: list[Any], data: list[tuple[torch.Tensor, torch.Tensor]],
               schedule: dict[str, Any] | None = None,
               keep_grads: bool = True) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One step of Megatron-Core's own schedule (`get_forward_backward_func`) and `finalize_model_grads` over
    DDP-wrapped `chunks`: (losses on the last stage, every parameter's gradient by name, chunk-prefixed)."""
    from functools import partial

    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mask = causal_mask(t.seq)
    pos = torch.arange(t.seq).unsqueeze(0).expand(data[0][0].shape[0], -1)
    losses: list[float] = []

    def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = out.float().mean()
        losses.append(float(loss.detach()))
        return loss, {"loss": loss.detach()}

    def forward_step(it: Any, model: Any) -> tuple[torch.Tensor, Any]:
        tokens, labels = next(it)
        return model(tokens, pos, mask, labels=labels), partial(loss_func)

    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    for c in chunks:
        c.zero_grad_buffer()
    fb = get_forward_backward_func()
    iters = [iter(data) for _ in chunks]
    kw = schedule or {}
    fb(forward_step_func=forward_step, data_iterator=iters if len(chunks) > 1 else iters[0],
       model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(data), seq_length=t.seq,
       micro_batch_size=data[0][0].shape[0], forward_only=False, **kw)
    grads = {f"{i}.{n}": p.main_grad.detach().clone() for i, c in enumerate(chunks)
             for n, p in c.module.named_parameters()} if keep_grads else {}
    return losses, grads


def stale_other_shards(chunks: list[Any]) -> None:
    """What the distributed optimizer's step leaves before the next forward: this rank's shard of every
    parameter bucket updated, the other ranks' shards stale until the bucket's all-gather (here: the other shards
    shifted by 1, so a parameter read before its bucket's gather gives a different loss and gradients)."""
    import torch.distributed as dist

    for c in chunks:
        for g in c.bucket_groups:
            size = dist.get_world_size(g.intra_distributed_optimizer_instance_group)
            mine = dist.get_rank(g.intra_distributed_optimizer_instance_group)
            for b in g.buckets:
                n = b.param_data.numel() // size
                with torch.no_grad():
                    for r in range(size):
                        if r != mine:
                            b.param_data[r * n:(r + 1) * n] += 1.0

