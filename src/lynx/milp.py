"""A thin MILP backend: build a model with named variables, solve it with HiGHS (default) or Gurobi
(optional, only when ``gurobipy`` is importable). Solvers write their ILPs against this interface, so
the same model runs on either backend.

Variables are referred to by integer handles; a linear expression is a ``dict[handle, coefficient]``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Literal, TypeVar

INF = math.inf
Expr = Mapping[int, float]
MilpStatus = Literal["optimal", "time_limit", "infeasible", "no_solution", "error"]
"""time_limit: a limit stopped the solve (its time, or a work limit such as HiGHS's mip_max_nodes) with a feasible
incumbent; no_solution: a limit stopped it before any."""
Backend = Literal["auto", "highs", "gurobi"]
"""auto is HiGHS; gurobi only where gurobipy is importable."""
T = TypeVar("T")
HighsOptions = tuple[tuple[str, bool | int | float | str], ...]
"""HiGHS options by name (`Highs.setOptionValue`), set after lynx's own (time limit, gap, one thread)."""


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


SMALL_MATRIX_VALUE = 1e-9
"""HiGHS's default ``small_matrix_value``: a constraint coefficient of smaller magnitude is treated as zero."""


@dataclass
class Milp:
    """A minimization MILP under construction."""

    names: list[str] = field(default_factory=list)
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    rows: list[tuple[float, dict[int, float], float]] = field(default_factory=list)
    contradiction: bool = False
    """A constraint with no variables left that cannot hold (e.g. a budget below the static memory alone): the
    model is infeasible before any solve, which reports it as such."""

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
                self.contradiction = True
            return
        self.rows.append((lb, terms, ub))

    def le(self, expr: Expr, ub: float) -> None:
        self.constrain(expr, ub=ub)

    def ge(self, expr: Expr, lb: float) -> None:
        self.constrain(expr, lb=lb)

    def eq(self, expr: Expr, rhs: float) -> None:
        self.constrain(expr, lb=rhs, ub=rhs)

    def row_scaled(self) -> Milp:
        """The same model with each row divided by its largest coefficient's magnitude: the same feasible set and
        optimum. HEU's rows mix bytes (up to ~1e11) with phase indicators and seconds (~1e-4); HiGHS's LP solver
        ends some of its relaxations in a numerical error or at its time limit on them as built, and solves them
        in milliseconds scaled (decision 0259)."""
        rows = []
        for lb, terms, ub in self.rows:
            s = max(abs(c) for c in terms.values())
            scaled = {v: c / s for v, c in terms.items()}
            tiny = [self.names[v] for v, c in scaled.items() if abs(c) < SMALL_MATRIX_VALUE]
            if tiny:  # HiGHS would drop them: a different model, solved as if it were this one
                raise ValueError(f"row_scaled: {', '.join(tiny)} fall below HiGHS's small_matrix_value in a row "
                                 "scaled to its largest coefficient; give them larger units")
            rows.append((lb / s, scaled, ub / s))
        return Milp(list(self.names), list(self.lower), list(self.upper), list(self.integer), list(self.cost), rows,
                    self.contradiction)

    @property
    def num_variables(self) -> int:
        return len(self.names)

    @property
    def num_constraints(self) -> int:
        return len(self.rows)

    def solve(self, time_limit_s: float = 30.0, mip_gap: float = 1e-6, backend: Backend = "auto",
              progress: Callable[[str], None] | None = None, start: Expr | None = None,
              highs_options: HighsOptions = ()) -> MilpSolution:
        """Solve with HiGHS ("auto", "highs") or Gurobi ("gurobi", only when gurobipy is importable).
        `start`: values of some variables of a known feasible solution (HiGHS completes the rest; a start
        that turns out infeasible is ignored). `highs_options`: more HiGHS options (Gurobi ignores them)."""
        if self.contradiction:
            n = self.num_variables
            return MilpSolution("infeasible", math.inf, (0.0,) * n, 0.0, 0.0, n, self.num_constraints, "none")
        if backend == "gurobi":
            if not _gurobi_available():
                raise ValueError("backend 'gurobi' asked for, but gurobipy is not installed")
            return _solve_gurobi(self, time_limit_s, mip_gap)
        return _solve_highs(self, time_limit_s, mip_gap, progress, start, highs_options)


def _gurobi_available() -> bool:
    return importlib.util.find_spec("gurobipy") is not None


def _solve_highs(m: Milp, time_limit_s: float, mip_gap: float,
                 progress: Callable[[str], None] | None, start: Expr | None = None,
                 highs_options: HighsOptions = ()) -> MilpSolution:
    import highspy

    t0 = time.perf_counter()
    h = _new_highs()
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    h.setOptionValue("threads", 1)
    for name, value in highs_options:
        if h.setOptionValue(name, value) != highspy.HighsStatus.kOk:
            raise ValueError(f"HiGHS refused the option {name}={value!r}")
    h.passModel(_highs_lp(m))
    n = m.num_variables
    if start:
        import numpy as np

        keys = sorted(start)
        h.setSolution(len(keys), np.array(keys, dtype=np.int32), np.array([start[k] for k in keys], dtype=np.float64))
    if progress is not None:
        progress(f"HiGHS: {n} variables, {len(m.rows)} constraints, time limit {time_limit_s:g} s")
        _subscribe_progress(h, progress)
    with _sigint_stops(h) as interrupted:
        _run_interruptibly(h, interrupted)
    if interrupted():
        # The user's Ctrl-C, whatever status HiGHS gives it (1.15 reports an interrupt, 1.16 an error): never
        # a result a caller could mistake for a failed solve or a plan.
        raise KeyboardInterrupt
    ms = h.getModelStatus()
    info = h.getInfo()
    status_text = h.modelStatusToString(ms).lower()
    has_primal = info.primal_solution_status == 2  # kSolutionStatusFeasible
    status: MilpStatus
    if ms == highspy.HighsModelStatus.kOptimal:
        status = "optimal"
    elif ms == highspy.HighsModelStatus.kInfeasible:
        status = "infeasible"
    elif "limit" in status_text:  # the time limit, or a work limit (node cap: HiGHS's "solution limit reached")
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


def _highs_lp(m: Milp) -> Any:
    """The model as HiGHS's row-wise LP."""
    import highspy
    import numpy as np

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
    return lp


_FD1 = threading.Lock()
"""Held while descriptor 1 points at /dev/null (`_new_highs`): two threads redirecting it at once could each
restore the other's /dev/null and leave stdout there for good (`solve_concurrently`)."""


def _new_highs() -> Any:
    """A silent `Highs`. highspy 1.16 prints a two-line banner on the process's stdout (file descriptor 1,
    from C++) when the first `Highs` is built, before any option can be set; stdout is lynx's (its JSON, its
    tables), so the construction runs with descriptor 1 pointed at /dev/null, one thread at a time. 1.15 printed
    nothing there."""
    import highspy

    with _FD1, _fd1_to_devnull():
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    return h


@contextlib.contextmanager
def _fd1_to_devnull() -> Iterator[None]:
    """Point file descriptor 1 at /dev/null for the block, flushing Python's and C's stdio buffers on both
    sides so nothing written before leaks in or after leaks out. Where descriptor 1 cannot be duplicated
    (no stdout at all) the block runs as it is."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
        _c_fflush()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _c_fflush() -> None:
    """fflush(NULL): text a C++ library buffered in C stdio goes where descriptor 1 points now."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError, TypeError):  # no C library to ask (Windows)
        ctypes.CDLL(None).fflush(None)


class _Worker:
    """One daemon thread that runs the solves handed to it, kept between solves. On the configuration search's
    1,773 small HEU solves a thread per solve took 51.2 s where solving on the calling thread took 43.5 s; a
    kept thread takes 46.6-48.4 s (`benchmarks/config_search.py --case llama3-70b-64`, quiet machine)."""

    def __init__(self, name: str = "lynx-highs") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], threading.Event]] = queue.SimpleQueue()
        self.busy = False
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, done = self._jobs.get()
            try:
                fn()
            finally:
                self.busy = False
                done.set()

    def submit(self, fn: Callable[[], object]) -> threading.Event:
        self.busy = True
        done = threading.Event()
        self._jobs.put((fn, done))
        return done


