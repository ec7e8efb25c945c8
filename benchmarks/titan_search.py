"""`lynx plan --gpus N --target torchtitan` against torchtitan's own settings: the pick, the fastest stock torchtitan
configuration (its activation checkpointing none / full / per-op selective on any layout the search covers) and
torchtitan's published configuration of the model (`config_registry.py`), every row priced as torchtitan runs it.

    python benchmarks/titan_search.py --results benchmarks/results/titan_search.json

Each job runs `python -m lynx plan ... --target torchtitan --json` as a fresh process. Targets: the pick is never
slower than the fastest stock torchtitan configuration nor than the published one where it fits (issue 30: never
lose to a layout a user could type). These are lynx's predictions on H100 (`h100-80g-nvlink`), not measurements;
how close lynx's torchtitan prices come to torchtitan's published runs is benchmarks/fsdp_published.py and
benchmarks/titan_float8_published.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import _results
from _targets import Targets, cell
from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class Job:
    model: str
    gpus: int
    global_batch: int
    seq_len: int = 8192

    @property
    def name(self) -> str:
        return f"{self.model}, {self.gpus} H100, {self.seq_len // 1024}k, batch {self.global_batch}"


JOBS = (
    Job("torchtitan-llama3-8b", 8, 32),
    Job("torchtitan-llama3-70b", 64, 64),
    Job("torchtitan-llama3-70b", 32, 64),
)
"""torchtitan's published batch shapes: llama3_8b's local batch 1 (four accumulation steps at batch 32),
llama3_70b's local batch 8 over DP 8 (TP 8 on 64 GPUs; on 32, DP 4 and two accumulation steps)."""


def search(job: Job) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "lynx", "plan", "--model", job.model, "--hardware", "h100-80g-nvlink", "--gpus",
           str(job.gpus), "--global-batch", str(job.global_batch), "--seq-len", str(job.seq_len), "--target",
           "torchtitan", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {r.stderr.strip().splitlines()[-1:]}")
    return dict(json.loads(r.stdout))


def label(o: dict[str, Any]) -> str:
    shard = "FSDP" if o["fsdp"] else f"DO{int(o['distributed_optimizer'])}"
    return (f"TP{o['tp']} PP{o['pp']} VPP{o['vpp']} DP{o['dp']} SP{int(o['sp'])} mb{o['micro_batch']} {shard} "
            f"{o['method']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _results.add_option(ap, "titan_search")
    a = ap.parse_args()
    run = _results.Run()
    t = Table(title="--target torchtitan: lynx's pick vs torchtitan's own settings (predicted, H100)")
    for c in ("job", "pick", "s", "fastest stock torchtitan", "s", "pick faster by", "published config", "s",
              "pick faster by", "holds"):
        t.add_column(c, justify="right" if c in ("s", "pick faster by", "holds") else "left")
    targets = Targets()
    figures: list[_results.Figure] = []
    for job in JOBS:
        res = search(job)
        win, stock = res["winner"], res["stock_torchtitan"]
        recipe = next((r for r in res["recipes"] if r["outcome"] is not None), None)
        rec = None if recipe is None else recipe["outcome"]
        fits = rec is not None and rec["status"] == "planned"
        gain_stock = stock["iteration_s"] / win["iteration_s"] - 1
        cells = [targets.at_least(f"{job.name}: stock torchtitan / pick", round(1 + gain_stock, 4), 1.0)]
        figures.append(_results.Figure(f"{job.name}: pick {label(win)}", round(win["iteration_s"], 3), "s"))
        figures.append(_results.Figure(f"{job.name}: fastest stock torchtitan {label(stock)}",
                                       round(stock["iteration_s"], 3), "s"))
        figures.append(_results.Figure(f"{job.name}: stock torchtitan over the pick", round(1 + gain_stock, 4), "x",
                                       ">= 1", gain_stock >= 0))
        rec_cells = ["-", "-", "-"]
        if rec is not None:
            what = f"{recipe['name']}: {label(rec)}"
            if fits:
                gain_rec = rec["iteration_s"] / win["iteration_s"] - 1
                cells.append(targets.at_least(f"{job.name}: published / pick", round(1 + gain_rec, 4), 1.0))
                rec_cells = [what, f"{rec['iteration_s']:.3f}", f"{gain_rec:+.1%}"]
                figures.append(_results.Figure(f"{job.name}: {what}", round(rec["iteration_s"], 3), "s"))
                figures.append(_results.Figure(f"{job.name}: published over the pick", round(1 + gain_rec, 4), "x",
                                               ">= 1", gain_rec >= 0))
            else:
                rec_cells = [f"{what} ({rec.get('reason') or rec['status']})", "-", "-"]
                figures.append(_results.Figure(f"{job.name}: {what}", rec["status"]))
        t.add_row(job.name, label(win), f"{win['iteration_s']:.3f}", label(stock), f"{stock['iteration_s']:.3f}",
                  f"{gain_stock:+.1%}", *rec_cells, cell(all(c == cell(True) for c in cells)))
    Console(width=220).print(t)
    decided = [c for c in targets.checks if c.holds is not None]
    print(f"targets: {sum(bool(c.holds) for c in decided)} of {len(decided)} hold")
    run.write(a.results, "titan_search", "prediction", "`lynx plan --gpus --target torchtitan` against torchtitan's "
              "own settings and published configurations", figures)


if __name__ == "__main__":
    main()
