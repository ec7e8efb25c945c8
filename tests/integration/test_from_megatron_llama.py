"""A real Llama-3-70B Megatron-Core command line through `lynx plan --from-megatron` predicts what the equivalent
direct `lynx plan` predicts (within 1%, the issue's bar; here it is the same problem, so far closer), and every
flag that changes time or memory is read: precision, distributed optimizer, flash attention through
TransformerEngine, the overlaps, the rotary base, world size from --nodes; a missing --vocab-size is named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lynx

# As Megatron-LM's Llama-3 70B recipes run it on 8 DGX H100 nodes (flags as megatron/training/arguments.py
# spells them; data, tokenizer, optimizer and logging flags included, which lynx ignores).
LLAMA3_70B = (
    "torchrun --nproc-per-node 8 --nnodes 8 pretrain_gpt.py --use-mcore-models --transformer-impl "
    "transformer_engine --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
    "--group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 "
    "--position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu --disable-bias-linear "
    "--untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --sequence-parallel --micro-batch-size 1 "
    "--global-batch-size 128 --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
    "--tp-comm-overlap --use-flash-attn --tokenizer-type HuggingFaceTokenizer "
    "--tokenizer-model meta-llama/Meta-Llama-3-70B --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine "
    "--weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --data-path /data/llama3_text_document "
    "--split 99,1,0 --log-interval 1 --save /ckpt --load /ckpt"
)
DIRECT = ("plan", "--model", "llama3-70b", "--hardware", "h100-80g-nvlink", "--tp", "8", "--pp", "4", "--dp", "2",
          "--sp", "--micro-batch", "1", "--global-batch", "128", "--seq-len", "8192", "--nodes", "8",
          "--precision", "megatron-bf16", "--distributed-optimizer", "--overlap-grad-reduce",
          "--overlap-param-gather", "--tp-comm-overlap", "--method", "none", "--layers-per-stage", "20,20,20,20",
          "--json")


def lynx_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"COLUMNS": "200", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(lynx.__file__).parents[1]),
           "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run([sys.executable, "-m", "lynx", *args], capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.fixture(scope="module")
def direct() -> dict:
    r = lynx_cli(*DIRECT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_llama3_70b_command_line_predicts_what_lynx_plan_predicts(direct: dict) -> None:
    r = lynx_cli("plan", "--from-megatron", LLAMA3_70B + " --vocab-size 128256", "--hardware", "h100-80g-nvlink",
                 "--nodes", "8", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    mine = got["megatron"]
    want = direct["prediction"]
    assert mine["iteration_time_s"] == pytest.approx(want["iteration_time_s"], rel=0.01)
    assert [s["peak_memory_bytes"] for s in mine["stages"]] == pytest.approx(
        [s["peak_memory_bytes"] for s in want["stages"]], rel=0.01)
    # nothing that changes time or memory was ignored
    ignored = " ".join(got["warnings"])
    for flag in ("--use-distributed-optimizer", "--use-flash-attn", "--transformer-impl", "--overlap-grad-reduce",
                 "--overlap-param-gather", "--tp-comm-overlap", "--rotary-base", "--bf16"):
        assert flag not in ignored


def test_without_vocab_size_the_warning_names_it() -> None:
    r = lynx_cli("plan", "--from-megatron", LLAMA3_70B, "--hardware", "h100-80g-nvlink", "--nodes", "8", "--json")
    assert r.returncode == 0, r.stderr
    assert any("--vocab-size not given" in w and "ASSUMED 51200" in w for w in json.loads(r.stdout)["warnings"])


def test_the_overlaps_and_precision_change_the_prediction(direct: dict) -> None:
    plain = LLAMA3_70B.replace("--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap ", "")
    plain = plain.replace("--use-distributed-optimizer ", "") + " --vocab-size 128256"
    r = lynx_cli("plan", "--from-megatron", plain, "--hardware", "h100-80g-nvlink", "--nodes", "8", "--json")
    assert r.returncode == 0, r.stderr
    mine = json.loads(r.stdout)["megatron"]
    assert mine["iteration_time_s"] > 1.02 * direct["prediction"]["iteration_time_s"]
    assert mine["stages"][0]["peak_memory_bytes"] > direct["prediction"]["stages"][0]["peak_memory_bytes"]


def test_the_fusion_flags_predict_what_lynx_plan_predicts_with_them(direct: dict) -> None:
    """Recipes without TransformerEngine's fused kernels pass Megatron's --no-*-fusion flags; the command line and
    `lynx plan` with the same flags agree, and both are slower than the fused run (eager memory-bound ops)."""
    flags = ("--no-bias-swiglu-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion")
    r = lynx_cli("plan", "--from-megatron", LLAMA3_70B + " --vocab-size 128256 " + " ".join(flags), "--hardware",
                 "h100-80g-nvlink", "--nodes", "8", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert not any(f in w for w in got["warnings"] for f in flags)
    d = lynx_cli(*DIRECT, *flags)
    assert d.returncode == 0, d.stderr
    want = json.loads(d.stdout)["prediction"]
    mine = got["megatron"]
    assert mine["iteration_time_s"] == pytest.approx(want["iteration_time_s"], rel=0.01)
    assert [s["peak_memory_bytes"] for s in mine["stages"]] == pytest.approx(
        [s["peak_memory_bytes"] for s in want["stages"]], rel=0.01)
    assert want["iteration_time_s"] > 1.01 * direct["prediction"]["iteration_time_s"]
    assert want["stages"][0]["peak_memory_bytes"] > direct["prediction"]["stages"][0]["peak_memory_bytes"]
