"""Dependencies point one way (design.md's data flow): an ast walk of src/lynx fails on an import cycle
or on a module importing a layer above its own; and the solvers load without the layers above them."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import lynx

ROOT = Path(lynx.__file__).parent

# Layers, bottom first (longest module prefix wins). Same layer may import each other (cycles are checked
# separately). Modules not listed (e.g. new packages) are checked for cycles only.
RANKS: dict[str, int] = {
    "lynx.errors": 0,
    "lynx.spec": 1, "lynx.graph": 1, "lynx.schedule": 1, "lynx.presets": 1, "lynx.families": 1,
    "lynx.topology": 1,
    "lynx.costmodel": 2, "lynx.milp": 2,
    "lynx.policy.base": 3, "lynx.policy": 3,
    "lynx.memory": 4, "lynx.static_memory": 4,
    "lynx.policy.heu": 5, "lynx.policy.heu_mixed": 5, "lynx.policy.opt": 5, "lynx.policy.opt_model": 5,
    "lynx.policy.opt_check": 5, "lynx.policy.opt_timeline": 5, "lynx.policy.rules": 5,
    "lynx.policy.adapipe": 5, "lynx.policy.heu_objective": 5, "lynx.partition": 5,
    "lynx.policy.megatron_modules": 5, "lynx.policy.megatron_offload": 5, "lynx.policy.offload": 5,
    "lynx.problem": 6,
    "lynx.simulate": 7, "lynx.simulate.runtime_costs": 7,
    "lynx.methods": 8,
    "lynx.plan": 9,
    "lynx.api": 10, "lynx.breakdown": 10,
    "lynx.report": 11, "lynx.profile": 11, "lynx.runtime": 11, "lynx.integrations": 11,
    "lynx.cli": 12, "lynx.__main__": 12,
}
SOLVERS = ("lynx.policy.heu", "lynx.policy.heu_objective", "lynx.policy.heu_mixed", "lynx.policy.opt",
           "lynx.policy.rules", "lynx.policy.adapipe", "lynx.policy.megatron_modules",
           "lynx.policy.megatron_offload", "lynx.policy.offload")
SOLVER_MAY_IMPORT = ("lynx.errors", "lynx.graph", "lynx.spec", "lynx.memory", "lynx.milp", "lynx.policy",
                     "lynx.schedule", "lynx.pricing")


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        rel = f.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            names = [f"{n.module}.{a.name}" for a in n.names]
        else:
            continue
        for name in names:
            if name.startswith("lynx"):
                mod = _resolve(name)
                if mod is not None:
                    found.add(mod)
    return found


def _rank(mod: str) -> int | None:
    best = max((p for p in RANKS if mod == p or mod.startswith(p + ".")), key=len, default=None)
    return None if best is None else RANKS[best]


def test_no_upward_imports() -> None:
    bad = []
    for mod, path in MODULES.items():
        r = _rank(mod)
        for dep in _imports(path, top_level_only=False):
            d = _rank(dep)
            if r is not None and d is not None and d > r:
                bad.append(f"{mod} (layer {r}) imports {dep} (layer {d})")
    assert not bad, "\n".join(sorted(bad))


TORCH_SIDE = ("lynx.runtime", "lynx.profile", "lynx.integrations")
"""The torch half (README "Layout"); everything else is the planner half and never imports torch."""


def _third_party(path: Path) -> set[str]:
    out: set[str] = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            out.update(a.name.split(".")[0] for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.add(n.module.split(".")[0])
    return out


def test_the_planner_half_never_imports_torch() -> None:
    bad = [mod for mod, path in MODULES.items()
           if not any(mod == t or mod.startswith(t + ".") for t in TORCH_SIDE)
           and _third_party(path) & {"torch", "torchtitan"}]
    assert not bad, f"planner modules importing torch or torchtitan: {sorted(bad)}"


def test_solvers_import_only_graph_specs_memory_milp_and_their_types() -> None:
    bad = [f"{mod} imports {dep}" for mod in SOLVERS for dep in _imports(MODULES[mod], top_level_only=False)
           if not any(dep == ok or dep.startswith(ok + ".") for ok in SOLVER_MAY_IMPORT)]
    assert not bad, "\n".join(bad)


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return out


def test_no_import_cycles() -> None:
    """Every import counts, the ones inside functions too (a lazy import is still a dependency)."""
    graph = {m: _imports(p, top_level_only=False) - {m} for m, p in MODULES.items()}
    # a package's __init__ importing its own submodules is how packages re-export: not a cycle
    for m in graph:
        graph[m] = {d for d in graph[m] if not (d.startswith(m + ".") and MODULES[m].name == "__init__.py")}
    circles = [" <-> ".join(sorted(c)) for c in _circles(graph)]
    assert not circles, "import cycles: " + "; ".join(circles)


def test_the_cycle_check_sees_function_level_imports(tmp_path: Path) -> None:
    """The check can fail: an import inside a function is read, and a circle of them is found."""
    mod = tmp_path / "m.py"
    mod.write_text("def f() -> None:\n    from lynx.graph import LayerGraph\n")
    assert _imports(mod, top_level_only=False) == {"lynx.graph"}
    assert _imports(mod, top_level_only=True) == set()
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [frozenset({"a", "b"})]


def test_heu_loads_without_the_layers_above() -> None:
    code = "import sys, lynx.policy.heu; print(' '.join(sorted(m for m in sys.modules if m.startswith('lynx'))))"
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    loaded = set(out.split())
    assert "lynx.policy.heu" in loaded
    for above in ("lynx.simulate", "lynx.methods", "lynx.problem", "lynx.plan", "lynx.api"):
        assert not any(m == above or m.startswith(above + ".") for m in loaded), (above, sorted(loaded))
