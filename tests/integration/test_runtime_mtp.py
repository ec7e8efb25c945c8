"""DeepSeek-V3's multi-token prediction in the runtime (`lynx.runtime.layers.mtp`): the loss is the definition's
(DeepSeek-V3 report sec. 2.2, as Megatron-Core's MultiTokenPredictionLayer and GPTModel compute it), recomputed here
from the model's parameters without the runtime's MTP code; the pipeline with MTP on its last stage gives the
single-process model's gradients, the embedding's copy on the last stage included; `lynx train` trains DeepSeek-V3's
toy preset with it."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from lynx.runtime.launch import run_ranks  # noqa: E402
from tests.harness.moe_check import MoECase, against_one_process, mtp_grads_against_tp1  # noqa: E402


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _shift(t: torch.Tensor, k: int) -> torch.Tensor:
    """[b, s] moved k positions left, the last k positions 0."""
    out = torch.zeros_like(t)
    out[:, : t.shape[1] - k] = t[:, k:]
    return out


def test_the_mtp_loss_is_deepseek_v3s_definition() -> None:
    """Two MTP depths on deepseek-v3-tiny (MLA, dense first layer, MoE, DeepSeek's router), every norm weight drawn at
    random so that swapping two norms or the concatenation's halves shows: the model's loss equals the main
    cross-entropy plus 0.3 / 2 x (the depths' mean cross-entropies), each depth k from [RMSNorm(emb(t_(i+k))) ;
    RMSNorm(h_(k-1))] through eh_proj, its layer and its output norm, scored by the shared head against t_(i+k+1)
    over the positions that have one."""
    from lynx.models import load_model
    from lynx.runtime.layers.family import runtime_for
    from lynx.runtime.layers.gpt_model import synthetic_batch
    from lynx.spec import ParallelSpec

    model = replace(load_model("deepseek-v3-tiny"), mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
    par = ParallelSpec(tp=1, pp=1, dp=1, micro_batch_size=2, global_batch_size=2, seq_length=16)
    cfg = runtime_for(model).config(model, par, torch.float64, False)
    net = runtime_for(model).model(cfg, model.num_layers, model.vocab_size, None)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.dim() == 1 and ("norm" in name):
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) + 0.5)
    tokens, labels = synthetic_batch(model.vocab_size, 2, 16, 0, 0, torch.device("cpu"))
    got = net(tokens, labels)

    eps = cfg.norm_eps
    with torch.no_grad():
        x = net.wte[tokens].transpose(0, 1)
        for layer in net.layers:
            x = layer(x, 0)
        h = _rms(x, net.norm_f, eps)
        ce = torch.nn.functional.cross_entropy
        main = ce((h @ net.head.t()).flatten(0, 1), labels.t().flatten())
        depth_losses = []
        for k, depth in enumerate(net.mtp.depths, start=1):
            emb = net.wte[_shift(tokens, k)].transpose(0, 1)
            joined = torch.cat((_rms(emb, depth.enorm, eps), _rms(h, depth.hnorm, eps)), -1)
            h = _rms(depth.layer(joined @ depth.eh_proj.weight.t(), 0), depth.out_norm, eps)
            per_token = ce((h @ net.head.t()).flatten(0, 1), _shift(labels, k).t().flatten(), reduction="none")
            keep = (torch.arange(16) < 16 - k).repeat(2, 1).t().flatten().to(per_token.dtype)
            depth_losses.append((per_token * keep).sum() / keep.sum())
        want = main + 0.3 / 2 * sum(depth_losses)
    # (the runtime's cross-entropy runs in float32, as Megatron's does on 16-bit logits)
    assert float(got.detach()) == pytest.approx(float(want), rel=1e-7, abs=0.0)
    assert net.mtp.losses[-1] == pytest.approx([float(v) for v in depth_losses], rel=1e-7)
    assert abs(float(got.detach()) - float(main)) > 1e-3  # the MTP term is there


def test_pp2_with_mtp_gives_the_one_process_models_gradients(tmp_path: Path) -> None:
    """PP 2 under Lynx's policies, DeepSeek-V3's layers (MLA, its router) with one MTP layer on the last stage: the
    main losses and every gradient equal the single-process model's (within float32 rounding: the pipeline sums the
    embedding's two uses in another order), the embedding's gradient on both ends the sum of its two uses."""
    case = MoECase(tp=1, pp=2, dp=1, ep=1, num_layers=4, mtp=1, mla=True, deepseek_router=True)
    out = run_ranks(functools.partial(against_one_process, case), case.world, tmp_path, threads=1)
    for r in out:
        assert not r["missing"] and r["worst_relative"] < 1e-6, r
        assert "wte" in r["names"]
        if r["has_last"]:
            assert any(n.startswith("mtp.depths.0.layer.experts_w") for n in r["names"])
            assert r["losses"] == pytest.approx(r["one_process_losses"], rel=1e-6)
            assert len(r["mtp_losses"]) == case.num_microbatches and all(math.isfinite(v[0]) for v in r["mtp_losses"])


@pytest.mark.slow
def test_tp2_sp_mtp_gradients_are_tp1s(tmp_path: Path) -> None:
    """TP 2 with SP: the MTP norms' gradients (partial per rank over its tokens, summed over TP) and each rank's rows
    of eh_proj's gradient (its output gathered over TP, the input all-gathered along the sequence) equal the
    single-process TP 1 model's."""
    case = MoECase(tp=2, pp=1, dp=1, ep=1, mtp=1, mla=True, deepseek_router=True)
    out = run_ranks(functools.partial(mtp_grads_against_tp1, case), case.world, tmp_path, threads=1)
    for r in out:
        assert set(r["worst"]) >= {"mtp.depths.0.enorm", "mtp.depths.0.hnorm", "mtp.depths.0.out_norm",
                                   "mtp.depths.0.eh_proj.weight"}, r
        assert max(r["worst"].values()) < 1e-5, r
        assert r["losses"] == pytest.approx(r["one_process_losses"], rel=1e-6)


def _lynx(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lynx", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_deepseek_v3_tiny_with_mtp_trains_at_tp2_sp_as_at_tp1(tmp_path: Path) -> None:
    """deepseek-v3-tiny (its MTP layer included) planned and trained by `lynx plan` / `lynx train` at TP 1 and at TP 2
    x EP 2 with SP: 3 iterations with their optimizer steps give the same losses within 1e-5 relative (the MTP's
    eh_proj column-parallel with its output gathered over TP, its norms' partial gradients summed)."""
    losses = []
    layouts = (("one", ["--tp", "1", "--ep", "1"]), ("tp2", ["--tp", "2", "--ep", "2", "--etp", "1", "--sp"]))
    for name, layout in layouts:
        plan, out = tmp_path / f"{name}.json", tmp_path / f"{name}.out.json"
        r = _lynx(["plan", "--model", "deepseek-v3-tiny", "--hardware", "a100-40g-nvlink", *layout, "--pp", "1",
                   "--dp", "1", "--micro-batch", "2", "--global-batch", "4", "--seq-len", "32", "--out", str(plan)])
        assert r.returncode == 0, r.stderr
        r = _lynx(["train", "--plan", str(plan), "--iters", "3", "--warmup", "0", "--threads", "1", "--quiet",
                   "--out", str(out)])
        assert r.returncode == 0, r.stderr[-2000:]
        its = json.loads(out.read_text())["iterations"]
        assert all(len(it["mtp_losses"]) == 1 and math.isfinite(it["mtp_losses"][0]) for it in its), its
        losses.append([it["loss"] for it in its])
    one, tp2 = losses
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(tp2, one, strict=True)), (tp2, one)
