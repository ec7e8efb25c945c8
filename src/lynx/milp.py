"""A thin MILP backend: build a model with named variables, solve it with HiGHS (default) or Gurobi
(optional, only when ``gurobipy`` is importable). Solvers write their ILPs against this interface, so
the same model runs on either backend.

Variables are referred to by integer handles; a linear expression is a ``dict[handle, coefficient]``.
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

INF = math.inf
Expr = Mapping[int, float]
MilpStatus = Literal["optimal", "time_limit", "infeasible", "no_solution", "error"]
"""time_limit: a feasible incumbent exists; no_solution: the limit hit before any."""
Backend = Literal["auto", "highs", "gurobi"]
"""auto is HiGHS; gurobi only where gurobipy is importable."""


@dataclass(frozen=True, slots=True)
class MilpSolution:
    status: MilpStatus
    objective: float
    values: tuple[float, ...]
    solve_time_s: float
    mip_gap: float
    num_variables: int
    num_constraints: int
    backend: str

    @property
    def has_solution(self) -> bool:
        return self.status in ("optimal", "time_limit")

    def value(self, var: int) -> float:
        return self.values[var]

    def is_one(self, var: int) -> bool:
        return self.values[var] > 0.5


@dataclass
class Milp:
    """A minimization MILP under construction."""

    names: list[str] = field(default_factory=list)
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    rows: list[tuple[float, dict[int, float], float]] = field(default_factory=list)

    def var(self, name: str, lb: float = 0.0, ub: float = INF, integer: bool = False, cost: float = 0.0) -> int:
        self.names.append(name)
        self.lower.append(lb)
        self.upper.append(ub)
        self.integer.append(integer)
        self.cost.append(cost)
        return len(self.names) - 1

    def binary(self, name: str, cost: float = 0.0) -> int:
        return self.var(name, 0.0, 1.0, True, cost)

    def fix(self, var: int, value: float) -> None:
        self.lower[var] = self.upper[var] = value

    def add_cost(self, var: int, c: float) -> None:
        self.cost[var] += c

    def constrain(self, expr: Expr, lb: float = -INF, ub: float = INF) -> None:
        """lb <= sum(coef * var) <= ub; terms with zero coefficient are dropped."""
        terms = {v: c for v, c in expr.items() if c != 0.0}
        if not terms:
            if lb > 1e-9 or ub < -1e-9:
                raise ValueError("constant constraint is infeasible")
            return
        self.rows.append((lb, terms, ub))

    def le(self, expr: Expr, ub: float) -> None:
        self.constrain(expr, ub=ub)

    def ge(self, expr: Expr, lb: float) -> None:
        self.constrain(expr, lb=lb)

    def eq(self, expr: Expr, rhs: float) -> None:
        self.constrain(expr, lb=rhs, ub=rhs)

    @property
    def num_variables(self) -> int:
        return len(self.names)

    @property
    def num_constraints(self) -> int:
        return len(self.rows)

    def solve(self, time_limit_s: float = 30.0, mip_gap: float = 1e-6, backend: Backend = "auto",
              progress: Callable[[str], None] | None = None, start: Expr | None = None) -> MilpSolution:
        """Solve with HiGHS ("auto", "highs") or Gurobi ("gurobi", only when gurobipy is importable).
        `start`: values of some variables of a known feasible solution (HiGHS completes the rest; a start
        that turns out infeasible is ignored)."""
        if backend == "gurobi":
            if not _gurobi_available():
                raise ValueError("backend 'gurobi' asked for, but gurobipy is not installed")
            return _solve_gurobi(self, time_limit_s, mip_gap)
        return _solve_highs(self, time_limit_s, mip_gap, progress, start)


def _gurobi_available() -> bool:
    return importlib.util.find_spec("gurobipy") is not None


def _solve_highs(m: Milp, time_limit_s: float, mip_gap: float,
                 progress: Callable[[str], None] | None, start: Expr | None = None) -> MilpSolution:
    import highspy
    import numpy as np

    t0 = time.perf_counter()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    h.setOptionValue("threads", 1)
    inf = highspy.kHighsInf
    lp = highspy.HighsLp()
    n = m.num_variables
    lp.num_col_ = n
    lp.num_row_ = len(m.rows)
    lp.col_cost_ = np.array(m.cost, dtype=np.float64)
    lp.col_lower_ = np.array([max(-inf, x) for x in m.lower], dtype=np.float64)
    lp.col_upper_ = np.array([min(inf, x) for x in m.upper], dtype=np.float64)
    lp.row_lower_ = np.array([max(-inf, r[0]) for r in m.rows], dtype=np.float64)
    lp.row_upper_ = np.array([min(inf, r[2]) for r in m.rows], dtype=np.float64)
    starts, idx, val = [0], [], []
    for _, terms, _ in m.rows:
        for v, c in terms.items():
            idx.append(v)
            val.append(c)
        starts.append(len(idx))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_ = n
    lp.a_matrix_.num_row_ = len(m.rows)
    lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(idx, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(val, dtype=np.float64)
    if any(m.integer):
        lp.integrality_ = [highspy.HighsVarType.kInteger if b else highspy.HighsVarType.kContinuous
                           for b in m.integer]
    h.passModel(lp)
    if start:
        keys = sorted(start)
        h.setSolution(len(keys), np.array(keys, dtype=np.int32), np.array([start[k] for k in keys], dtype=np.float64))
    if progress is not None:
        progress(f"HiGHS: {n} variables, {len(m.rows)} constraints, time limit {time_limit_s:g} s")
        _subscribe_progress(h, progress)
    h.run()
    ms = h.getModelStatus()
    info = h.getInfo()
    status_text = h.modelStatusToString(ms).lower()
    if ms == getattr(highspy.HighsModelStatus, "kInterrupt", None) or "interrupt" in status_text:
        # HiGHS stopped on Ctrl-C (we never ask it to interrupt itself): the user's interrupt, never a
        # time-limit result that a caller could mistake for a plan.
        raise KeyboardInterrupt
    has_primal = info.primal_solution_status == 2  # kSolutionStatusFeasible
    status: MilpStatus
    if ms == highspy.HighsModelStatus.kOptimal:
        status = "optimal"
    elif ms == highspy.HighsModelStatus.kInfeasible:
        status = "infeasible"
    elif "time limit" in status_text:
        status = "time_limit" if has_primal else "no_solution"
    else:
        status = "time_limit" if has_primal else "error"
    values = tuple(h.getSolution().col_value) if has_primal or status == "optimal" else tuple([0.0] * n)
    gap = float(info.mip_gap) if any(m.integer) and math.isfinite(info.mip_gap) else 0.0
    return MilpSolution(
        status=status, objective=float(info.objective_function_value) if values else math.inf,
        values=values, solve_time_s=time.perf_counter() - t0, mip_gap=gap if status != "optimal" else 0.0,
        num_variables=n, num_constraints=len(m.rows), backend="highs",
    )


def _subscribe_progress(h: object, progress: Callable[[str], None], every_s: float = 5.0) -> None:
    """A progress line on every improving incumbent, and every `every_s` seconds while HiGHS searches."""
    last = [0.0]

    def show(e: object) -> None:
        d = e.data_out  # type: ignore[attr-defined]
        t = float(d.running_time)
        improving = e.callback_type == _improving_type()  # type: ignore[attr-defined]
        if not improving and t - last[0] < every_s:
            return
        last[0] = t
        inc, bound, gap = float(d.objective_function_value), float(d.mip_dual_bound), float(d.mip_gap)
        gap_s = f"{gap:.2%}" if math.isfinite(gap) else "-"
        progress(f"{t:6.1f} s  incumbent {inc:.6g}  bound {bound:.6g}  gap {gap_s}")

    h.cbMipImprovingSolution.subscribe(show)  # type: ignore[attr-defined]
    h.cbMipInterrupt.subscribe(show)  # type: ignore[attr-defined]


def _improving_type() -> object:
    import highspy

    return highspy.cb.HighsCallbackType.kCallbackMipImprovingSolution


def _solve_gurobi(m: Milp, time_limit_s: float, mip_gap: float) -> MilpSolution:  # pragma: no cover
    import gurobipy as gp

    t0 = time.perf_counter()
    model = gp.Model()
    model.Params.OutputFlag = 0
    model.Params.TimeLimit = time_limit_s
    model.Params.MIPGap = mip_gap
    xs = [model.addVar(lb=lo, ub=up, obj=c, vtype=gp.GRB.BINARY if (i and lo == 0 and up == 1) else
                       (gp.GRB.INTEGER if i else gp.GRB.CONTINUOUS))
          for lo, up, i, c in zip(m.lower, m.upper, m.integer, m.cost, strict=True)]
    for lb, terms, ub in m.rows:
        e = gp.quicksum(c * xs[v] for v, c in terms.items())
        if lb == ub:
            model.addConstr(e == lb)
        else:
            if lb > -INF:
                model.addConstr(e >= lb)
            if ub < INF:
                model.addConstr(e <= ub)
    model.optimize()
    st = model.Status
    ok = model.SolCount > 0
    status: MilpStatus = "optimal" if st == gp.GRB.OPTIMAL else ("infeasible" if st == gp.GRB.INFEASIBLE else
                                                     ("time_limit" if ok else "no_solution"))
    values = tuple(x.X for x in xs) if ok else tuple([0.0] * len(xs))
    return MilpSolution(status, model.ObjVal if ok else math.inf, values, time.perf_counter() - t0,
                        model.MIPGap if ok and status != "optimal" else 0.0, len(xs), len(m.rows), "gurobi")
