"""The eager kernels' traffic lynx prices (`lynx.families.fusion.RMSNORM_EAGER`, the torchtitan family's ops)
against torch's own aten ops on CPU: every memory-bound op's tensor bytes read and written, and the op count
(`lynx.integrations.torchtitan.measure.eager_traffic`). GEMMs and attention are priced by FLOPs and left out."""

from __future__ import annotations

import dataclasses

import pytest

from lynx.errors import SpecError
from lynx.families import fusion, llama, titan
from lynx.models import load_model
from lynx.spec import ParallelSpec

torch = pytest.importorskip("torch")


def test_the_eager_rmsnorm_constants_are_torchs_composite() -> None:
    from lynx.integrations.torchtitan.measure import eager_traffic

    h, tok = 1024, 256
    norm = torch.nn.RMSNorm(h, dtype=torch.bfloat16)
    x = torch.randn(2, tok // 2, h, dtype=torch.bfloat16, requires_grad=True)
    (fb, fk), (bb, bk) = eager_traffic(lambda: norm(x), torch.randn_like(x))
    unit = 2 * tok * h  # lynx counts 16-bit elements of the op's size
    p = fusion.RMSNORM_EAGER
    assert (fk, bk) == (p.fwd_kernels, p.bwd_kernels)
    # the eps add, rsqrt and the 1/rms chain run over one value per token: 1/h of a unit each
    assert fb / unit == pytest.approx(p.fwd, abs=0.05)
    assert bb / unit == pytest.approx(p.bwd, abs=0.1)


def _titan(n_kv: int, norm_fusion: bool) -> object:
    m = load_model("llama-tiny")
    return dataclasses.replace(m, name="titan-debug", family="torchtitan-llama3", num_layers=6, hidden_size=256,
                               num_attention_heads=16, num_query_groups=n_kv, ffn_hidden_size=768, vocab_size=2048,
                               norm_fusion=norm_fusion)


def _priced(spec: object) -> tuple[tuple[float, float], tuple[float, float]]:
    ops = [o for o in spec.ops  # type: ignore[attr-defined]
           if o.kind == "compute" and o.gemm_mnk is None and o.attn_seq_head is None and o.name != "core_attn"]
    fwd = (sum(o.mem_bytes for o in ops), sum(o.kernels for o in ops))
    bwd = (sum(o.bwd_mem_bytes if o.bwd_mem_bytes is not None else o.bwd_factor * o.mem_bytes for o in ops),
           sum(o.bwd_kernels if o.bwd_mem_bytes is not None else 1 for o in ops))
    return fwd, bwd


@pytest.mark.parametrize(("n_kv", "mb", "seq"), [(16, 1, 128), (4, 2, 64)])
def test_titan_family_prices_the_traffic_torchtitans_block_runs(n_kv: int, mb: int, seq: int) -> None:
    """torchtitan 0.3.0's Llama 3 block, forward and backward on CPU (RMSNorm as the eager composite): the bytes
    its memory-bound kernels move, within 1% of the family's price (the per-token ops on one value are not
    priced), and exactly its kernel count."""
    pytest.importorskip("torchtitan")
    from lynx.integrations.torchtitan.measure import eager_traffic
    from tests.harness.torchtitan_models import debug_model

    block = debug_model(1, None if n_kv == 16 else n_kv).layers["0"]
    for prm in block.parameters():
        prm.data = prm.data.to(torch.bfloat16)
    x = torch.randn(mb, seq, 256, dtype=torch.bfloat16, requires_grad=True)
    (fb, fk), (bb, bk) = eager_traffic(lambda: block(x, None, None), torch.randn_like(x))
    spec = titan.layer(_titan(n_kv, norm_fusion=False),  # type: ignore[arg-type]
                       ParallelSpec(micro_batch_size=mb, global_batch_size=mb, seq_length=seq))
    (pf, pfk), (pb, pbk) = _priced(spec)
    assert (fk, bk) == (pfk, pbk)
    assert fb == pytest.approx(pf, rel=0.01) and fb >= pf
    assert bb == pytest.approx(pb, rel=0.01) and bb >= pb


def test_a_fused_norm_moves_a_tenth_of_the_eager_ones_bytes() -> None:
    """The family's default (torch's fused RMSNorm on CUDA) against the eager composite, Llama-3-8B shapes."""
    par = ParallelSpec(micro_batch_size=1, global_batch_size=1, seq_length=1024)
    m = dataclasses.replace(load_model("llama3-8b"), family="torchtitan-llama3")
    fused = {o.name: o for o in titan.layer(m, par).ops}
    eager = {o.name: o for o in titan.layer(dataclasses.replace(m, norm_fusion=False), par).ops}
    assert eager["rmsnorm1"].mem_bytes == 10 * fused["rmsnorm1"].mem_bytes
    assert (eager["rmsnorm1"].kernels, fused["rmsnorm1"].kernels) == (8, 1)
    assert fused["rmsnorm1"].mask_bytes == 0 and eager["rmsnorm1"].mask_bytes == 8 * 1024 * 4096 + 4 * 1024


def test_megatron_llama_with_an_eager_norm_keeps_its_fp32_copy_not_its_input() -> None:
    """Megatron-LM's legacy RMSNorm (the Mist benchmark's baseline): family llama with norm_fusion false."""
    par = ParallelSpec(micro_batch_size=1, global_batch_size=1, seq_length=1024)
    m = load_model("llama3-8b")
    te = {o.name: o for o in llama.layer(m, par).ops}
    legacy = {o.name: o for o in llama.layer(dataclasses.replace(m, norm_fusion=False), par).ops}
    n = 1024 * 4096
    # not its 16-bit input: its fp32 input, normalized input and 1/rms (side state) and its output's size (the
    # weight product's operand), as torchtitan's eager norm (the same composite) keeps them
    assert te["rmsnorm2"].saved == ("attn_residual",) and legacy["rmsnorm2"].saved == ("rmsnorm2",)
    assert legacy["rmsnorm2"].mask_bytes == 8 * n + 4 * 1024
    assert legacy["rmsnorm2"].mem_bytes == 2 * 20 * n and legacy["rmsnorm2"].bwd_mem_bytes == 2 * 54 * n
    assert legacy["swiglu"] == te["swiglu"]  # nothing else moves


def test_norm_fusion_false_is_refused_where_it_means_nothing() -> None:
    from lynx.export.megatron_fusion import fusion_args

    gpt = dataclasses.replace(load_model("gpt-1.3b"), norm_fusion=False)
    with pytest.raises(SpecError, match="norm_fusion false prices an eager RMSNorm; normalization 'layernorm'"):
        fusion.check_norm_fusion(gpt)
    with pytest.raises(SpecError, match="Megatron-Core does not run"):
        fusion_args(dataclasses.replace(load_model("llama3-8b"), norm_fusion=False))


def test_a_plan_with_an_eager_norm_is_not_exported_to_torchtitan(tmp_path: object) -> None:
    import subprocess
    import sys

    import yaml

    from lynx.spec import read_spec_file

    model = dict(read_spec_file("models", "torchtitan-llama3-8b")[1])
    model.update(name="titan-eager-norm", norm_fusion=False)
    mfile = f"{tmp_path}/m.yaml"
    yaml.safe_dump(model, open(mfile, "w"))  # noqa: SIM115
    plan = f"{tmp_path}/p.json"
    run = [sys.executable, "-m", "lynx"]
    subprocess.run([*run, "plan", "-m", mfile, "-H", "h100-80g-nvlink", "--global-batch", "8", "--seq-len", "1024",
                    "--method", "full", "-o", plan], check=True, capture_output=True)
    r = subprocess.run([*run, "export", "torchtitan", plan, "-o", f"{tmp_path}/out"], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "lynx: error: torchtitan export: the plan prices an eager fp32 RMSNorm (norm_fusion false); torchtitan 0.3.0 "
        "on CUDA runs torch's fused RMSNorm: plan with norm_fusion true to export"]


def test_lynx_train_and_the_torchtitan_engine_refuse_a_plan_with_an_eager_norm(tmp_path: object,
                                                                               capsys: pytest.CaptureFixture[str]
                                                                               ) -> None:
    """Both run the fused norm's saved tensors: a plan priced with the eager norm's fp32 copies is refused with one
    line (lynx train: exit 2 before any rank starts), never run against the wrong bytes."""
    import yaml

    from lynx.spec import read_spec_file
    from tests.harness.cli import run_main

    for preset, family in (("llama-tiny", "llama"), ("torchtitan-llama3-debug", "torchtitan-llama3")):
        model = dict(read_spec_file("models", preset)[1])
        model.update(name=f"{family}-eager-norm", norm_fusion=False)
        mfile, plan = f"{tmp_path}/{family}.yaml", f"{tmp_path}/{family}.json"
        with open(mfile, "w") as fh:
            yaml.safe_dump(model, fh)
        code, _, err = run_main(["plan", "--model", mfile, "--hardware", "a100-40g-nvlink", "--tp", "1", "--pp", "1",
                                 "--micro-batch", "2", "--global-batch", "4", "--seq-len", "64", "--out", plan], capsys)
        assert code == 0, err
        if family == "llama":
            code, _, err = run_main(["train", "--plan", plan, "--iters", "1"], capsys)
            assert code == 2 and "norm_fusion=False" in err and len(err.strip().splitlines()) == 1, err
        else:
            pytest.importorskip("torchtitan")
            from lynx.integrations.torchtitan.apply import load_plan

            with pytest.raises(ValueError, match="prices an eager fp32 RMSNorm .norm_fusion false.; torchtitan"):
                load_plan(plan)


@pytest.mark.parametrize("target", ["megatron", "lynx", "torchtitan"])
def test_the_search_refuses_an_eager_norm_for_every_target(target: str) -> None:
    """No target runs the eager norm, so a search ranking for one would price what it cannot run."""
    from lynx.export.targets import Target, check_target

    m = dataclasses.replace(load_model("llama3-8b"), norm_fusion=False)
    with pytest.raises(SpecError, match=rf"^--target {target}: model 'llama3-8b' prices an eager fp32 RMSNorm"):
        check_target(m, Target(target))
    check_target(load_model("llama3-8b"), Target(target))  # the fused norm: searched
