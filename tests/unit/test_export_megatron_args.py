"""Reading a Megatron-LM command line back: the exported arguments reproduce the plan's problem and the
stock-Megatron price; unsupported flags are refused with one line, unknown ones listed."""

from __future__ import annotations

import re

import pytest

from lynx.api import plan as plan_with
from lynx.errors import SpecError
from lynx.export.layout import ChunkLayout
from lynx.export.megatron import build_megatron
from lynx.export.megatron_args import parse_megatron_args
from lynx.export.megatron_recompute import MegatronRecompute
from lynx.export.pricing import imported_problem, simulate_stock
from lynx.export.source import source_from
from lynx.models import total_params
from lynx.problem import PlanOptions
from tests.conftest import problem_for

BASE = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 1024 "
        "--micro-batch-size 8 --global-batch-size 128 --tensor-model-parallel-size 4 "
        "--pipeline-model-parallel-size 4 --bf16 --vocab-size 51200 --max-position-embeddings 2048")


@pytest.mark.parametrize("mb", [8, 16])
def test_exported_args_reproduce_the_stock_price(mb: int) -> None:
    p = plan_with(problem_for(mb=mb), "lynx", record=False)
    exp = build_megatron(source_from(p.problem, p.result))
    cmd = parse_megatron_args(exp.args_text())
    assert cmd.warnings == ()
    assert cmd.layout == exp.source.layout and cmd.recompute == exp.stock
    assert cmd.parallel(1) == p.problem.parallel
    m, mine = cmd.model, p.problem.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.vocab_size,
            m.max_position_embeddings, m.dropout) == (mine.num_layers, mine.hidden_size, mine.ffn_hidden_size,
                                                      mine.num_attention_heads, mine.vocab_size,
                                                      mine.max_position_embeddings, mine.dropout)
    prob = imported_problem(m, cmd.parallel(1), cmd.layout, "a100-40g-nvlink", PlanOptions())
    again = simulate_stock(prob, cmd.layout, cmd.recompute)
    stock = exp.figures[2]
    assert again.iteration_time_s == pytest.approx(stock.iteration_time_s, rel=1e-12)
    assert [s.peak_bytes for s in again.stages] == pytest.approx([s.peak_bytes for s in stock.stages], rel=1e-12)


def test_forms_defaults_and_ignored_flags() -> None:
    cmd = parse_megatron_args(f"torchrun --nproc-per-node 16 pretrain_gpt.py {BASE} --lr=1e-4 --data-path /d "
                              "--recompute-activations --decoder-first-pipeline-num-layers=7 "
                              "--decoder-last-pipeline-num-layers 9")
    assert cmd.layout == ChunkLayout(4, 1, (7, 8, 8, 9))
    assert cmd.recompute == MegatronRecompute("selective", modules=("core_attn",))
    assert any(w.startswith("read, no effect on time or memory: --lr --data-path") for w in cmd.warnings)
    assert any("--ffn-hidden-size 16384" in w for w in cmd.warnings)
    cmd = parse_megatron_args(BASE.split() + ["--recompute-granularity", "full", "--recompute-method", "block",
                                              "--recompute-num-layers", "2",
                                              "--num-virtual-stages-per-pipeline-rank", "2"])
    assert cmd.layout == ChunkLayout(4, 2, (4,) * 8)
    assert cmd.recompute == MegatronRecompute("full", "block", 2)
    sel = parse_megatron_args(BASE + " --recompute-granularity selective --recompute-modules mlp layernorm")
    assert sel.recompute.modules == ("mlp", "layernorm")


def test_flags_not_priced_are_named_under_what_they_change() -> None:
    """Every flag read and not priced is in one of three warnings: no effect, changes time or memory (with what
    lynx prices instead), unknown. --virtual-pipeline-model-parallel-size is read as the chunks per rank."""
    cmd = parse_megatron_args(BASE + " --virtual-pipeline-model-parallel-size 2 --defer-embedding-wgrad-compute "
                              "--manual-gc --apply-layernorm-1p --train-iters 10 --frobnicate 3")
    assert cmd.layout == ChunkLayout(4, 2, (4,) * 8)
    heads = ("NOT priced", "unknown to lynx", "read, no effect")
    found = [[w for w in cmd.warnings if w.startswith(h)] for h in heads]
    assert [len(f) for f in found] == [1, 1, 1], cmd.warnings
    unpriced, unknown, quiet = (f[0] for f in found)
    assert unpriced.startswith("NOT priced") and "--defer-embedding-wgrad-compute (the last stage's" in unpriced
    assert unknown.startswith("unknown to lynx") and unknown.endswith("--frobnicate")
    assert quiet == "read, no effect on time or memory: --manual-gc --apply-layernorm-1p --train-iters"
    with pytest.raises(SpecError, match="conflicts with --pipeline-model-parallel-layout's 1 stages"):
        parse_megatron_args(BASE + " --virtual-pipeline-model-parallel-size 2 "
                            "--pipeline-model-parallel-layout Et*8|t*8|t*8|t*8L")


