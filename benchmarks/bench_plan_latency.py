"""How long `lynx plan --compare` takes, end to end (a fresh process, as a user runs it) and per method.

Target: the README's compare command answers in under 2 s on this 2-core machine; each row says
whether its median holds, and a last line sums up.
Run: python benchmarks/bench_plan_latency.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import _results
from _markdown import Out
from _targets import Targets
from rich.table import Table

README = ["plan", "--model", "gpt-7b", "--hardware", "a100-40g-nvlink", "--tp", "4", "--pp", "4",
          "--micro-batch", "16", "--global-batch", "128", "--seq-len", "1024", "--compare"]
TARGET_S = 2.0
CASES = [
    ("gpt-7b, A100 NVLink TP4 PP4 mb16 (README)", README),
    ("gpt-23b, A100 NVLink TP4 PP4 mb16", [*README[:2], "gpt-23b", *README[3:10], "16", *README[11:]]),
    ("gpt-175b, H100 8x8 TP8 PP8 mb1 gb512 s2048",
     ["plan", "--model", "gpt-175b", "--hardware", "h100-80g-nvlink", "--tp", "8", "--pp", "8", "--micro-batch", "1",
      "--global-batch", "512", "--seq-len", "2048", "--compare"]),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--markdown", action="store_true", help="Print tables as markdown.")
    _results.add_option(ap, "bench_plan_latency")
    args = ap.parse_args()
    run_results = _results.Run()
    t = Table(title="lynx plan --compare, wall time of a fresh process (median of repeats)")
    targets = Targets()
    for c in ("case", "median s", "min s", "max s", "target", "holds"):
        t.add_column(c)
    for name, argv in CASES:
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "lynx", *argv], capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
            if r.returncode != 0:
                raise SystemExit(f"{name}: lynx failed: {r.stderr.strip()}")
        med = statistics.median(times)
        t.add_row(name, f"{med:.2f}", f"{min(times):.2f}", f"{max(times):.2f}", f"< {TARGET_S:g} s",
                  targets.at_most(f"{name} median < {TARGET_S:g} s", med, TARGET_S))
    out = Out(args.markdown)
    out.print(t)
    out.print(targets.summary())
    run_results.write(args.results, "bench_plan_latency", "measurement",
                      'How long `lynx plan --compare` takes',
                      _results.figures_of(targets), targets.summary())


if __name__ == "__main__":
    main()
