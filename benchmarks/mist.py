"""Head to head with Mist (EuroSys'25) on its own workloads: lynx prices the tuned Megatron-LM configuration
and Mist's chosen configuration of every case of Mist's artifact, beside what the artifact measured, then runs
its own configuration search on the same job (docs/mist.md).

Data: benchmarks/data/mist_artifact.yaml, transcribed from github.com/Dazz993/Mist at the commit it names.
Measured figures exist for the nine single-node L4 cases only (Mist's iteration time and per-stage allocated
peaks; Megatron-LM's time as Mist's time x the README's speedup); the multi-node L4 cases and the A100-40GB
cases (held out: nothing was fitted to them) are priced for the ranking only.

Targets (issue 35), each printed with whether it holds:
- lynx ranks Mist against tuned Megatron as measured, every case, and the measured speedup within +-5 points;
- per-stage peaks within +-5% of Mist's measured ones;
- lynx's own pick predicted >= 1.05x Mist's measured time on average and >= 1.35x tuned Megatron's.

Run: PYTHONPATH=src python benchmarks/mist.py [--hardware-set l4|a100|all] [--markdown] [--no-search]
     [--results benchmarks/results/mist.json] [--raw benchmarks/results/raw/mist_l4.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import _results
from _markdown import Out
from _mist_cases import Artifact, Case, load
from _mist_pricing import HARDWARE, MIST_PRECISION, Priced, hardware_of, price_megatron, price_mist, price_search
from _targets import Targets
from rich.table import Table

from lynx.spec import Hardware

RATIO_POINTS = 0.05
"""Measured speedup (Mist / Megatron-LM) reproduced within +-5 percentage points."""
PEAK_TOL = 0.05
"""Per-stage peaks within +-5% of Mist's measured allocated peaks."""
PICK_OVER_MIST = 1.05
PICK_OVER_MEGATRON = 1.35


@dataclass(frozen=True, slots=True)
class Row:
    case: Case
    megatron: Priced
    mist: Priced
    pick: Priced | None
    pick_mist_recipe: Priced | None
    """lynx's search with Mist's 16-byte state recipe (the planners compared on the same runtime)."""

    @property
    def ratio(self) -> float:
        """Predicted Mist / Megatron speedup (Megatron time over Mist time)."""
        return self.megatron.iteration_s / self.mist.iteration_s


def evaluate(art: Artifact, which: str, hw_override: dict[str, Hardware] | None = None,
             with_search: bool = True) -> list[Row]:
    rows = []
    for c in art.cases:
        if which != "all" and c.hardware != which:
            continue
        hw = (hw_override or {}).get(c.hardware) or hardware_of(c)
        pick = price_search(c, hw) if with_search else None
        pick16 = price_search(c, hw, recipe=MIST_PRECISION) if with_search else None
        rows.append(Row(c, price_megatron(c, hw), price_mist(c, hw), pick, pick16))
    return rows


def _mib(xs: tuple[float, ...]) -> str:
    return "/".join(f"{x / 1024:.1f}" for x in xs)