@pytest.mark.parametrize("extra, what", [
    ("--swiglu --squared-relu", "one activation"), ("--context-parallel-size 2 --cp-comm-type ring", "--cp-comm-type"),
    ("--context-parallel-size 4 --cp-comm-type a2a+p2p", "hierarchical-context-parallel-sizes"),
    ("--num-experts 2 --moe-router-topk 4", "moe_router_topk"), ("--recompute-granularity full", "recompute-method"),
    ("--recompute-granularity selective --recompute-modules moe_layer", "recompute-modules"),
    ("--recompute-granularity everything", "full or selective"), ("--sequence-parallel yes", "no value"),
    ("--pipeline-model-parallel-layout Et*9|t*8|t*8|t*8L", "decoder layers"),
    ("--decoder-first-pipeline-num-layers 9 --decoder-last-pipeline-num-layers 8", "evenly"),
    ("--micro-batch-size eight", "integer"),
    ("--num-experts 4 --moe-router-dtype bf16", "fp32 or fp64"),
])
def test_bad_command_lines_fail_with_one_clear_line(extra: str, what: str) -> None:
    with pytest.raises(SpecError, match=what):
        parse_megatron_args(BASE + " " + extra)


def test_flags_that_change_the_model_or_its_memory_are_read() -> None:
    """Megatron-LM's older --use-rotary-position-embeddings is rope; --moe-router-dtype fp32 is what lynx prices
    (nothing said), fp64 is said; --empty-unused-memory-level is named under what it changes."""
    assert parse_megatron_args(BASE).model.position_embedding == "learned"
    assert parse_megatron_args(BASE + " --use-rotary-position-embeddings").model.position_embedding == "rope"
    moe = BASE + " --num-experts 4 --moe-router-topk 2"
    assert not any("moe-router-dtype" in w for w in parse_megatron_args(moe + " --moe-router-dtype fp32").warnings)
    w = parse_megatron_args(moe + " --moe-router-dtype fp64").warnings
    assert any(x.startswith("--moe-router-dtype fp64: lynx prices the router's top-k scores in fp32") for x in w), w
    w = parse_megatron_args(BASE + " --empty-unused-memory-level 1").warnings
    assert any(x.startswith("NOT priced") and "--empty-unused-memory-level (the allocator's" in x for x in w), w


def test_missing_sizes_are_named() -> None:
    with pytest.raises(SpecError, match="--hidden-size"):
        parse_megatron_args("--num-layers 32 --num-attention-heads 32 --seq-length 1024 --micro-batch-size 1 "
                            "--global-batch-size 8")
    with pytest.raises(SpecError, match="split"):
        parse_megatron_args("--num-layers 32 --num-attention-heads 32 --seq-length 1024 --micro-batch-size 1 "
                            "--hidden-size 1024 --global-batch-size 8 --pipeline-model-parallel-size 3 --bf16")


