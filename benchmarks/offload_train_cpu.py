"""`lynx train` of a plan that offloads against the same plan with its offloaded ops kept (CPU, gloo, float32).

    python benchmarks/offload_train_cpu.py [--iters 5] [--out DIR]

gpt-tiny, PP 2, micro-batch 2, sequence 32, 4 micro-batches; the `lynx-offload` plan under a budget 30% of the
way from `full`'s peak to `none`'s (tests/integration/test_runtime_offload_train.py `offload_plan`). Per stage:
offloaded bytes per micro-batch against the prediction (the planner's, `runtime.predict`), activation bytes
after the forwards and at the peak against the predictions, the losses. Iteration times are printed, not judged
(on the CPU a copy is a synchronous memcpy).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import _results
from _markdown import Out
from _targets import Targets
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="keep the plans and reports here")
    ap.add_argument("--markdown", action="store_true")
    _results.add_option(ap, "offload_train_cpu")
    a = ap.parse_args()
    run_results = _results.Run()
    if a.iters < 1:
        ap.error("--iters: must be at least 1")
    if a.out is not None and not a.out.is_dir():
        ap.error(f"--out {a.out}: not a directory")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from lynx.runtime.train import main as train
    from tests.integration.test_runtime_offload_train import offload_plan, without_offload

    d = a.out or Path(tempfile.mkdtemp(prefix="lynx-offload-"))
    plan = offload_plan(d / "plan.json", 1, 2)
    plain = without_offload(plan, d / "plain.json")
    r = {}
    for name, p in (("offload", plan), ("keep", plain)):
        train(["--plan", str(p), "--iters", str(a.iters), "--warmup", "1", "--out", str(d / f"{name}.json"),
               "--quiet", "--threads", "1"])
        r[name] = json.loads((d / f"{name}.json").read_text())
    targets = Targets()
    t = Table(title="lynx train, gpt-tiny PP 2, lynx-offload plan vs the same plan keeping (CPU, fp32)")
    for c in ("stage", "run", "offloaded/mb (meas / pred)", "after fwd (meas / pred)", "peak (meas / pred)",
              "host peak", "median s", "holds"):
        t.add_column(c, justify="right")
    for name, rep in r.items():
        for s, st in rep["stages"].items():
            ok = targets.row([
                (f"{name} stage {s} offloaded/mb equal", st["offloaded_bytes_per_microbatch"]
                 == st["predicted_offloaded_bytes_per_microbatch"]),
                (f"{name} stage {s} after fwd equal", st["measured_act_after_fwd_bytes"]
                 == st["predicted_act_after_fwd_bytes"]),
                (f"{name} stage {s} peak within", st["measured_act_peak_bytes"] <= st["predicted_act_peak_bytes"])])
            t.add_row(s, name, f"{st['offloaded_bytes_per_microbatch']:,.0f} / "
                      f"{st['predicted_offloaded_bytes_per_microbatch']:,.0f}",
                      f"{st['measured_act_after_fwd_bytes']:,} / {st['predicted_act_after_fwd_bytes']:,.0f}",
                      f"{st['measured_act_peak_bytes']:,} / {st['predicted_act_peak_bytes']:,.0f}",
                      f"{st['measured_host_peak_bytes']:,}", f"{rep['median_time_s']:.3f}", ok)
    losses = {n: [it["loss"] for it in rep["iterations"]] for n, rep in r.items()}
    targets.add("losses bitwise equal", losses["offload"] == losses["keep"])
    con = Out(a.markdown)
    con.print(t)
    con.print(f"losses equal: {losses['offload'] == losses['keep']} ({losses['offload'][-1]!r})")
    con.print(targets.summary())
    run_results.write(a.results, "offload_train_cpu", "measurement",
                      '`lynx train` with a plan that offloads against the same plan keeping (CPU)',
                      _results.figures_of(targets), targets.summary())


if __name__ == "__main__":
    main()