def _geo(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def measured_table(rows: list[Row], t: Targets) -> Table:
    tab = Table(title="Mist's measured L4 cases: lynx's prediction beside the artifact's measurement "
                      "(time s, stage peaks GiB)")
    for col in ("case", "Megatron config", "Mist config", "Megatron meas", "Megatron pred", "Mist meas",
                "Mist pred", "speedup meas", "speedup pred", "Δ points", "ranking", "±5 pts",
                "Mist peaks meas", "Mist peaks pred", "worst peak err", "±5%"):
        tab.add_column(col, justify="left" if col.endswith("config") or col == "case" else "right")
    for r in rows:
        m = r.case.measured
        if m is None:
            continue
        rank = t.add(f"{r.case.id}: ranking", (r.ratio > 1) == (m.speedup_vs_megatron > 1))
        pts = r.ratio - m.speedup_vs_megatron
        near = t.add(f"{r.case.id}: speedup ±5 points", abs(pts) <= RATIO_POINTS)
        errs = [p / q - 1 for p, q in zip(r.mist.stage_peak_mib, m.mist_peak_allocated_mib, strict=True)]
        worst = max(errs, key=abs)
        pk = t.add(f"{r.case.id}: stage peaks ±5%", all(abs(e) <= PEAK_TOL for e in errs))
        tab.add_row(r.case.id, r.megatron.label, r.mist.label, f"{m.megatron_iteration_s:.2f}",
                    f"{r.megatron.iteration_s:.2f}", f"{m.mist_iteration_s:.2f}", f"{r.mist.iteration_s:.2f}",
                    f"{m.speedup_vs_megatron:.3f}", f"{r.ratio:.3f}", f"{100 * pts:+.1f}", rank, near,
                    _mib(m.mist_peak_allocated_mib), _mib(r.mist.stage_peak_mib), f"{100 * worst:+.1f}%", pk)
    return tab


def search_table(rows: list[Row], t: Targets) -> Table:
    tab = Table(title="lynx's own pick (lynx plan --gpus N) against Mist and tuned Megatron-LM "
                      "(pick: Megatron fp16, 20 B/param; pick16: Mist's 16 B/param runtime state)")
    for col in ("case", "lynx pick", "pick pred s", "pick16", "pick16 pred s", "vs Mist meas", "vs Mist pred",
                "pick16 vs Mist meas", "pick16 vs Mist pred", "vs Megatron meas", "vs Megatron pred"):
        tab.add_column(col, justify="left" if col in ("case", "lynx pick", "pick16") else "right")
    over_mist, over_meg, over_mist16, over_meg16 = [], [], [], []
    for r in rows:
        if r.pick is None or r.pick_mist_recipe is None:
            continue
        m = r.case.measured
        p, p16 = r.pick.iteration_s, r.pick_mist_recipe.iteration_s
        vs_mist = m.mist_iteration_s / p if m else math.nan
        vs_meg = m.megatron_iteration_s / p if m else math.nan
        if m:
            over_mist.append(vs_mist)
            over_meg.append(vs_meg)
            over_mist16.append(m.mist_iteration_s / p16)
            over_meg16.append(m.megatron_iteration_s / p16)
        tab.add_row(r.case.id, r.pick.label, f"{p:.2f}", r.pick_mist_recipe.label, f"{p16:.2f}",
                    f"{vs_mist:.3f}", f"{r.mist.iteration_s / p:.3f}",
                    f"{m.mist_iteration_s / p16:.3f}" if m else "n/a", f"{r.mist.iteration_s / p16:.3f}",
                    f"{vs_meg:.3f}", f"{r.megatron.iteration_s / p:.3f}")
    if over_mist:
        _pick_targets(tab, t, over_mist, over_meg, over_mist16, over_meg16)
    return tab


def _pick_targets(tab: Table, t: Targets, mist: list[float], meg: list[float], mist16: list[float],
                  meg16: list[float]) -> None:
    """The issue's averages (geometric means over the measured cases), for both of lynx's picks."""
    gm, gg, gm16, gg16 = _geo(mist), _geo(meg), _geo(mist16), _geo(meg16)
    tab.add_row("geo. mean (measured cases)", "", "", "", "",
                f"{gm:.3f} ≥{PICK_OVER_MIST} {t.at_least('pick over Mist measured', gm, PICK_OVER_MIST)}", "",
                f"{gm16:.3f} ≥{PICK_OVER_MIST} {t.at_least('pick16 over Mist measured', gm16, PICK_OVER_MIST)}",
                "", f"{gg:.3f} ≥{PICK_OVER_MEGATRON} "
                f"{t.at_least('pick over Megatron measured', gg, PICK_OVER_MEGATRON)}", "")
    tab.add_row("  pick16 over Megatron measured", "", "", "", "", "", "", "", "",
                f"{gg16:.3f} ≥{PICK_OVER_MEGATRON} "
                f"{t.at_least('pick16 over Megatron measured', gg16, PICK_OVER_MEGATRON)}", "")


def ranking_table(rows: list[Row]) -> Table:
    tab = Table(title="Cases without measured figures in the artifact: lynx's predicted ranking (Mist's "
                      "largest stage peak, GiB)")
    for col in ("case", "hardware", "Megatron config", "Mist config", "Megatron pred", "Mist pred",
                "speedup pred", "Mist peak pred", "Mist fits", "notes"):
        tab.add_column(col, justify="left" if col in ("case", "hardware", "notes") or col.endswith("config")
                       else "right")
    for r in rows:
        if r.case.measured is not None:
            continue
        tab.add_row(r.case.id, HARDWARE[r.case.hardware], r.megatron.label, r.mist.label,
                    f"{r.megatron.iteration_s:.2f}", f"{r.mist.iteration_s:.2f}", f"{r.ratio:.3f}",
                    f"{max(r.mist.stage_peak_mib) / 1024:.1f}", "no" if r.mist.oom else "yes",
                    "; ".join(r.mist.notes[:2]))
    return tab


def ranking_figures(rows: list[Row]) -> list[_results.Figure]:
    """The cases without a measurement: lynx's predicted Mist / Megatron-LM speedup, reported without a target."""
    return [_results.Figure(f"{r.case.id}: Mist / Megatron-LM predicted speedup", round(r.ratio, 3), "x")
            for r in rows if r.case.measured is None]


def _priced(p: Priced | None) -> dict[str, object] | None:
    if p is None:
        return None
    return {"config": p.label, "iteration_s": p.iteration_s, "stage_peak_mib": list(p.stage_peak_mib),
            "oom": p.oom, "notes": list(p.notes)}


def to_json(art: Artifact, rows: list[Row], t: Targets, argv: list[str], seconds: float) -> dict[str, object]:
    return {
        "command": "PYTHONPATH=src python benchmarks/mist.py " + " ".join(argv),
        "machine": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "load_average": os.getloadavg()[0], "seconds": seconds,
        "note": "measured on a shared, loaded machine (the seconds are not a speed figure)",
        "source": {"repo": art.repo, "commit": art.commit, "data": "benchmarks/data/mist_artifact.yaml"},
        "cases": [{
            "id": r.case.id, "hardware": HARDWARE[r.case.hardware],
            "measured": None if r.case.measured is None else {
                "mist_iteration_s": r.case.measured.mist_iteration_s,
                "megatron_iteration_s_derived": r.case.measured.megatron_iteration_s,
                "speedup_vs_megatron": r.case.measured.speedup_vs_megatron,
                "mist_peak_allocated_mib": list(r.case.measured.mist_peak_allocated_mib)},
            "megatron": _priced(r.megatron), "mist": _priced(r.mist), "predicted_speedup": r.ratio,
            "lynx_pick": _priced(r.pick), "lynx_pick_mist_recipe": _priced(r.pick_mist_recipe),
        } for r in rows],
        "targets": [{"name": c.name, "holds": c.holds} for c in t.checks],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hardware-set", choices=("l4", "a100", "all"), default="l4")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--no-search", action="store_true", help="skip lynx's own configuration search")
    ap.add_argument("--raw", type=Path, default=None, help="every case's figures as JSON (benchmarks/results/raw/)")
    _results.add_option(ap, "mist (L4; mist_a100 for --hardware-set a100)")
    args = ap.parse_args(argv)
    run = _results.Run()
    out = Out(args.markdown)
    art = load()
    t0 = time.perf_counter()
    rows = evaluate(art, args.hardware_set, with_search=not args.no_search)
    t = Targets()
    if any(r.case.measured for r in rows):
        out.print(measured_table(rows, t))
    if not args.no_search:
        out.print(search_table(rows, t))
    if any(r.case.measured is None for r in rows):
        out.print(ranking_table(rows))
    decided = [c for c in t.checks if c.holds is not None]
    out.print(f"targets: {sum(bool(c.holds) for c in decided)} of {len(decided)} hold "
              f"(Mist {art.repo} at {art.commit[:8]}; load average {os.getloadavg()[0]:.2f}, shared machine)")
    if args.raw is not None:
        args.raw.parent.mkdir(parents=True, exist_ok=True)
        args.raw.write_text(json.dumps(to_json(art, rows, t, list(argv if argv is not None else sys.argv[1:]),
                                               time.perf_counter() - t0), indent=1) + "\n")
    name = "mist" if args.hardware_set == "l4" else f"mist_{args.hardware_set}"
    held_out = "; the A100-40GB cases are held out (nothing fitted to them; predicted only)" \
        if args.hardware_set != "l4" else ""
    run.write(args.results, name, "prediction",
              f"lynx against Mist on Mist's {args.hardware_set} workloads (Mist {art.repo} at {art.commit[:8]})",
              _results.figures_of(t) + ranking_figures(rows), t.summary(),
              notes=("Megatron-LM's measured times are derived (Mist's time x the README speedup); the artifact "
                     "publishes no Megatron measurement" + held_out,))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