def test_llama_fields_become_megatron_flags() -> None:
    """The LLaMA fields of ModelSpec, read by getattr (a stand-in object here)."""
    from types import SimpleNamespace

    from lynx.export.megatron_model import model_flags

    llama = SimpleNamespace(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                            max_position_embeddings=8192, vocab_size=128256, dropout=False, family="llama",
                            activation="swiglu", normalization="rmsnorm", position_embedding="rope",
                            tie_embeddings=False, num_query_groups=8, attention="flash", rotary_base=500000.0,
                            bias="none", kv_channels=0, qk_layernorm=False, multi_latent_attention=False,
                            is_moe=False)
    flags = {f[0]: f[1:] for f in model_flags(llama, 8192)}  # type: ignore[arg-type]
    for f in ("--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--group-query-attention"):
        assert flags[f] == ()
    assert flags["--normalization"] == ("RMSNorm",) and flags["--position-embedding-type"] == ("rope",)
    assert flags["--rotary-base"] == ("500000",)
    assert flags["--num-query-groups"] == ("8",) and flags["--attention-backend"] == ("flash",)
    assert flags["--attention-dropout"] == ("0",) and flags["--hidden-dropout"] == ("0",)
    args = " ".join(" ".join(f) for f in model_flags(llama, 8192))  # type: ignore[arg-type]
    cmd = (f"{args} --micro-batch-size 1 --global-batch-size 64 --tensor-model-parallel-size 8 "
           "--pipeline-model-parallel-size 4 --bf16")
    import dataclasses

    from lynx.spec import ModelSpec

    if "family" not in {f.name for f in dataclasses.fields(ModelSpec)}:
        with pytest.raises(SpecError, match="LLaMA family"):
            parse_megatron_args(cmd)
        return
    m = parse_megatron_args(cmd).model  # the same model back
    assert (m.family, m.num_query_groups, m.activation, m.normalization, m.position_embedding, m.tie_embeddings,
            m.attention, m.dropout, m.rotary_base) == ("llama", 8, "swiglu", "rmsnorm", "rope", False, "flash", False,
                                                       500000.0)


@pytest.mark.parametrize("method", ["none", "full", "uniform", "block", "lynx-heu"])
def test_every_baseline_plan_round_trips(method: str) -> None:
    p = plan_with(problem_for(mb=16), method, record=False)
    exp = build_megatron(source_from(p.problem, p.result))
    cmd = parse_megatron_args(exp.args_text())
    prob = imported_problem(cmd.model, cmd.parallel(1), cmd.layout, "a100-40g-nvlink", PlanOptions())
    again = simulate_stock(prob, cmd.layout, cmd.recompute)
    assert again.iteration_time_s == pytest.approx(exp.figures[2].iteration_time_s, rel=1e-12)


def test_interleaved_plan_round_trips() -> None:
    p = plan_with(problem_for(mb=16, vpp=2), "lynx", record=False)
    exp = build_megatron(source_from(p.problem, p.result))
    assert exp.source.layout.vpp == 2 and len(exp.figures) == 4  # + stock Megatron on its even split
    cmd = parse_megatron_args(exp.args_text())
    assert cmd.layout == exp.source.layout
    prob = imported_problem(cmd.model, cmd.parallel(1), cmd.layout, "a100-40g-nvlink", PlanOptions())
    again = simulate_stock(prob, cmd.layout, cmd.recompute)
    assert again.iteration_time_s == pytest.approx(exp.figures[2].iteration_time_s, rel=1e-12)
    assert [s.peak_bytes for s in again.stages] == pytest.approx([s.peak_bytes for s in exp.figures[2].stages])


def test_each_switch_is_read_on_its_own() -> None:
    """Megatron-Core's switches are independent: a combination that is neither GPT nor LLaMA (Nemotron-4:
    GQA, squared ReLU, LayerNorm, RoPE, no biases) plans as family mcore; Qwen2's QKV bias is read."""
    nemo = parse_megatron_args(
        "--num-layers 32 --hidden-size 6144 --num-attention-heads 48 --group-query-attention --num-query-groups 8 "
        "--ffn-hidden-size 24576 --squared-relu --position-embedding-type rope --disable-bias-linear "
        "--untie-embeddings-and-output-weights --seq-length 4096 --max-position-embeddings 4096 --vocab-size 256000 "
        "--micro-batch-size 1 --global-batch-size 8 --bf16").model
    assert (nemo.family, nemo.activation, nemo.normalization, nemo.position_embedding, nemo.bias,
            nemo.num_query_groups, nemo.tie_embeddings) == ("mcore", "squared-relu", "layernorm", "rope", "none", 8,
                                                            False)
    from lynx.models import load_model

    assert total_params(nemo) == total_params(load_model("nemotron4-15b"))
    qwen = parse_megatron_args(f"{BASE} --swiglu --normalization RMSNorm --position-embedding-type rope "
                               "--disable-bias-linear --add-qkv-bias").model
    assert (qwen.family, qwen.bias) == ("mcore", "qkv")
    gpt = parse_megatron_args(BASE).model
    assert (gpt.family, gpt.bias) == ("gpt", "all")


