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


def _attention_2024_block(dim: int, heads: int, kv: int, ffn: int, seq: int) -> torch.nn.Module:
    """A Llama block with torchtitan's 2024 attention (torchtitan 04133643 and 9dec370, models/llama/model.py),
    written here in plain torch: ``wq``, ``wk``, ``wv`` apart, complex fp32 RoPE on Q and K, K and V repeated
    to every query head by an unsqueeze-expand and a reshape, SDPA over the repeated heads. Norms are
    ``nn.RMSNorm`` (the eager composite on CPU, priced by ``norm_fusion: false``); the FFN is SwiGLU as now."""
    import torch.nn.functional as F  # noqa: N812
    from torch import nn

    hd = dim // heads

    def rotate(u: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, t = u.shape[:2]
        z = torch.view_as_complex(u.float().reshape(b, t, -1, hd // 2, 2))
        return torch.view_as_real(z * freqs.view(1, t, 1, hd // 2)).flatten(3).type_as(u)

    def repeat(u: torch.Tensor) -> torch.Tensor:
        if heads == kv:
            return u
        b, t = u.shape[:2]
        return u.unsqueeze(3).expand(b, t, kv, heads // kv, hd).reshape(b, t, heads, hd)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq = nn.Linear(dim, heads * hd, bias=False)
            self.wk = nn.Linear(dim, kv * hd, bias=False)
            self.wv = nn.Linear(dim, kv * hd, bias=False)
            self.wo = nn.Linear(heads * hd, dim, bias=False)

        def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q = rotate(self.wq(x).view(b, t, heads, hd), freqs)
            k = repeat(rotate(self.wk(x).view(b, t, kv, hd), freqs))
            v = repeat(self.wv(x).view(b, t, kv, hd))
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True)
            return self.wo(o.transpose(1, 2).contiguous().view(b, t, -1))

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Linear(dim, ffn, bias=False)
            self.w2 = nn.Linear(ffn, dim, bias=False)
            self.w3 = nn.Linear(dim, ffn, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
            self.attention, self.feed_forward = Attention(), FeedForward()
            inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
            angles = torch.outer(torch.arange(seq).float(), inv)
            self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles))  # complex64, as then

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x + self.attention(self.attention_norm(x), self.freqs)
            return h + self.feed_forward(self.ffn_norm(h))

    block = Block()
    for prm in block.parameters():  # bf16 compute, as FSDP2's mixed precision runs the block
        prm.data = prm.data.to(torch.bfloat16)
    return block


@pytest.mark.parametrize(("n_kv", "mb", "seq"), [(16, 1, 128), (4, 2, 64), (2, 1, 128)])
def test_kv_repeat_prices_the_traffic_and_saved_bytes_of_torchtitans_2024_attention(n_kv: int, mb: int,
                                                                                      seq: int) -> None:
    """The 2024 block forward and backward on CPU: its memory-bound kernels' bytes within 1% of the family's price
    with ``kv_repeat`` (the RoPE table's reads and the per-token ops are not priced) and exactly its kernel count;
    what it keeps for backward, by op, exactly: attention keeps the repeated K and V (or ``wv``'s output itself,
    with as many K/V heads as query heads)."""
    from lynx.cost.layer import build_layer_graph
    from lynx.integrations.torchtitan.measure import eager_traffic, saved_bytes_by_op
    from lynx.spec import load_hardware

    block = _attention_2024_block(256, 16, n_kv, 768, seq)
    x = torch.randn(mb, seq, 256, dtype=torch.bfloat16, requires_grad=True)
    (fb, fk), (bb, bk) = eager_traffic(lambda: block(x), torch.randn_like(x))
    model = dataclasses.replace(_titan(n_kv, norm_fusion=False), kv_repeat=True)  # type: ignore[type-var]
    par = ParallelSpec(micro_batch_size=mb, global_batch_size=mb, seq_length=seq)
    (pf, pfk), (pb, pbk) = _priced(titan.layer(model, par))
    assert (fk, bk) == (pfk, pbk)
    assert fb == pytest.approx(pf, rel=0.01) and fb >= pf
    assert bb == pytest.approx(pb, rel=0.01) and bb >= pb

    measured = saved_bytes_by_op(block, x)
    g = build_layer_graph(model, load_hardware("h100-80g-nvlink"), par)
    priced = {n: g.keep_bytes(n) for n in g.needed()}
    # the block's own ops are tagged by the aten op that made each kept storage: RoPE's casts back (Q, and K
    # when nothing is repeated), repeat_kv's copies (reshape's clone), wv's GEMM output, the attention's output
    grouped = {"attention:_to_copy": ("rope", "k_rope"), "attention:clone": ("k_repeat", "v_repeat"),
               "attention.wv:mm": ("wv",), "attention:_scaled_dot_product_flash_attention_for_cpu": ("core_attn",)}
    for tag, ops in grouped.items():
        priced[tag] = sum(priced.pop(o, 0.0) for o in ops)
    assert measured == pytest.approx({k: v for k, v in priced.items() if v}, abs=0.5)
    assert g.retained_bytes(g.needed()) == sum(measured.values()) + g.input_bytes


@pytest.mark.parametrize("family", ["llama", "mcore", "gpt"])
def test_kv_repeat_is_refused_by_the_families_that_do_not_run_it(family: str) -> None:
    from lynx.models import check_model

    base = load_model("gpt-1.3b" if family == "gpt" else "llama3-8b")
    check_model(dataclasses.replace(base, family=family))
    with pytest.raises(SpecError, match=rf"^model '{base.name}': kv_repeat true prices torchtitan's 2024 attention "
                                        rf".*; family {family} does not run it \(valid: kv_repeat false, or family "
                                        r"torchtitan-llama3\)$"):
        check_model(dataclasses.replace(base, family=family, kv_repeat=True))
    if family == "llama":  # the torchtitan family runs it
        check_model(dataclasses.replace(base, family="torchtitan-llama3", kv_repeat=True))


def test_kv_repeat_moves_the_8b_layer_as_its_copies_do() -> None:
    """Llama-3-8B at sequence 8192: the 2024 attention keeps Q, the repeated K and V (2 a d each per token) where
    0.3.0's keeps rotated Q and K and the V copy (2 (a + 2 g) d), and runs three GEMMs for the fused one."""
    par = ParallelSpec(micro_batch_size=1, global_batch_size=1, seq_length=8192)
    m = dataclasses.replace(load_model("llama3-8b"), family="torchtitan-llama3")
    now = {o.name: o for o in titan.layer(m, par).ops}
    old = {o.name: o for o in titan.layer(dataclasses.replace(m, kv_repeat=True), par).ops}
    tok, a, g, d = 8192, 32, 8, 128
    assert [old[n].gemm_mnk for n in ("wq", "wk", "wv")] == [(tok, 4096, a * d), (tok, 4096, g * d),
                                                               (tok, 4096, g * d)]
    assert now["qkv"].gemm_mnk == (tok, 4096, (a + 2 * g) * d) and "qkv" not in old and "v_copy" not in old
    assert old["core_attn"].saved == ("rope", "k_repeat", "v_repeat", "core_attn")
    assert old["k_repeat"].out_bytes == old["v_repeat"].out_bytes == 2 * tok * a * d
    assert old["k_repeat"].mem_bytes == 2 * 2 * tok * a * d and old["k_repeat"].kernels == 1
    assert old["core_attn"].mem_bytes - now["core_attn"].mem_bytes == 2 * 2 * tok * (a - g) * d
    assert old["rmsnorm2"] == now["rmsnorm2"] and old["swiglu"] == now["swiglu"]  # the FFN as before


def test_a_plan_with_the_2024_attention_is_refused_where_it_would_run(tmp_path: object,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing runs torchtitan's 2024 attention today: lynx export torchtitan and megatron, lynx's engine in
    torchtitan and lynx train each refuse a plan priced with it, in one line (the CLI with exit 2). The plan file
    writes the field only when it is set."""
    import yaml

    from lynx.spec import read_spec_file
    from tests.harness.cli import run_main

    model = dict(read_spec_file("models", "torchtitan-llama3-debug")[1])
    model.update(name="titan-2024", num_query_groups=4, kv_repeat=True)
    mfile, plan = f"{tmp_path}/m.yaml", f"{tmp_path}/p.json"
    with open(mfile, "w") as fh:
        yaml.safe_dump(model, fh)
    flags = ["--hardware", "a100-40g-nvlink", "--tp", "1", "--pp", "1", "--micro-batch", "2", "--global-batch", "4",
             "--seq-len", "64"]
    code, _, err = run_main(["plan", "--model", mfile, *flags, "--out", plan], capsys)
    assert code == 0, err
    with open(plan) as fh:
        assert '"kv_repeat": true' in fh.read()
    code, _, err = run_main(["plan", "--model", "torchtitan-llama3-debug", *flags, "--out", f"{tmp_path}/d.json"],
                            capsys)
    assert code == 0, err
    with open(f"{tmp_path}/d.json") as fh:
        assert "kv_repeat" not in fh.read()

    for argv, line in (
            (["export", "torchtitan", plan, "-o", f"{tmp_path}/tt"],
             "lynx: error: torchtitan export: the plan prices torchtitan's 2024 attention (kv_repeat true); "
             "torchtitan 0.3.0 runs a fused QKV and attention over the K/V heads: plan with kv_repeat false to export"),
            (["export", "megatron", plan, "-o", f"{tmp_path}/mg"],
             "lynx: error: model 'titan-2024': kv_repeat true prices torchtitan's 2024 attention (separate wq/wk/wv, "
             "K and V copied to every query head), which Megatron-Core does not run; plan with kv_repeat false to "
             "export"),
            (["train", "--plan", plan, "--iters", "1"],
             "lynx: error: family 'torchtitan-llama3' has no runtime layer: lynx train builds gpt, llama, mcore "
             "layers; plan and export this model (lynx plan, lynx export torchtitan), or train a gpt model")):
        code, _, err = run_main(argv, capsys)
        assert (code, err.strip().splitlines()) == (2, [line]), argv
    # a llama plan edited to carry the field: its model is refused as it loads, before any rank starts
    llama_plan = f"{tmp_path}/l.json"
    code, _, err = run_main(["plan", "--model", "llama-tiny", *flags, "--out", llama_plan], capsys)
    assert code == 0, err
    with open(llama_plan) as fh:
        text = fh.read()
    assert '"family": "llama"' in text
    with open(llama_plan, "w") as fh:
        fh.write(text.replace('"family": "llama"', '"family": "llama", "kv_repeat": true'))
    code, _, err = run_main(["train", "--plan", llama_plan, "--iters", "1"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "kv_repeat true" in err, err

    pytest.importorskip("torchtitan")
    from lynx.integrations.torchtitan.apply import load_plan

    with pytest.raises(ValueError, match=r"prices torchtitan's 2024 attention \(kv_repeat true\); torchtitan 0.3.0"):
        load_plan(plan)


def test_the_2024_attention_is_not_planned_from_a_profile(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    """A profile's graph is planned in place of the analytic one, and the profiler builds 0.3.0's block: a model
    with kv_repeat true and --profile is refused in one line before the profile is read, not planned as 0.3.0."""
    import yaml

    from lynx.spec import read_spec_file
    from tests.harness.cli import run_main

    model = dict(read_spec_file("models", "torchtitan-llama3-debug")[1])
    model.update(name="titan-2024", num_query_groups=4, kv_repeat=True)
    mfile = f"{tmp_path}/m.yaml"
    with open(mfile, "w") as fh:
        yaml.safe_dump(model, fh)
    code, _, err = run_main(["plan", "--model", mfile, "--hardware", "h100-80g-nvlink", "--global-batch", "8",
                             "--seq-len", "64", "--profile", "no-such-profile"], capsys)
    assert (code, err.strip().splitlines()) == (2, [
        "lynx: error: model 'titan-2024': kv_repeat true with --profile: the profiler measures torchtitan 0.3.0's "
        "block (a fused QKV), not the 2024 attention; plan kv_repeat without --profile"])


@pytest.mark.parametrize("target", ["megatron", "lynx", "torchtitan"])
def test_the_search_refuses_the_2024_attention_for_every_target(target: str) -> None:
    from lynx.export.targets import Target, check_target

    m = dataclasses.replace(load_model("llama3-8b"), family="torchtitan-llama3", kv_repeat=True)
    with pytest.raises(SpecError, match=rf"^--target {target}: model 'llama3-8b' prices torchtitan's 2024 attention"):
        check_target(m, Target(target))
    check_target(dataclasses.replace(m, kv_repeat=False), Target(target))
