"""The written torchtitan AC module on CPU: a small model shaped like torchtitan's decoder (tok_embeddings,
layers.<i>, norm, lm_head) with GPT blocks gets each block wrapped as the plan says. Observed through torch:
saved tensors counted with saved_tensors_hooks, and the forward ops that run again during backward (the
recomputation) logged with a dispatch mode. Gradients match the unwrapped model.

Dropout calls aten.native_dropout, as F.dropout does on CUDA (on CPU F.dropout decomposes into bernoulli_/mul,
which the op mapping does not name; docs/export.md)."""

from __future__ import annotations

import copy
import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from lynx.api import plan as plan_with  # noqa: E402
from lynx.decisions import RecomputePolicy  # noqa: E402
from lynx.export.torchtitan import ORDER, build_torchtitan, render_ac, replayed_ops  # noqa: E402
from lynx.policy.rules import full_layer, keep_all, on_demand  # noqa: E402
from tests.conftest import problem_for  # noqa: E402

D, HEADS, P = 16, 2, 0.1


class Dropout(nn.Module):
    def forward(self, x: Any) -> Any:
        return torch.native_dropout(x, P, self.training)[0]


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv, self.wo, self.drop = nn.Linear(D, 3 * D), nn.Linear(D, D), Dropout()

    def forward(self, x: Any) -> Any:
        b, t, _ = x.shape
        hd = D // HEADS
        q, k, v = (y.reshape(b, t, HEADS, hd).transpose(1, 2).reshape(b * HEADS, t, hd)
                   for y in self.wqkv(x).split(D, -1))
        scores = torch.baddbmm(torch.empty(b * HEADS, t, t), q, k.transpose(1, 2), beta=0.0, alpha=1 / math.sqrt(hd))
        ctx = torch.bmm(self.drop(torch.softmax(scores, -1)), v)
        return self.wo(ctx.reshape(b, HEADS, t, hd).transpose(1, 2).reshape(b, t, D))


class Block(nn.Module):
    """torchtitan's TransformerBlock shape with GPT parts: norm, attention, residual; norm, MLP, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention, self.ffn_norm = nn.LayerNorm(D), Attention(), nn.LayerNorm(D)
        self.feed_forward = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.drop1, self.drop2 = Dropout(), Dropout()

    def forward(self, x: Any) -> Any:
        h = x + self.drop1(self.attention(self.attention_norm(x)))
        return h + self.drop2(self.feed_forward(self.ffn_norm(h)))


class Decoder(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, D)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n)})
        self.norm, self.lm_head = nn.LayerNorm(D), nn.Linear(D, 32)


class Recorder(TorchDispatchMode):
    """Names the forward ops that run during backward (the recomputation): matmuls and norms by the
    parameter they use, the rest by kind; residual dropouts by order (both have the block's shape)."""

    def __init__(self, block: Any) -> None:
        super().__init__()
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        params = {"qkv": inner.attention.wqkv, "attn_proj": inner.attention.wo, "fc1": inner.feed_forward[0],
                  "fc2": inner.feed_forward[2], "ln1": inner.attention_norm, "ln2": inner.ffn_norm}
        self.by_ptr = {m.weight.data_ptr(): n for n, m in params.items()}
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name in ("aten.addmm.default", "aten.native_layer_norm.default"):
            self.seen.append(self.by_ptr[args[2].data_ptr()])
        elif name == "aten.native_dropout.default":
            attn = args[0].dim() == 3 and args[0].shape[-1] == args[0].shape[-2] and args[0].shape[-1] != D
            self.seen.append("attn_dropout" if attn else "residual_dropout")
        else:
            simple = {"aten._softmax.default": "softmax", "aten.gelu.default": "gelu",
                      "aten.baddbmm.default": "attn_scores"}
            if name in simple:
                self.seen.append(simple[name])
        return func(*args, **(kwargs or {}))

    def recomputed(self) -> set[str]:
        out = {n for n in self.seen if n != "residual_dropout"}
        residual = ["attn_residual", "mlp_residual"]
        out |= set(residual[: self.seen.count("residual_dropout")])
        return out


def _load(text: str, tmp: Path) -> ModuleType:
    path = tmp / "lynx_torchtitan_ac.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("lynx_torchtitan_ac_test", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _plan_source() -> Any:
    """The gpt-7b plan's graph with four hand-picked layer policies: keep all, full, two selective."""
    p = plan_with(problem_for(), "none", record=False)
    g = p.problem.graph
    sel_a = on_demand(g, frozenset({"qkv", "attn_context", "fc1", "attn_residual", "mlp_residual"}))
    sel_b = on_demand(g, g.needed() - {"gelu", "softmax", "attn_dropout", "ln1"})
    pols = (RecomputePolicy("x", (keep_all(g), full_layer(g))), RecomputePolicy("x", (sel_a, sel_b)))
    from lynx.export.layout import ChunkLayout
    from lynx.export.source import ExportSource

    src = ExportSource(p.problem, p.result, ChunkLayout(2, 1, (2, 2)), pols)
    return src, (keep_all(g), full_layer(g), sel_a, sel_b)


def _block_run(block: Any, x: Any) -> tuple[int, set[str], list[Any]]:
    count = [0]

    def pack(t: Any) -> Any:
        count[0] += 1
        return t

    torch.manual_seed(7)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x)
    rec = Recorder(block)
    with rec:
        y.square().sum().backward()
    return count[0], rec.recomputed(), [x.grad.clone()] + [q.grad.clone() for q in block.parameters()]


