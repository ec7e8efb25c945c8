"""Do two profiles of the same layer agree within the spreads they report? (a timing check: a benchmark,
not a test; it moved here from tests/integration/test_profile_cli.py, where it failed under load).

    python benchmarks/profile_repeatability.py [--repeats 6]

Profiles gpt-tiny (h 512, s 128, micro-batch 2, TP 1, one thread) twice in one process. Per op and
direction, the two medians should differ by at most the sum of their spreads plus 10% of the larger
median plus 0.2 ms; target: at most 4 of the 30 numbers miss, and the layer totals agree within their
spreads plus 15%. One thread: with two OpenMP threads on two busy cores every op waits for a descheduled
thread. Run on a quiet machine (docs/profiling.md).
"""

from __future__ import annotations

import argparse
import os
import sys

import _results
from _markdown import Out
from _targets import Targets
from rich.table import Table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--markdown", action="store_true")
    _results.add_option(ap, "profile_repeatability")
    a = ap.parse_args()
    run_results = _results.Run()
    from lynx.profile.profiler import ProfileConfig, profile

    cfg = ProfileConfig("gpt-tiny", 512, 8, 2048, 128, 2, repeats=a.repeats, warmup=1, threads=1)
    load0 = os.getloadavg()
    p, q = profile(cfg), profile(cfg)
    t = Table(title=f"two profiles of gpt-tiny, ms (load average before {load0[0]:.2f}, "
                    f"after {os.getloadavg()[0]:.2f})")
    for c in ("op", "fwd a / b", "dgrad a / b", "misses"):
        t.add_column(c, justify="right")
    misses = 0
    for sa, sb in zip(p.ops, q.ops, strict=True):
        miss = []
        for f, s in (("fwd_s", "fwd_spread_s"), ("dgrad_s", "dgrad_spread_s")):
            ma, mb = getattr(sa, f), getattr(sb, f)
            if abs(ma - mb) > getattr(sa, s) + getattr(sb, s) + 0.1 * max(ma, mb) + 2e-4:
                miss.append(f)
        misses += len(miss)
        t.add_row(sa.name, f"{sa.fwd_s * 1e3:.2f} / {sb.fwd_s * 1e3:.2f}",
                  f"{sa.dgrad_s * 1e3:.2f} / {sb.dgrad_s * 1e3:.2f}", ", ".join(miss) or "-")
    targets = Targets()
    con = Out(a.markdown)
    con.print(t)
    s = Table(title="targets")
    for c in ("check", "measured", "target", "holds"):
        s.add_column(c, justify="right")
    s.add_row("op medians outside their spreads", str(misses), "<= 4", targets.at_most("op misses", misses, 4))
    for f in ("layer_fwd", "layer_bwd"):
        ma, mb = p.extra[f + "_s"], q.extra[f + "_s"]
        bound = p.extra[f + "_spread_s"] + q.extra[f + "_spread_s"] + 0.15 * max(ma, mb)
        s.add_row(f"{f} |a - b| ms", f"{abs(ma - mb) * 1e3:.2f}", f"<= {bound * 1e3:.2f}",
                  targets.at_most(f, abs(ma - mb), bound))
    con.print(s)
    con.print(targets.summary())
    run_results.write(a.results, "profile_repeatability", "measurement",
                      'Two profiles of the same layer agree within their spreads',
                      _results.figures_of(targets), targets.summary())


if __name__ == "__main__":
    sys.exit(main())