def test_megatrons_own_pipeline_balancing_flags_are_read() -> None:
    """--account-for-embedding/loss-in-pipeline-split count the embedding and the loss as a layer each (the end
    stages run one decoder layer fewer); the total must split evenly, as Megatron-Core asserts."""
    base = BASE.replace("--pipeline-model-parallel-size 4", "--pipeline-model-parallel-size 4 --num-layers 30")
    base = base.replace("--num-layers 32 ", "")
    cmd = parse_megatron_args(base + " --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split")
    assert cmd.layout.layers == (7, 8, 8, 7)
    with pytest.raises(SpecError, match="split evenly"):
        parse_megatron_args(base + " --account-for-embedding-in-pipeline-split")


def test_the_balancing_flags_with_virtual_stages_are_megatrons_layouts() -> None:
    """With interleaving the accounted total splits evenly over the ranks and each rank's share over its chunks;
    the first rank's first virtual stage and the last rank's last one build a layer fewer
    (megatron/core/transformer/transformer_block.py, get_num_layers_to_build). NVIDIA's Llama-3.1-405B recipe
    (126 layers, PP 8, VPP 8, both flags) and the Megatron-MoE Qwen3-235B split (94 layers, PP 8, VPP 4) read as
    their published layouts; --num-layers-per-virtual-pipeline-stage counts the accounted layers, as Megatron-LM's
    arguments.py does."""
    both = " --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split"
    base = BASE.replace("--num-layers 32 ", "").replace("--pipeline-model-parallel-size 4",
                                                        "--pipeline-model-parallel-size 8")
    for vpp_flag in ("--num-virtual-stages-per-pipeline-rank 8", "--virtual-pipeline-model-parallel-size 8",
                     "--num-layers-per-virtual-pipeline-stage 2"):
        cmd = parse_megatron_args(f"{base} --num-layers 126 {vpp_flag}{both}")
        assert (cmd.layout.pp, cmd.layout.vpp, cmd.layout.layers) == (8, 8, (1, *[2] * 62, 1))
    qwen = parse_megatron_args(f"{base} --num-layers 94 --num-virtual-stages-per-pipeline-rank 4{both}").layout
    assert qwen.layers == (2, *[3] * 30, 2)
    loss_only = parse_megatron_args(f"{base} --num-layers 63 --num-virtual-stages-per-pipeline-rank 2 "
                                    "--account-for-loss-in-pipeline-split").layout
    assert loss_only.layers == (*[4] * 15, 3)
    with pytest.raises(SpecError, match=r"^--account-for-embedding/loss-in-pipeline-split: 126 layers \+ 2 "
                                        r"\(embedding / loss\) must split evenly over PP 8 and 3 virtual stages"):
        parse_megatron_args(f"{base} --num-layers 126 --num-virtual-stages-per-pipeline-rank 3{both}")
    with pytest.raises(SpecError, match=r"^--num-layers-per-virtual-pipeline-stage 5: 126 layers \+ 2 .* not a "
                                        r"multiple of 8 x 5"):
        parse_megatron_args(f"{base} --num-layers 126 --num-layers-per-virtual-pipeline-stage 5{both}")


def test_uneven_ends_with_virtual_stages_are_read_as_megatron_builds_them() -> None:
    """--decoder-first/last-pipeline-num-layers with --num-virtual-stages-per-pipeline-rank: every stage's layers
    over its chunks; Megatron-LM refuses them with --num-layers-per-virtual-pipeline-stage, and either family of
    knobs with the other."""
    base = BASE.replace("--num-layers 32 ", "--num-layers 28 ")
    cmd = parse_megatron_args(f"{base} --decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 6 "
                              "--num-virtual-stages-per-pipeline-rank 2")
    assert (cmd.layout.vpp, cmd.layout.layers) == (2, (3, 4, 4, 3, 3, 4, 4, 3))
    with pytest.raises(SpecError, match="^--num-layers-per-virtual-pipeline-stage with --decoder-first/last"):
        parse_megatron_args(f"{base} --decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 6 "
                            "--num-layers-per-virtual-pipeline-stage 2")
    with pytest.raises(SpecError, match="every stage's layers must divide evenly over its chunks"):
        parse_megatron_args(f"{base} --decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 7 "
                            "--num-virtual-stages-per-pipeline-rank 2")
    with pytest.raises(SpecError, match="Megatron-Core takes one or the other"):
        parse_megatron_args(f"{base} --decoder-first-pipeline-num-layers 6 --account-for-loss-in-pipeline-split")


