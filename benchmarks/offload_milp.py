"""HiGHS time of Lynx-HEU's offloading models, with HiGHS's defaults and with `OFFLOAD_HIGHS_OPTIONS` (RINS and RENS
off, at most `OFFLOAD_MAX_NODES` nodes; decision 0252), on the same models side by side.

    python benchmarks/offload_milp.py --results benchmarks/results/offload_milp.json

It runs `lynx plan --model llama3-70b --hardware h100-80g-nvlink --gpus 64 --global-batch 128 --seq-len 8192
--jobs 1` (`benchmarks/config_search.py`'s 70B case) in this process and keeps every offloading model it solves
(those at `OFFLOAD_MIP_GAP`), then solves each of them again with each setting, alternating the settings model by
model so the machine's drift falls on both alike. Printed: the models, each setting's sum and slowest solve, how
many objectives differ and by how much (each solve stops within the 1e-3 relative gap, so the two settings may stop
at different answers inside it). Targets: RINS and RENS off takes at most 80% of the defaults' sum, its slowest
solve under 2 s, and no objective moves by more than the gap. HiGHS runs one thread; the search's own wall time is
not the figure here (config_search.json is).
"""

from __future__ import annotations

import argparse
import sys
import time

import _milp_capture
import _results
from _markdown import Out
from rich.table import Table

import lynx.milp as milp
from lynx.policy.heu import OFFLOAD_HIGHS_OPTIONS, OFFLOAD_MAX_NODES, OFFLOAD_MIP_GAP

SHARE_TARGET = 0.8
SLOWEST_TARGET_S = 2.0


COMMAND = ["plan", "--model", "llama3-70b", "--hardware", "h100-80g-nvlink", "--gpus", "64", "--global-batch", "128",
           "--seq-len", "8192", "--json", "--jobs", "1"]


def capture() -> list[milp.Milp]:
    """The offloading `Milp`s `lynx plan` solves for the 70B / 64 H100 search (`COMMAND`, in this process, its JSON
    discarded)."""
    return [m for m, _, _ in _milp_capture.capture(COMMAND, lambda m, gap: gap == OFFLOAD_MIP_GAP)]


def resolve(m: milp.Milp, options: milp.HighsOptions) -> tuple[float, str, float]:
    """(seconds, status, objective) of one solve at the offloading gap and the search's 10 s limit."""
    return _milp_capture.resolve(m, OFFLOAD_MIP_GAP, options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    _results.add_option(ap, "offload_milp")
    a = ap.parse_args()
    run = _results.Run()
    out = Out(a.markdown)
    t0 = time.perf_counter()
    models = capture()
    print(f"captured {len(models)} offloading models in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    times: dict[str, list[float]] = {"defaults": [], "rins_rens_off": []}
    answers: dict[str, list[tuple[str, float]]] = {"defaults": [], "rins_rens_off": []}
    settings: dict[str, milp.HighsOptions] = {"defaults": (), "rins_rens_off": OFFLOAD_HIGHS_OPTIONS}
    for i, m in enumerate(models):
        order = list(settings) if i % 2 == 0 else list(reversed(settings))
        for name in order:
            t, status, obj = resolve(m, settings[name])
            times[name].append(t)
            answers[name].append((status, obj))
    pairs = list(zip(answers["defaults"], answers["rins_rens_off"], strict=True))
    infeasible = sum(a_[0] == "infeasible" for a_, _ in pairs)
    capped = sum(b[0] == "time_limit" for _, b in pairs)  # stopped by OFFLOAD_MAX_NODES with an incumbent

    def solved(status: str) -> bool:
        return status in ("optimal", "time_limit")

    same_status = all(a_[0] == "optimal" and solved(b[0]) or a_[0] == b[0] == "infeasible" for a_, b in pairs)
    rel = [abs(b[1] - a_[1]) / max(abs(a_[1]), 1e-12) for a_, b in pairs if solved(a_[0]) and solved(b[0])]
    rel = rel or [0.0]
    changed = sum(r > 1e-9 for r in rel)
    base, new = sum(times["defaults"]), sum(times["rins_rens_off"])
    share, slowest = new / base, max(times["rins_rens_off"])
    t = Table(title=f"Lynx-HEU's offloading models of the Llama-3-70B / 64 H100 search ({len(models)} models, "
                    "each solved with both settings, alternating)")
    for c in ("setting", "sum of HiGHS time", "slowest", "objectives changed", "worst relative change"):
        t.add_column(c, justify="left" if c == "setting" else "right")
    t.add_row("HiGHS's defaults", f"{base:.2f} s", f"{max(times['defaults']):.2f} s", "-", "-")
    t.add_row("RINS and RENS off, node cap (OFFLOAD_HIGHS_OPTIONS)", f"{new:.2f} s", f"{slowest:.2f} s", str(changed),
              f"{max(rel):.1e}")
    out.print(t)
    out.print(f"{infeasible} of the models are infeasible (stage problems over their budget, as the search asks) "
              f"under both settings, every other one solved under both: {'yes' if same_status else 'NO'}; "
              f"{capped} stopped at the node cap ({OFFLOAD_MAX_NODES:,} nodes) with their incumbent")
    holds = (share <= SHARE_TARGET, slowest <= SLOWEST_TARGET_S, max(rel) <= OFFLOAD_MIP_GAP and same_status)
    out.print(f"RINS and RENS off / defaults: {share:.3f} (target <= {SHARE_TARGET}: "
              f"{'holds' if holds[0] else 'does NOT hold'}); slowest {slowest:.2f} s (target <= {SLOWEST_TARGET_S} s: "
              f"{'holds' if holds[1] else 'does NOT hold'}); worst objective change {max(rel):.1e} (target <= "
              f"{OFFLOAD_MIP_GAP:g}, the gap: {'holds' if holds[2] else 'does NOT hold'})")
    figures = [
        _results.Figure("offloading models solved", len(models), "models", "-", None, None),
        _results.Figure("HiGHS's defaults: sum of solve time", round(base, 2), "s", "-", None, None),
        _results.Figure("RINS and RENS off: sum of solve time", round(new, 2), "s", "-", None, None),
        _results.Figure("RINS and RENS off / defaults", round(share, 3), "x", f"<= {SHARE_TARGET}", holds[0], None),
        _results.Figure("RINS and RENS off: slowest solve", round(slowest, 2), "s", f"<= {SLOWEST_TARGET_S} s",
                        holds[1], None),
        _results.Figure("HiGHS's defaults: slowest solve", round(max(times["defaults"]), 2), "s", "-", None, None),
        _results.Figure("infeasible models (both settings)", infeasible, "models", "-", None, None),
        _results.Figure("models stopped at the node cap", capped, "models", "-", None, None),
        _results.Figure("objectives that differ", changed, "models", "-", None, None),
        _results.Figure("worst relative objective change (same status everywhere)", float(f"{max(rel):.2e}"), "",
                        f"<= {OFFLOAD_MIP_GAP:g}", holds[2], None),
    ]
    run.write(a.results, "offload_milp", "measurement", "Lynx-HEU's offloading MILPs: HiGHS's defaults against RINS "
              "and RENS off, the same models side by side", figures)
    if not all(holds):
        sys.exit(1)


if __name__ == "__main__":
    main()
