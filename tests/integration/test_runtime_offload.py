"""Offloading in the recompute engine (issue 22 item 6), on the CPU: a policy's per-layer `offload` set copies
what those ops save to a host buffer after their forward and back before their backward (the same code path
as on CUDA, with synchronous copies). Gradients are bitwise equal to a run that keeps everything (float32),
with offloading alone and mixed with recomputation in every place; the ledger loses exactly the offloaded
bytes after forward and gets each entry's bytes back when its reload starts (one layer ahead, a prefetch).
GPU: the asynchronous path on side streams, bitwise as well (skipped without CUDA)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lynx.decisions import LayerPolicy, RecomputePolicy  # noqa: E402
from lynx.runtime.engine import RecomputeEngine  # noqa: E402
from lynx.runtime.layers.gpt import LayerConfig  # noqa: E402
from lynx.runtime.layers.gpt_model import GPTModel, synthetic_batch  # noqa: E402
from tests.harness.check import grads_of, train_step  # noqa: E402
from tests.harness.pipeline_check import overlapped_policy  # noqa: E402

LAYERS, VOCAB, MBS = 3, 64, 3
CFG = LayerConfig(hidden_size=32, num_attention_heads=4, ffn_hidden_size=128, seq_length=16, micro_batch_size=2,
                  dropout_p=0.1)


def with_offload(lp: LayerPolicy, offload: frozenset[str]) -> LayerPolicy:
    """`lp` with `offload` as its offloaded set (LayerPolicy's own field once the planner has it; until then
    a subclass carrying it, which the engine reads the same way)."""
    if "offload" in {f.name for f in dataclasses.fields(LayerPolicy)}:
        return dataclasses.replace(lp, keep=lp.keep - offload, offload=offload)  # type: ignore[call-arg]
    return _Offloading(keep=lp.keep - offload, recompute=lp.recompute, input_checkpoint=lp.input_checkpoint,
                       rerun=lp.rerun, offload=offload)


@dataclasses.dataclass(frozen=True)
class _Offloading(LayerPolicy):
    offload: frozenset[str] = frozenset()


def _keep_all(model: GPTModel) -> LayerPolicy:
    return LayerPolicy(keep=frozenset(model.layers[0].op_names))


def _run(policy: RecomputePolicy | None, in_flight: int, device: Any = None) -> tuple[GPTModel, Any]:
    torch.manual_seed(0)
    model = GPTModel(CFG, LAYERS, VOCAB, device=device)
    eng = RecomputeEngine(model.layers, policy) if policy is not None else None
    train_step(model, MBS, eng, in_flight)
    return model, eng


def _policies(model: GPTModel) -> dict[str, RecomputePolicy]:
    keep_all = _keep_all(model)
    heavy = frozenset({"qkv", "fc1", "gelu", "attn_dropout", "softmax"})
    mixed = overlapped_policy(LAYERS)  # phases 1-5 and the cool-down; qkv and attn_context offloaded instead
    return {
        "offload-heavy": RecomputePolicy("o", (with_offload(keep_all, heavy),) * LAYERS),
        "offload-all-but-output": RecomputePolicy(
            "o", (with_offload(keep_all, keep_all.keep - {model.layers[0].op_names[-1]}),) * LAYERS),
        "offload+recompute": RecomputePolicy(
            "o", tuple(with_offload(lp, frozenset({"qkv", "attn_context"})) for lp in mixed.layers),
            cooldown_overlap=False),
    }


@pytest.mark.parametrize("in_flight", [1, 2])
def test_offloading_is_bitwise_equal_to_keeping(in_flight: int) -> None:
    ref, _ = _run(None, in_flight)
    want = grads_of(ref)
    for name, pol in _policies(ref).items():
        model, eng = _run(pol, in_flight)
        got = grads_of(model)
        bad = [n for n in want if not torch.equal(want[n], got[n])]
        assert not bad, (name, bad)
        st = eng.stats
        assert st.offloaded_bytes > 0 and st.reloaded_bytes == st.offloaded_bytes, (name, st)
        assert st.host_bytes == 0 and st.host_peak_bytes > 0, (name, st)
        assert st.reloads_prefetched > 0, (name, st)


def test_offloaded_bytes_leave_the_ledger_and_return_at_reload() -> None:
    base, _ = _run(None, 1)
    keep_all = _keep_all(base)
    heavy = frozenset({"qkv", "fc1", "gelu"})
    kept, _ = _run(RecomputePolicy("k", (keep_all,) * LAYERS), 1)
    torch.manual_seed(0)
    model = GPTModel(CFG, LAYERS, VOCAB)
    eng = RecomputeEngine(model.layers, RecomputePolicy("o", (with_offload(keep_all, heavy),) * LAYERS))
    reloads: list[tuple[int, int, int]] = []
    start = eng.offloader.start_reload

    def spy(rec: Any, entry: Any) -> None:
        before = eng.held_bytes()
        start(rec, entry)
        reloads.append((before, eng.held_bytes(), entry.nbytes))

    eng.offloader.start_reload = spy  # type: ignore[method-assign]
    # one forward of micro-batch 0: what the keep-all engine holds, less exactly what went to the host
    tok, lab = synthetic_batch(VOCAB, CFG.micro_batch_size, CFG.seq_length, 0, 0)
    loss = model(tok, lab, 0, eng)
    keep_eng = RecomputeEngine(kept.layers, RecomputePolicy("k", (keep_all,) * LAYERS))
    kept.zero_grad()
    kept_loss = kept(tok, lab, 0, keep_eng)
    held_keep = keep_eng.held_bytes()
    assert eng.held_bytes() == held_keep - eng.stats.offloaded_bytes
    assert eng.held_bytes() == eng.held_bytes_scan()
    assert eng.stats.host_bytes == eng.stats.offloaded_bytes > 0
    loss.backward()
    kept_loss.backward()
    # every entry came back once, each adding exactly its bytes to the ledger when its copy started
    assert reloads and sum(n for _, _, n in reloads) == eng.stats.offloaded_bytes
    assert all(after - before == n for before, after, n in reloads), reloads
    assert eng.stats.host_bytes == 0
    assert eng.stats.peak_bytes < keep_eng.stats.peak_bytes
    eng.end_step()
    keep_eng.end_step()
    assert eng.held_bytes() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_offloading_is_bitwise_equal_to_keeping() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    ref, _ = _run(None, 2, dev)
    want = grads_of(ref)
    for name, pol in _policies(ref).items():
        model, eng = _run(pol, 2, dev)
        got = grads_of(model)
        assert not [n for n in want if not torch.equal(want[n], got[n])], name
        assert eng.stats.reloaded_bytes == eng.stats.offloaded_bytes > 0


def test_a_wrong_reload_breaks_equality(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test can fail: a reload that hands back slightly different values changes the gradients."""
    import lynx.runtime.engine.offloader as core

    ref, _ = _run(None, 1)
    orig = core.view_of

    def nudged(buf: Any, h: Any) -> Any:
        t = orig(buf, h)
        return t * (1 + 1e-6) if t.is_floating_point() else t

    monkeypatch.setattr(core, "view_of", nudged)
    model, eng = _run(_policies(ref)["offload-heavy"], 1)
    assert eng.stats.reloaded_bytes > 0
    assert any(not torch.equal(a, b) for a, b in zip(grads_of(ref).values(), grads_of(model).values(), strict=True))