@pytest.mark.parametrize(("extra", "error"), [
    ("--pipeline-model-parallel-layout Et*7|t*8|t*8|t*8L --account-for-embedding-in-pipeline-split",
     "--pipeline-model-parallel-layout with --account-for-embedding-in-pipeline-split: Megatron-Core takes the "
     "layout alone"),
    ("--pipeline-model-parallel-layout Et*8|t*8|t*8|t*8L --decoder-first-pipeline-num-layers 8",
     "--pipeline-model-parallel-layout with --decoder-first-pipeline-num-layers: Megatron-Core takes the layout "
     "alone"),
    ("--num-virtual-stages-per-pipeline-rank 2 --num-layers-per-virtual-pipeline-stage 4",
     "--num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage: Megatron-LM takes one of "
     "them"),
    ("--virtual-pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 4",
     "--virtual-pipeline-model-parallel-size and --num-layers-per-virtual-pipeline-stage: give the model chunks "
     "per rank in one place"),
    ("--num-layers-per-virtual-pipeline-stage -2", "--num-layers-per-virtual-pipeline-stage -2: must be positive"),
])
def test_layout_flags_megatron_refuses_together_are_refused_not_dropped(extra: str, error: str) -> None:
    """Megatron-LM refuses these combinations (training/arguments.py, TransformerConfig); lynx read one and dropped
    the other, pricing a split the run would not start with."""
    with pytest.raises(SpecError, match="^" + re.escape(error if error.startswith("--num-layers") else
                                                         f"--from-megatron: {error}") + "$"):
        parse_megatron_args(f"{BASE} {extra}")


# -- the launcher's world: torchrun's --nnodes x --nproc-per-node sets Megatron's DP ---------------------------------

def _world(line: str, dp: int | None = None, nodes: int | None = None) -> tuple[int, int | None, list[str]]:
    from lynx.cli.export import megatron_world
    from lynx.spec import load_hardware

    return megatron_world(parse_megatron_args(line), dp, nodes, load_hardware("h100-80g-nvlink"))


@pytest.mark.parametrize("launch", ["torchrun --nproc-per-node 8 --nnodes 2 pretrain_gpt.py",
                                    "python -m torch.distributed.run --nproc_per_node=8 --nnodes=2 --node_rank 0 "
                                    "--master_addr h0 --master_port 6000 /opt/Megatron-LM/pretrain_gpt.py",
                                    "torchrun --nnodes 2 --nproc-per-node gpu pretrain_gpt.py"])
def test_torchruns_world_gives_megatrons_dp(launch: str) -> None:
    cmd = parse_megatron_args(f"{launch} {BASE}")
    assert not any("--nnodes" in w or "--nproc" in w for w in cmd.warnings)  # read, not "unknown"
    assert _world(f"{launch} {BASE}") == (1, 2, [])  # 16 devices / (TP 4 x PP 4)
    assert _world(f"{launch} {BASE}", dp=1) == (1, 2, []) == _world(f"{launch} {BASE}", nodes=2)


def test_a_world_that_disagrees_with_torchrun_is_an_error_naming_both() -> None:
    line = f"torchrun --nproc-per-node 8 --nnodes 8 pretrain_gpt.py {BASE}"
    assert _world(line)[:2] == (4, 8)
    with pytest.raises(SpecError, match=r"^--nodes 4 conflicts with --from-megatron's torchrun --nnodes 8"):
        _world(line, nodes=4)
    with pytest.raises(SpecError, match=r"^--dp 2 conflicts with --from-megatron's torchrun world \(8 x 8 = 64 "
                                        r"devices: DP 4\)"):
        _world(line, dp=2)
    with pytest.raises(SpecError, match="torchrun --nproc-per-node 4 on h100-80g-nvlink .8 devices a node."):
        _world(line.replace("--nproc-per-node 8", "--nproc-per-node 4"))
    with pytest.raises(SpecError, match=r"1 x 8 = 8 devices are not a multiple of TP x CP 4 x PP 4"):
        _world(line.replace("--nnodes 8", "--nnodes 1"))


def test_an_elastic_or_missing_world_is_said() -> None:
    elastic = f"torchrun --nproc-per-node 8 --nnodes 1:8 pretrain_gpt.py {BASE}"
    with pytest.raises(SpecError, match=r"torchrun --nnodes 1:8 is elastic; give lynx --nodes or --dp"):
        _world(elastic)
    assert _world(elastic, nodes=4) == (2, 4, [])
    dp, nodes, warn = _world(BASE)  # no launcher, no --dp or --nodes: DP 1, and the warning says why
    assert (dp, nodes) == (1, None) and warn[0].startswith("DP 1: Megatron takes DP from the launcher's world")
    assert _world(BASE, dp=3) == (3, None, [])
    for bad, said in (("--nnodes two", "expected integers"), ("--nnodes nan", "expected integers"),
                      ("--nnodes inf", "expected integers"), ("--nnodes -1", "must be positive"),
                      ("--nnodes 0", "must be positive"), ("--nproc-per-node=-8", "must be positive"),
                      ("--nnodes --standalone", "torchrun --nnodes has no value")):
        with pytest.raises(SpecError, match=said):
            _world(f"torchrun {bad} pretrain_gpt.py {BASE}")