_worker: _Worker | None = None


_threads = 1
"""Threads `solve_concurrently` uses, the calling one included (`concurrent_solves`)."""
_helpers: list[_Worker] = []
_draining = threading.local()
"""`active` on a thread while it runs `solve_concurrently`'s tasks: a call from inside a task runs in turn."""


@contextlib.contextmanager
def concurrent_solves(threads: int) -> Iterator[None]:
    """Within the block, `solve_concurrently` runs its tasks on up to `threads` threads (the calling one and
    helper daemon threads kept between calls). HiGHS releases the GIL while it solves, so one thread's solve runs
    beside another's model building or solve: on a stage's independent problems the wall time falls towards the
    longest of them. Each task's answer is what it gives alone (HiGHS on one thread each, deterministic), so the
    results never depend on the count."""
    global _threads
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    before, _threads = _threads, threads
    try:
        yield
    finally:
        _threads = before


def solve_threads() -> int:
    """The thread count `concurrent_solves` set (1 outside it)."""
    return _threads


def solve_concurrently(tasks: Sequence[Callable[[], T]]) -> list[T]:
    """Each task's result, in order. With more than one thread (`concurrent_solves`) and more than one task, the
    calling thread and `threads - 1` helper threads take the tasks in order as each finishes its last; otherwise
    they run one after the other here. A task's exception is raised here once every started task has ended (the
    first in task order); a Ctrl-C while waiting is raised at once, the helpers' solves left to end on their own
    (daemon threads, never holding the process open)."""
    if _threads <= 1 or len(tasks) <= 1 or getattr(_draining, "active", False):  # not nested
        return [t() for t in tasks]
    out: list[tuple[bool, object]] = [(False, None)] * len(tasks)
    order = iter(range(len(tasks)))
    lock = threading.Lock()

    def drain() -> None:
        _draining.active = True
        try:
            while True:
                with lock:
                    i = next(order, None)
                if i is None:
                    return
                try:
                    out[i] = (True, tasks[i]())
                except BaseException as e:  # noqa: BLE001 - handed to the calling thread, raised there
                    out[i] = (False, e)
        finally:
            _draining.active = False

    n = min(_threads, len(tasks)) - 1
    while len(_helpers) < n:
        _helpers.append(_Worker("lynx-solve"))
    done = [h.submit(drain) for h in _helpers[:n]]
    drain()
    for d in done:
        while not d.wait(0.05):
            pass
    results: list[T] = []
    for ok, value in out:
        if not ok:
            assert isinstance(value, BaseException)
            raise value
        results.append(value)  # type: ignore[arg-type]
    return results


