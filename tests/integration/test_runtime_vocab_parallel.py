"""The embedding and the LM head as the planner prices them (issue 23 item 3): at TP = 2 the runtime's stages
hold the parameters `lynx.cost.static_memory.stage_params` counts (vocabulary-parallel word embedding and head,
V h / t per rank), its logits and the cross-entropy's fp32 working copy are the bytes
`lynx.cost.memory.extra_transient_bytes` prices (6 s b V / t: 16-bit logits and their fp32 copy, under bf16
autocast), and the vocabulary-parallel cross-entropy equals the whole-vocabulary one. Two gloo ranks through
`lynx.runtime.launch.run_ranks`, GPT (tied, learned positions, dropout) and LLaMA (untied, RoPE)."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lynx.cost.memory import extra_transient_bytes  # noqa: E402
from lynx.cost.static_memory import stage_params  # noqa: E402
from lynx.runtime.launch import run_ranks  # noqa: E402
from lynx.runtime.layers.ends import lm_loss  # noqa: E402
from lynx.runtime.layers.gpt import LayerConfig  # noqa: E402
from lynx.runtime.layers.gpt_model import synthetic_batch  # noqa: E402
from lynx.runtime.layers.llama import LlamaConfig  # noqa: E402
from lynx.runtime.pipeline.stages import StageModule, StageSpec  # noqa: E402
from lynx.spec import ParallelSpec  # noqa: E402
from tests.harness.check import model_spec  # noqa: E402

VOCAB = 96
CFGS = {
    "gpt": LayerConfig(hidden_size=32, num_attention_heads=4, ffn_hidden_size=128, seq_length=16, micro_batch_size=2,
                       tp=2),
    "llama": LlamaConfig(hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
                         seq_length=16, micro_batch_size=2, tp=2),
}


def _bytes(mod: torch.nn.Module, prefixes: tuple[str, ...]) -> int:
    return sum(p.untyped_storage().nbytes() for n, p in mod.named_parameters() if n.startswith(prefixes))


def _measure(family: str, group: Any, sp: bool = False) -> dict[str, Any]:
    cfg = replace(CFGS[family], sequence_parallel=sp)
    first = StageModule(StageSpec(0, 2, 0, 1, None), cfg, VOCAB, group)
    last = StageModule(StageSpec(1, 2, 1, 1, None), cfg, VOCAB, group)
    ends = first.ends
    norm = tuple(p for p in ends.last_params if p not in ("wte", "head"))
    out: dict[str, Any] = {
        "embedding": _bytes(first, ends.first_params),
        "head": _bytes(last, tuple(p for p in ends.last_params if p not in norm)),
        "final_norm": _bytes(last, norm),
        "layers": _bytes(first, ("layers.",)),
    }
    tok, lab = synthetic_batch(VOCAB, cfg.micro_batch_size, cfg.seq_length, 0)
    x = torch.randn(cfg.seq_length, cfg.micro_batch_size, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    x = x.chunk(2, 0)[torch.distributed.get_rank()].clone() if cfg.sequence_parallel else x
    # the LM head under bf16 autocast: 16-bit logits, and the loss's fp32 working copy held for backward
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = last.ends.head(last, x, group)
    loss = lm_loss(logits, lab, group)
    ce_node = loss.grad_fn.next_functions[0][0]  # mean <- the vocabulary-parallel cross-entropy
    work = ce_node.saved_tensors[0]
    out["logits_shape"] = list(logits.shape)
    out["logits_dtype"] = str(logits.dtype)
    out["work_dtype"] = str(work.dtype)
    out["transient"] = logits.untyped_storage().nbytes() + work.untyped_storage().nbytes()
    # fp32: the sharded loss and its logits gradient against the whole vocabulary's (gathered) cross-entropy
    logits = last.ends.head(last, x, group).detach().requires_grad_(True)
    loss = lm_loss(logits, lab, group)
    loss.backward()
    parts = [torch.empty_like(logits) for _ in range(2)]
    torch.distributed.all_gather(parts, logits.detach(), group=group)
    full = torch.cat(parts, -1).requires_grad_(True)
    ref = lm_loss(full, lab)
    ref.backward()
    mine = full.grad.chunk(2, -1)[torch.distributed.get_rank()]
    out["loss_err"] = abs(float(loss) - float(ref))
    out["grad_err"] = float((logits.grad - mine).abs().max())
    # the embedding: vocabulary-parallel lookups summed over TP equal the whole matrix's rows
    emb = first.ends.embed(first, tok, 0, group)
    out["embed_shape"] = list(emb.shape)
    return out


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_tp2_embedding_and_logits_bytes_equal_the_planners(family: str, tmp_path: Any) -> None:
    cfg = CFGS[family]
    model = model_spec(cfg, 2, VOCAB)
    par = ParallelSpec(tp=2, pp=2, micro_batch_size=cfg.micro_batch_size, global_batch_size=cfg.micro_batch_size,
                       seq_length=cfg.seq_length)
    want0, want1 = stage_params(model, par, 0, 1), stage_params(model, par, 1, 1)
    for rank, r in enumerate(run_ranks(functools.partial(_measure, family), 2, tmp_path)):
        # fp32 parameters: 4 bytes per parameter the planner counts on this TP rank
        assert r["embedding"] == 4 * want0.embedding, (rank, r)
        assert r["head"] == 4 * want1.head, (rank, r)
        assert r["final_norm"] == 4 * want1.final_norm, (rank, r)
        assert r["layers"] == 4 * want0.layers, (rank, r)
        assert r["logits_shape"] == [cfg.seq_length, cfg.micro_batch_size, VOCAB // 2]
        assert (r["logits_dtype"], r["work_dtype"]) == ("torch.bfloat16", "torch.float32")
        assert r["transient"] == extra_transient_bytes(model, par, 1), (rank, r)
        assert r["loss_err"] < 1e-6 and r["grad_err"] < 1e-7, (rank, r)
        assert r["embed_shape"] == [cfg.seq_length, cfg.micro_batch_size, cfg.hidden_size]


def test_tp2_sequence_parallel_ends(tmp_path: Any) -> None:
    """With SP the embedding leaves this rank's sequence shard (reduce-scattered for LLaMA, split after the
    position embedding for GPT) and the head still gives V / t logits over the whole sequence."""
    for family in ("gpt", "llama"):
        res = run_ranks(functools.partial(_measure, family, sp=True), 2, tmp_path)
        cfg = CFGS[family]
        for r in res:
            assert r["embed_shape"] == [cfg.seq_length // 2, cfg.micro_batch_size, cfg.hidden_size]
            assert r["logits_shape"] == [cfg.seq_length, cfg.micro_batch_size, VOCAB // 2]
            assert r["loss_err"] < 1e-6 and r["grad_err"] < 1e-7, r
