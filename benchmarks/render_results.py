"""Render docs/results.md from benchmarks/results/*.json (the files `_results.py` writes).

Run: python benchmarks/render_results.py            (rewrites docs/results.md)
     python benchmarks/render_results.py --check    (exit 1 when docs/results.md is not what the JSON gives)

The page is generated: edit the JSON (by re-running a benchmark with `--results`) and render again.
`tests/unit/test_results_page.py` fails when the committed page and the JSON disagree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"
SCHEMA = "lynx-benchmark-result/1"
LONG = 16
"""A record with more figures than this shows only those that do not hold or have no target (the page stays short;
the JSON has them all)."""
FIELDS = ("benchmark", "title", "kind", "command", "machine", "date", "load_average", "commit", "figures",
          "summary")

HEADER = """# Current results

Every figure lynx reports today, one section per benchmark, each with the command that reproduces it, the
machine, the date and the load average. **Generated** by `python benchmarks/render_results.py` from
`benchmarks/results/*.json`; do not edit by hand (re-run the benchmark with `--results
benchmarks/results/<name>.json`, then render). Earlier figures and how they moved are in git's history of
those files (and of the former docs/benchmarks.md).

*Prediction*: lynx's cost model and simulator against published or paper figures (deterministic, any machine
gives the same). *Measurement*: timed or measured on the machine named (a shared 2-core VM unless it says
otherwise; its times depend on the load). A section marked *transcribed* was not re-run when this page was
introduced: its figures, command, date and load are the last recorded run's, as recorded (in the former
benchmarks page, or in the saved run under `benchmarks/results/raw/` that it names).
"""


def load(path: Path) -> dict[str, object] | None:
    """A results record, or None for other JSON (raw run outputs live in results/raw/)."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return None
    missing = [f for f in FIELDS if f not in data]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}")
    return data


def records() -> list[dict[str, object]]:
    out = [r for p in sorted(RESULTS.glob("*.json")) if (r := load(p)) is not None]
    return sorted(out, key=lambda r: (r["kind"] != "prediction", str(r["benchmark"])))


def _num(v: object) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3g}"
    return str(v).replace("|", "\\|")


def _holds(h: object) -> str:
    return "n/a" if h is None else ("yes" if h else "**no**")


def section(r: dict[str, object]) -> list[str]:
    figs = r["figures"]
    assert isinstance(figs, list)
    lines = [f"## {r['title']}", "",
             f"`{r['benchmark']}` · {r['kind']}" + (" · *transcribed*" if r.get("transcribed") else "")
             + f" · {r['summary']}", "",
             f"- command: `{r['command']}`",
             f"- machine: {r['machine']}",
             f"- date: {r['date']}; load average: {r['load_average']}; commit: `{r['commit']}`"]
    if r.get("transcribed"):
        lines.append(f"- transcribed from: {r['transcribed']}")
    lines += [f"- note: {n}" for n in r.get("notes") or []]  # type: ignore[union-attr]
    lines.append("")
    if not figs:
        return lines
    shown = figs if len(figs) <= LONG else [f for f in figs if not f["holds"]]
    with_ref = any(f.get("reference") is not None for f in shown)
    head = ["figure", "value", *(["published / paper"] if with_ref else []), "target", "holds"]
    if shown:
        lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 3) + "---|---|"]
    for f in shown:
        value = _num(f["value"]) + (f" {f['unit']}" if f.get("unit") and f["value"] is not None else "")
        cells = [_num(f["name"]), value, *([_num(f.get("reference"))] if with_ref else []), _num(f["target"]),
                 "" if f["holds"] is None and not f["target"] else _holds(f["holds"])]
        lines.append("| " + " | ".join(cells) + " |")
    if len(shown) < len(figs):
        lines += ["", f"{len(figs) - len(shown)} more figures, each holding its target: "
                      f"`benchmarks/results/{r['benchmark']}.json`."]
    return [*lines, ""]


def render() -> str:
    recs = records()
    lines = [HEADER, "| benchmark | kind | targets | date | |", "|---|---|---|---|---|"]
    for r in recs:
        anchor = str(r["title"]).lower()
        anchor = "".join(c for c in anchor if c.isalnum() or c in " -_").replace(" ", "-")
        lines.append(f"| [{r['benchmark']}](#{anchor}) | {r['kind']} | {r['summary']} | "
                     f"{str(r['date']).split(' ')[0]} | {'transcribed' if r.get('transcribed') else 'run'} |")
    lines.append("")
    for r in recs:
        lines += section(r)
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with docs/results.md instead of writing it")
    a = ap.parse_args()
    text = render()
    if a.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print("docs/results.md is out of date: run python benchmarks/render_results.py", file=sys.stderr)
            sys.exit(1)
        return
    PAGE.write_text(text)


if __name__ == "__main__":
    main()
