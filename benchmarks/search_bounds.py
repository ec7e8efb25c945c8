"""The search's bounds on two jobs the speed records do not cover, from this tree and from a git ref side by side.

1. Llama-3.1-405B on 1,024 H100, pinned to `--use-torch-fsdp2` (Megatron's FSDP2: every layer resharded after its
   forward, decision 0275): its layouts pass the static-memory bound, so the stock candidates' memory bound decides
   which are built (decision 0279). Figures: candidates planned, the pick, the wall time.
2. Llama-3-70B on 64 H100 (the default search, `--target megatron`): how far its pick can be from Megatron-Core's
   fastest (`pick_within`, decision 0278).

Target: each job's pick equals the reference's (a bound prunes only what cannot win) where `--against REF` is given.
The planned counts and wall times are reported without a target (wall times move with the machine's tenants; the
two trees run one after the other, each `--jobs 2` in a fresh process).

    python benchmarks/search_bounds.py --against cffdac0 --results benchmarks/results/search_bounds.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _results
from config_search import _checkout_src
from rich.console import Console
from rich.table import Table

JOBS: dict[str, list[str]] = {
    "llama3.1-405b-1024 --use-torch-fsdp2": [
        "--model", "llama3.1-405b", "--hardware", "h100-80g-nvlink", "--gpus", "1024", "--global-batch", "2048",
        "--seq-len", "8192", "--use-torch-fsdp2"],
    "llama3-70b-64": [
        "--model", "llama3-70b", "--hardware", "h100-80g-nvlink", "--gpus", "64", "--global-batch", "128",
        "--seq-len", "8192"],
}
TIMEOUT_S = 900.0


def _search(src: Path, args: list[str]) -> tuple[dict[str, object], float]:
    """`lynx plan ... --json` in a fresh process on `src`'s package: (its JSON, wall seconds)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "lynx", "plan", *args, "--json"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(src)}, timeout=TIMEOUT_S, check=False)
    wall = time.perf_counter() - t0
    if r.returncode != 0 or "{" not in r.stdout:
        raise SystemExit(f"search_bounds.py: {' '.join(args)}: failed ({r.returncode}): "
                         f"{r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout[r.stdout.index("{"):]), wall


def _pick(d: dict[str, object]) -> str:
    w = d.get("winner")
    if not isinstance(w, dict):
        return "none fits"
    shard = "FSDP" if w["fsdp"] else f"DO{int(w['distributed_optimizer'])}"
    return (f"TP{w['tp']} CP{w['cp']} PP{w['pp']} VPP{w['vpp']} DP{w['dp']} mb{w['micro_batch']} {shard} "
            f"{w['method']} {w['iteration_s']:.3f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default=None, metavar="REF", help="a git ref whose src is searched the same way")
    _results.add_option(ap, "search_bounds")
    a = ap.parse_args()
    run = _results.Run()
    here = Path(__file__).resolve().parent.parent / "src"
    figures: list[_results.Figure] = []
    table = Table(title="the search's bounds (predicted picks; wall times on a shared 2-core machine)")
    for c in ("job", "tree", "planned", "pick", "pick_within", "wall s", "same pick as the ref"):
        table.add_column(c)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        ref_src = _checkout_src(a.against, Path(tmp)) if a.against else None
        for name, args in JOBS.items():
            mine, wall = _search(here, args)
            theirs = _search(ref_src, args) if ref_src is not None else None
            within = mine.get("pick_within")
            same = None if theirs is None else _pick(mine) == _pick(theirs[0])
            ok &= same is not False
            table.add_row(name, "this", f"{mine['planned']:,}", _pick(mine),
                          "-" if within is None else f"{within:.2%}", f"{wall:.1f}",
                          "-" if same is None else "yes" if same else "NO")
            figures += [
                _results.Figure(f"{name}: candidates planned (this tree)", mine["planned"]),  # type: ignore[arg-type]
                _results.Figure(f"{name}: wall s, --jobs 2 (this tree; shared machine)", round(wall, 1), "s"),
                _results.Figure(f"{name}: pick (this tree)", _pick(mine),
                                target=f"the same as {a.against}'s" if theirs is not None else "", holds=same),
            ]
            if within is not None:
                figures.append(_results.Figure(f"{name}: the pick is at most this much slower than the target's "
                                               "fastest (pick_within)", round(100 * float(str(within)), 2), "%"))
            if theirs is not None:
                table.add_row("", a.against, f"{theirs[0]['planned']:,}", _pick(theirs[0]), "-", f"{theirs[1]:.1f}",
                              "")
                figures += [
                    _results.Figure(f"{name}: candidates planned ({a.against})", theirs[0]["planned"]),  # type: ignore[arg-type]
                    _results.Figure(f"{name}: wall s, --jobs 2 ({a.against}; shared machine)", round(theirs[1], 1),
                                    "s"),
                ]
    Console(width=200).print(table)
    print(f"targets: {'all hold' if ok else 'some DO NOT HOLD'}")
    run.write(a.results, "search_bounds", "measurement", "The search's bounds: planned candidates, picks and the "
              "target pick's bound, this tree beside a git ref", figures)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