def test_nvidias_own_example_command_lines_leave_no_flag_unknown() -> None:
    """The flags of Megatron-LM's examples (d98e8a64: examples/llama/train_llama3_8b_h100_fp8.sh, FP8 variant, and
    examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh / sbatch_mfsdp_deepseek_v3.sh's Megatron-FSDP and
    logging flags, on a small shape): each is read, priced or named with what it changes; none is unknown."""
    shape = ("--num-layers 4 --hidden-size 256 --ffn-hidden-size 512 --num-attention-heads 8 --group-query-attention "
             "--num-query-groups 2 --kv-channels 32 --seq-length 512 --max-position-embeddings 512 "
             "--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --swiglu "
             "--normalization RMSNorm --norm-epsilon 1e-6 --untie-embeddings-and-output-weights --disable-bias-linear "
             "--micro-batch-size 1 --global-batch-size 8 --vocab-size 1024 --bf16 ")
    llama = ("--use-mcore-models --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p "
             "--train-samples 100 --lr-decay-samples 90 --lr-warmup-samples 5 --lr 0.00015 --min-lr 0.00001 "
             "--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0 "
             "--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --grad-reduce-in-bf16 --cross-entropy-loss-fusion "
             "--calculate-per-token-loss --manual-gc --exit-duration-in-mins 235 --fp8-format hybrid "
             "--fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather "
             "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --log-interval 1 "
             "--eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile "
             "--profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60")
    fsdp = ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --use-distributed-optimizer "
            "--no-gradient-accumulation-fusion --init-model-with-meta-device --ckpt-format fsdp_dtensor "
            "--use-nccl-ub --fsdp-double-buffer --fsdp-manual-registration --megatron-fsdp-grad-comm-dtype bf16 "
            "--megatron-fsdp-main-grads-dtype bf16 --logging-level 20 --record-memory-history --profile-ranks 0 "
            "--no-check-for-nan-in-loss-and-grad --manual-gc-interval 10 --auto-detect-ckpt-format "
            "--dist-ckpt-strictness log_all --log-num-zeros-in-grad --log-params-norm --enable-experimental")
    for extra in (llama, fsdp):
        cmd = parse_megatron_args(shape + extra)
        assert not any(w.startswith("unknown to lynx") for w in cmd.warnings), cmd.warnings
    cmd = parse_megatron_args(shape + fsdp)
    unpriced = next(w for w in cmd.warnings if w.startswith("NOT priced"))
    assert "--fsdp-double-buffer" in unpriced and "--record-memory-history" in unpriced


def test_gpt_oss_layer_flags_are_refused_and_the_rest_named() -> None:
    """Megatron-LM's GPT-OSS example (examples/gptoss/02_train.sh at d98e8a64): its attention (sliding windows,
    learnable softmax) and its quick-GeGLU MLP would be priced as another model's, so each is refused in one line;
    its other flags are read or named."""
    shape = ("--num-layers 4 --hidden-size 256 --ffn-hidden-size 512 --num-attention-heads 8 --seq-length 512 "
             "--max-position-embeddings 512 --micro-batch-size 1 --global-batch-size 8 --vocab-size 1024 --bf16 ")
    for flag in ("--window-size 127,0", "--window-attn-skip-freq 2", "--quick-geglu", "--softmax-type learnable",
                 "--enable-gpt-oss"):
        with pytest.raises(SpecError, match=f"^--from-megatron: {flag.split()[0]} .* is not modelled by lynx$"):
            parse_megatron_args(shape + flag)
    rest = ("--rope-type rope --export-force-local-attention --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 "
            "--tiktoken-pattern v2 --accumulate-allreduce-grads-in-fp32 --disable-bf16-reduced-precision-matmul")
    cmd = parse_megatron_args(shape + rest)
    assert not any(w.startswith("unknown to lynx") for w in cmd.warnings), cmd.warnings
