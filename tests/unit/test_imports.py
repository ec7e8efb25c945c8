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

# The rooms of docs/architecture.md, bottom first (longest module prefix wins). A module may import its own room
# and the rooms below it, never one above; every module of the package must be in a room (a new package is
# placed here when it is added, so the order is a decision, not an accident).
RANKS: dict[str, int] = {
    "lynx": 0, "lynx.errors": 0, "lynx.validate": 0, "lynx.paths": 0,
    "lynx.fp8": 0,
    "lynx.spec": 1, "lynx.stack": 1, "lynx.topology": 1, "lynx.graph": 1, "lynx.schedule": 1, "lynx.decisions": 1,
    "lynx.milp": 1,
    "lynx.families": 2, "lynx.models": 2,
    "lynx.cost": 3,
    "lynx.policy": 4, "lynx.partition": 4,
    "lynx.problem": 5, "lynx.checks": 5,
    "lynx.simulate": 6,
    "lynx.methods": 7,
    "lynx.plan": 8,
    "lynx.api": 9, "lynx.request": 9, "lynx.breakdown": 9, "lynx.search": 9, "lynx.export": 9,
    "lynx.report": 10, "lynx.profile": 10, "lynx.runtime": 10, "lynx.integrations": 10,
    "lynx.cli": 11, "lynx.__main__": 11,
}
SOLVERS = ("lynx.policy.heu", "lynx.policy.heu_objective", "lynx.policy.heu_mixed", "lynx.policy.opt",
           "lynx.policy.rules", "lynx.policy.adapipe", "lynx.policy.megatron_modules",
           "lynx.policy.megatron_offload", "lynx.policy.offload")
SOLVER_MAY_IMPORT = ("lynx.errors", "lynx.validate", "lynx.graph", "lynx.spec", "lynx.decisions", "lynx.milp",
                     "lynx.policy", "lynx.schedule", "lynx.cost.memory", "lynx.cost.lifetime", "lynx.cost.pricing")
"""A solver reads the price list and the memory model of the cost room, never how prices are made."""


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
    """The module's room; the root package `lynx` names only itself (its `__init__`), not every module."""
    best = max((p for p in RANKS if mod == p or (p != "lynx" and mod.startswith(p + "."))), key=len, default=None)
    return None if best is None else RANKS[best]


def test_every_module_is_in_a_room() -> None:
    missing = sorted(m for m in MODULES if _rank(m) is None)
    assert not missing, f"modules in no room of RANKS (place them, and in docs/architecture.md): {missing}"


def test_no_upward_imports() -> None:
    """Every import counts, the ones inside functions too; a package's `__init__` is in its package's room."""
    bad = []
    for mod, path in MODULES.items():
        r = _rank(mod)
        for dep in _imports(path, top_level_only=False):
            d = _rank(dep)
            if r is not None and d is not None and d > r:
                bad.append(f"{mod} (room {r}) imports {dep} (room {d})")
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