def test_blocks_are_wrapped_as_the_plan_says(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    src, lps = _plan_source()
    exp = build_torchtitan(src)
    assert [e["mode"] for e in exp.ac_table["layers"]] == ["none", "full", "selective", "selective"]
    ac = _load(render_ac(exp), tmp_path)
    torch.manual_seed(0)
    plain = Decoder(4)
    wrapped = ac.apply_lynx_ac(copy.deepcopy(plain))
    assert wrapped.layers["0"] is not None and type(wrapped.layers["0"]) is Block
    all_ops = set(n for names in ORDER["gpt"].values() for n in names) - {"core_attn"}
    for i, lp in enumerate(lps):
        x0 = torch.randn(2, 5, D)
        xa, xb = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        n_plain, rec_plain, g_plain = _block_run(plain.layers[str(i)], xa)
        n_wrap, rec_wrap, g_wrap = _block_run(wrapped.layers[str(i)], xb)
        for a, b in zip(g_plain, g_wrap, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert rec_plain == set()
        entry = exp.ac_table["layers"][i]
        if entry["mode"] == "none":
            assert n_wrap == n_plain and rec_wrap == set()
            continue
        assert n_wrap < n_plain  # the checkpoint holds its input, not the block's activations
        if entry["mode"] == "full":
            assert rec_wrap == all_ops - {"attn_context"}  # every forward op reruns (bmm is not logged)
            continue
        kept = set(entry["keep"]) & all_ops
        assert not (rec_wrap & kept), f"layer {i}: kept ops recomputed: {rec_wrap & kept}"
        assert set(lp.recomputed()) - {"attn_context"} <= rec_wrap
        # exactly what the exporter announces: everything named but not kept (bmm is not logged)
        assert rec_wrap == replayed_ops(src.problem.graph, "gpt", entry) - {"attn_context"}


def test_torchtitan_base_class_wraps_the_same_blocks(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan.distributed.activation_checkpoint")
    src, _ = _plan_source()
    ac = _load(render_ac(build_torchtitan(src)), tmp_path)
    model = Decoder(4)
    ac.LynxPlanAC.Config().build().apply(model)
    kinds = [type(model.layers[str(i)]).__name__ for i in range(4)]
    assert kinds[0] == "Block" and all(k == "CheckpointWrapper" for k in kinds[1:])


def test_llama_matmul_order_matches_torchtitan_block() -> None:
    """ORDER['llama'] names matmuls by position; torchtitan's own Llama3 block must call them in that order.
    (Forward only, via module hooks. The attention kernel itself, which calls no linear layer, is replaced by one
    that returns the queries: flex attention compiles for about ten seconds on a CPU and has no CPU backward.)"""
    registry = pytest.importorskip("torchtitan.models.llama3")
    torch.set_num_threads(1)
    model = registry.model_registry("debugmodel", attn_backend="flex").model.build()
    block = model.layers["0"]

    class Queries(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **_: object) -> torch.Tensor:
            return q

    block.attention.inner_attention = Queries()
    lynx_name = {"attention.qkv_linear.wqkv": "qkv", "attention.wo": "attn_proj", "feed_forward.w1": "gate_up",
                 "feed_forward.w3": "gate_up", "feed_forward.w2": "down"}
    order: list[str] = []
    for name, mod in block.named_modules():
        if isinstance(mod, nn.Linear):
            mod.register_forward_pre_hook(lambda m, a, name=name: order.append(lynx_name[name]))
    pos = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        block(torch.randn(1, 16, model.config.dim), None, pos)
    assert order == ORDER["llama"]["mm"]


def test_apply_lynx_config_sets_torchtitan_trainer_fields(tmp_path: Path) -> None:
    """Field names checked by torchtitan's own slotted config classes (an unknown name raises)."""
    registry = pytest.importorskip("torchtitan.models.llama3.config_registry")
    src, _ = _plan_source()
    exp = build_torchtitan(src)
    ac = _load(render_ac(exp), tmp_path)
    cfg = ac.apply_lynx_config(registry.llama3_debugmodel())
    par = cfg.parallelism
    assert par.pipeline_parallel_degree == 2 and par.tensor_parallel_degree == 4
    assert par.module_fqns_per_model_part == exp.config["parallelism"]["module_fqns_per_model_part"]
    assert par.pipeline_parallel_schedule_csv == str(tmp_path / "lynx_schedule.csv")
    assert cfg.training.local_batch_size == 128 and isinstance(cfg.activation_checkpoint, ac.LynxPlanAC.Config)


def test_a_plan_of_another_family_is_refused(tmp_path: Path) -> None:
    registry = pytest.importorskip("torchtitan.models.llama3")
    src, _ = _plan_source()  # a GPT plan
    ac = _load(render_ac(build_torchtitan(src)), tmp_path)
    model = registry.model_registry("debugmodel", attn_backend="flex").model.build()
    with pytest.raises(ValueError, match="5 linear layers"):
        ac.wrap_block(model.layers["2"], 2)
