"""Every flag Megatron-LM's parser has is accounted for by `--from-megatron` (issue 33: it no longer ignores a flag
that changes time or memory): read and priced, refused with one line, or named under what it does to the price --
never "unknown". The list (tests/data/megatron_lm_flags_d98e8a64.txt) was made by building Megatron-LM's parser at
d98e8a64 (with Python 3.11, `typing.override` stubbed):

    p = argparse.ArgumentParser(allow_abbrev=False); megatron.training.arguments.add_megatron_arguments(p)
    sorted({s for a in p._actions for s in a.option_strings if s.startswith("--")})
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from lynx.errors import SpecError
from lynx.export.megatron_args import flag_kind, parse_megatron_args

FLAGS = [line.strip() for line in (Path(__file__).parents[1] / "data" / "megatron_lm_flags_d98e8a64.txt")
         .read_text().splitlines() if line.startswith("--")]
BASE = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --micro-batch-size 1 "
        "--global-batch-size 8 --vocab-size 1024 ")


def test_every_megatron_flag_is_read_refused_or_named() -> None:
    kinds = {f: flag_kind(f) for f in FLAGS}
    assert len(FLAGS) > 800  # the whole parser, not a sample
    unknown = sorted(f for f, k in kinds.items() if k == "unknown")
    assert not unknown, unknown
    counts = Counter(kinds.values())
    assert counts["read"] > 100 and counts["refused"] > 20 and counts["not priced"] > 50
    # a flag lynx has never heard of is still said, not dropped
    assert flag_kind("--frobnicate") == "unknown"


def test_a_production_command_line_leaves_nothing_unknown() -> None:
    """Flags of recent NVIDIA recipes that lynx listed as unknown before: each now under its heading."""
    cmd = parse_megatron_args(BASE + "--bf16 --tp-comm-overlap-cfg ub.yaml --cuda-graph-scope full "
                              "--microbatch-group-size-per-virtual-pipeline-stage 2 --use-te-rng-tracker "
                              "--moe-shared-expert-overlap --fp32-residual-connection --deterministic-mode "
                              "--inference-max-requests 4 --check-for-large-grads --rampup-batch-size 32 32 1000 "
                              "--use-rope-scaling --optimizer adam --cpu-offloading-num-layers 00")
    heads = {w.split(":")[0] for w in cmd.warnings}
    assert not any(w.startswith("unknown to lynx") for w in cmd.warnings), cmd.warnings
    not_priced = next(w for w in cmd.warnings if w.startswith("NOT priced"))
    for flag in ("--tp-comm-overlap-cfg", "--cuda-graph-scope", "--microbatch-group-size-per-virtual-pipeline-stage",
                 "--moe-shared-expert-overlap", "--fp32-residual-connection", "--deterministic-mode"):
        assert flag in not_priced, (flag, not_priced)
    assert any(h.startswith("read by another of Megatron's workloads") for h in heads), heads
    assert any("--rampup-batch-size" in w and w.startswith("read, no effect") for w in cmd.warnings)


@pytest.mark.parametrize(("extra", "says"), [
    ("--cpu-offloading-num-layers 2", "turns on --cpu-offloading"),
    ("--cpu-offloading-num-layers", r"\(no value\): only 0 is priced"),
    ("--optimizer sgd", "lynx prices Adam's two moments"),
    ("--batch-size 4", r"Megatron-LM refuses it \(use --micro-batch-size\)"),
    ("--checkpoint-activations", "Megatron-LM refuses it"),
    ("--hybrid-layer-pattern M*M*", "hybrid Mamba and attention layers"),
    ("--experimental-attention-variant gdn", "gated DeltaNet"),
    ("--disable-fp8-wgrad", "weight gradients in BF16 under FP8"),
])
def test_what_lynx_cannot_price_as_given_is_refused_with_one_line(extra: str, says: str) -> None:
    with pytest.raises(SpecError, match=says) as e:
        parse_megatron_args(BASE + extra)
    assert "\n" not in str(e.value)