def _run_interruptibly(h: Any, interrupted: Callable[[], bool], grace_s: float = 1.0) -> None:
    """`h.run()` on a worker thread while the main thread waits in short steps, so a Ctrl-C is seen at once.
    HiGHS notices the interrupt only at its next callback, which can be tens of seconds away during the root
    node's cuts and probing; after `grace_s` the wait ends and the caller raises KeyboardInterrupt, leaving
    the solver to stop at that callback (a daemon thread: it never holds the process open; a later solve
    gets a fresh worker while an abandoned one is still busy)."""
    global _worker
    if threading.current_thread() is not threading.main_thread():
        h.run()
        return
    if _worker is None or _worker.busy:
        _worker = _Worker()
    done = _worker.submit(h.run)
    deadline = math.inf
    while not done.wait(0.05):
        if interrupted():
            deadline = min(deadline, time.monotonic() + grace_s)
            if time.monotonic() > deadline:
                return


@contextlib.contextmanager
def _sigint_stops(h: Any) -> Iterator[Callable[[], bool]]:
    """Ctrl-C during `h.run()` stops HiGHS through its user-interrupt callbacks instead of an exception
    raised inside a callback, whose outcome differs by version (1.15: an interrupt status; 1.16: an error
    status, or nothing until the time limit where no Python callback ran). Yields `interrupted()`; the caller
    raises KeyboardInterrupt after the solve returns. Off the main thread signals cannot be caught: there
    the solve runs as before."""
    hit = threading.Event()
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        yield hit.is_set
        return

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        hit.set()

    def stop(e: Any) -> None:
        if hit.is_set():
            e.interrupt()

    for cb in (h.cbSimplexInterrupt, h.cbIpmInterrupt, h.cbMipInterrupt):
        cb.subscribe(stop)
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield hit.is_set
    finally:
        signal.signal(signal.SIGINT, previous)


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
