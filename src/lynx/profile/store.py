"""The profile store: one SQLite file (standard library only, no torch) that the policy maker reads.

Layout (schema version `SCHEMA_VERSION`, kept in ``PRAGMA user_version``; the file is marked as ours with
``PRAGMA application_id``):

* ``profiles``      one row per profiling run, keyed by model shape, layout, dtype, device and software
  versions; ``graph_json`` is the measured `LayerGraph` (the planner's input, exact round-trip).
* ``ops``           one row per op of a run: medians and spreads of forward, input-gradient and
  weight-gradient time, output / side-state / autograd-saved bytes, inputs (the paper's "operator type,
  execution time, size and dependency").
* ``calibrations``  (since version 2) cost-model efficiency factors fitted to a profile.

A file that is not SQLite, is corrupt, belongs to another program, or was written by a newer lynx gets a
clear error and is never written to. Older lynx files are migrated in one transaction.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any
from urllib.request import pathname2url

from lynx.errors import PlanFormatError
from lynx.families.gpt import MODULE_OF
from lynx.graph import LayerGraph
from lynx.profile.errors import ProfileStoreError

APPLICATION_ID = 0x4C594E58
"""'LYNX' in ASCII: marks a SQLite file as a lynx profile store (PRAGMA application_id)."""
SCHEMA_VERSION = 2


def default_db_path() -> Path:
    """``$XDG_CACHE_HOME/lynx/profiles.sqlite``, else ``~/.cache/lynx/profiles.sqlite``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lynx" / "profiles.sqlite"


# -- records -------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class OpStats:
    """What was measured for one op. Times in seconds (median over repeats; spread = half the distance
    between the 10th and 90th percentile), bytes per device."""

    name: str
    fwd_s: float
    fwd_spread_s: float
    dgrad_s: float
    dgrad_spread_s: float
    wgrad_s: float = 0.0
    wgrad_spread_s: float = 0.0
    saved_bytes: float = 0.0
    """Bytes autograd saved for backward that belong to this op (its output if a backward reads it, plus
    side state such as a dropout mask), counted with saved-tensor hooks."""
    expected_saved_bytes: float = 0.0
    """The same quantity from the `LayerGraph` accounting of the profiled shape and dtype."""


@dataclass(frozen=True, slots=True)
class RunInfo:
    """How and where a profile was taken (the key columns besides the shape)."""

    model: str
    dtype: str
    device: str
    torch_version: str
    lynx_version: str
    python_version: str
    host: str = ""
    warmup: int = 0
    repeats: int = 0
    threads: int = 0
    wall_s: float = 0.0
    created_at: str = ""


@dataclass(frozen=True, slots=True)
class ProfileRecord:
    id: int
    info: RunInfo
    graph: LayerGraph
    ops: tuple[OpStats, ...]
    extra: Mapping[str, Any]
    """Whole-layer numbers (forward/backward totals and their spreads, the saved-bytes check)."""

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "info": asdict(self.info), "ops": [asdict(o) for o in self.ops],
                "extra": dict(self.extra), "graph": self.graph.to_dict()}


@dataclass(frozen=True, slots=True)
class ProfileSummary:
    id: int
    created_at: str
    model: str
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    micro_batch_size: int
    tp: int
    sequence_parallel: bool
    dtype: str
    device: str
    torch_version: str
    fwd_s: float
    bwd_s: float


# -- schema and migrations -----------------------------------------------------------------------------
_V1 = """
CREATE TABLE profiles (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at TEXT NOT NULL,
    model TEXT NOT NULL,
    hidden_size INTEGER NOT NULL, num_attention_heads INTEGER NOT NULL, ffn_hidden_size INTEGER NOT NULL,
    seq_length INTEGER NOT NULL, micro_batch_size INTEGER NOT NULL,
    tp INTEGER NOT NULL, sequence_parallel INTEGER NOT NULL,
    dtype TEXT NOT NULL, device TEXT NOT NULL,
    torch_version TEXT NOT NULL, lynx_version TEXT NOT NULL, python_version TEXT NOT NULL, host TEXT NOT NULL,
    warmup INTEGER NOT NULL, repeats INTEGER NOT NULL, threads INTEGER NOT NULL, wall_s REAL NOT NULL,
    fwd_s REAL NOT NULL, bwd_s REAL NOT NULL,
    graph_json TEXT NOT NULL,
    extra_json TEXT NOT NULL
);
CREATE INDEX profiles_key ON profiles (hidden_size, num_attention_heads, seq_length, micro_batch_size, tp,
                                       sequence_parallel, dtype, device);
CREATE TABLE ops (
    profile_id INTEGER NOT NULL REFERENCES profiles(id) ON DELETE CASCADE,
    idx INTEGER NOT NULL,
    name TEXT NOT NULL, kind TEXT NOT NULL, block TEXT NOT NULL,
    fwd_s REAL NOT NULL, fwd_spread_s REAL NOT NULL,
    dgrad_s REAL NOT NULL, dgrad_spread_s REAL NOT NULL,
    wgrad_s REAL NOT NULL, wgrad_spread_s REAL NOT NULL,
    out_bytes REAL NOT NULL, mask_bytes REAL NOT NULL,
    saved_bytes REAL NOT NULL, expected_saved_bytes REAL NOT NULL,
    inputs TEXT NOT NULL, saved TEXT NOT NULL,
    PRIMARY KEY (profile_id, idx)
);
"""

_V2 = """
CREATE TABLE calibrations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    profile_id INTEGER NOT NULL REFERENCES profiles(id) ON DELETE CASCADE,
    created_at TEXT NOT NULL,
    hardware TEXT NOT NULL,
    params_json TEXT NOT NULL,
    report_json TEXT NOT NULL
);
"""

MIGRATIONS: dict[int, str] = {1: _V1, 2: _V2}
"""Version n's script turns a version n-1 store into version n. Never edit a released script: add one."""


def _migrate(conn: sqlite3.Connection, target: int = SCHEMA_VERSION) -> None:
    current = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if current >= target:
        return
    try:
        conn.execute("BEGIN IMMEDIATE")
        for v in range(current + 1, target + 1):
            for stmt in MIGRATIONS[v].split(";"):
                if stmt.strip():
                    conn.execute(stmt)
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute(f"PRAGMA user_version = {target}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


# -- the store -----------------------------------------------------------------------------------------
class ProfileStore:
    """An open profile database. Use `ProfileStore.open(...)` as a context manager."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self.conn, self.path = conn, path

    @staticmethod
    @contextmanager
    def open(path: Path | None = None, create: bool = False) -> Iterator[ProfileStore]:
        p = Path(path) if path is not None else default_db_path()
        conn = _connect(p, create)
        try:
            yield ProfileStore(conn, p)
        finally:
            conn.close()

    def check_writable(self, option: str = "--db") -> None:
        """Before work whose result is to be stored: the file and its folder (SQLite writes a journal beside
        it) can be written. Read-only, immutable or on a read-only mount: one line naming the file."""
        folder = self.path.parent if str(self.path.parent) else Path(".")
        if not os.access(self.path, os.W_OK) or not os.access(folder, os.W_OK | os.X_OK):
            raise ProfileStoreError(f"{option} {self.path}: the profile database cannot be written (read-only); "
                                    "pass --no-save, or --db with a writable file")

    @contextmanager
    def _tx(self) -> Iterator[None]:
        """One transaction (the connection is in autocommit mode, so `with conn` alone would not group). A
        write the file refuses (read-only, disk full) is one line naming the file, the transaction undone."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except sqlite3.OperationalError as e:
            self.conn.execute("ROLLBACK")
            raise ProfileStoreError(f"{self.path}: cannot write the profile database ({e})") from None
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    # writing
    def add(self, graph: LayerGraph, info: RunInfo, ops: Sequence[OpStats], extra: Mapping[str, Any]) -> int:
        """Store one run; returns its id. Every run gets a new row (nothing is overwritten)."""
        if [o.name for o in ops] != list(graph.names):
            raise ProfileStoreError("profile store: per-op stats do not match the graph's ops")
        m = graph.meta
        with self._tx():
            cur = self.conn.execute(
                "INSERT INTO profiles (created_at, model, hidden_size, num_attention_heads, ffn_hidden_size,"
                " seq_length, micro_batch_size, tp, sequence_parallel, dtype, device, torch_version, lynx_version,"
                " python_version, host, warmup, repeats, threads, wall_s, fwd_s, bwd_s, graph_json, extra_json)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (info.created_at, info.model, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size,
                 m.seq_length, m.micro_batch_size, m.tp, int(m.sequence_parallel), info.dtype, info.device,
                 info.torch_version, info.lynx_version, info.python_version, info.host, info.warmup,
                 info.repeats, info.threads, info.wall_s, graph.fwd_time(), graph.bwd_time(),
                 graph.to_json(), json.dumps(dict(extra))),
            )
            pid = int(cur.lastrowid or 0)
            self.conn.executemany(
                "INSERT INTO ops VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                [(pid, i, op.name, op.kind, op.block, s.fwd_s, s.fwd_spread_s, s.dgrad_s, s.dgrad_spread_s,
                  s.wgrad_s, s.wgrad_spread_s, op.out_bytes, op.mask_bytes, s.saved_bytes,
                  s.expected_saved_bytes, ",".join(op.inputs), ",".join(op.saved))
                 for i, (op, s) in enumerate(zip(graph.ops, ops, strict=True))],
            )
        return pid

    def add_calibration(self, profile_id: int, hardware: str, params: Mapping[str, Any],
                        report: Mapping[str, Any], created_at: str) -> int:
        with self._tx():
            cur = self.conn.execute(
                "INSERT INTO calibrations (profile_id, created_at, hardware, params_json, report_json)"
                " VALUES (?,?,?,?,?)",
                (profile_id, created_at, hardware, json.dumps(dict(params)), json.dumps(dict(report))))
        return int(cur.lastrowid or 0)

    # reading
    def resolve(self, ref: str | int) -> int:
        """A profile id from user text: a number (``7`` or ``#7``) or ``latest``."""
        text = str(ref).strip().lstrip("#")
        if text == "latest":
            row = self.conn.execute("SELECT MAX(id) FROM profiles").fetchone()
            if row[0] is None:
                raise ProfileStoreError(f"{self.path}: no profiles stored yet (run `lynx profile`)")
            return int(row[0])
        if not text.isdigit():
            raise ProfileStoreError(f"profile id {ref!r}: expected a number or 'latest' (see `lynx profile list`)")
        pid = int(text)
        if self.conn.execute("SELECT 1 FROM profiles WHERE id = ?", (pid,)).fetchone() is None:
            raise ProfileStoreError(f"{self.path}: no profile {pid} (see `lynx profile list --db {self.path}`)")
        return pid

    def summaries(self) -> list[ProfileSummary]:
        rows = self.conn.execute(
            "SELECT id, created_at, model, hidden_size, num_attention_heads, ffn_hidden_size, seq_length,"
            " micro_batch_size, tp, sequence_parallel, dtype, device, torch_version, fwd_s, bwd_s"
            " FROM profiles ORDER BY id").fetchall()
        return [ProfileSummary(
            id=int(r[0]), created_at=r[1], model=r[2], hidden_size=int(r[3]), num_attention_heads=int(r[4]),
            ffn_hidden_size=int(r[5]), seq_length=int(r[6]), micro_batch_size=int(r[7]), tp=int(r[8]),
            sequence_parallel=bool(r[9]), dtype=r[10], device=r[11], torch_version=r[12], fwd_s=float(r[13]),
            bwd_s=float(r[14])) for r in rows]

    def get(self, ref: str | int) -> ProfileRecord:
        pid = self.resolve(ref)
        r = self.conn.execute(
            "SELECT created_at, model, dtype, device, torch_version, lynx_version, python_version, host, warmup,"
            " repeats, threads, wall_s, graph_json, extra_json FROM profiles WHERE id = ?", (pid,)).fetchone()
        info = RunInfo(model=r[1], dtype=r[2], device=r[3], torch_version=r[4], lynx_version=r[5],
                       python_version=r[6], host=r[7], warmup=int(r[8]), repeats=int(r[9]), threads=int(r[10]),
                       wall_s=float(r[11]), created_at=r[0])
        try:
            graph = LayerGraph.from_json(r[12], MODULE_OF)
            extra = json.loads(r[13])
        except (PlanFormatError, json.JSONDecodeError) as e:
            raise ProfileStoreError(f"{self.path}: profile {pid} is damaged ({e})") from None
        graph = replace(graph, meta=replace(graph.meta, source=f"profile:{pid}"))
        ops = tuple(OpStats(*row) for row in self.conn.execute(
            "SELECT name, fwd_s, fwd_spread_s, dgrad_s, dgrad_spread_s, wgrad_s, wgrad_spread_s, saved_bytes,"
            " expected_saved_bytes FROM ops WHERE profile_id = ? ORDER BY idx", (pid,)))
        return ProfileRecord(pid, info, graph, ops, extra)

    def calibrations(self, profile_id: int) -> list[dict[str, Any]]:
        rows = self.conn.execute(
            "SELECT id, created_at, hardware, params_json FROM calibrations WHERE profile_id = ? ORDER BY id",
            (profile_id,)).fetchall()
        return [{"id": r[0], "created_at": r[1], "hardware": r[2], "params": json.loads(r[3])} for r in rows]


def _connect(path: Path, create: bool) -> sqlite3.Connection:
    fresh = not path.exists()
    if fresh and not create:
        raise ProfileStoreError(f"{path}: no profile database here (run `lynx profile ...` first, or pass --db)")
    if path.exists() and not path.is_file():
        raise ProfileStoreError(f"{path}: not a file")
    if fresh:
        path.parent.mkdir(parents=True, exist_ok=True)
    uri = f"file:{pathname2url(str(path.resolve()))}?mode={'rwc' if fresh else 'rw'}"
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=10.0)
    except sqlite3.Error as e:
        raise ProfileStoreError(f"{path}: cannot open the profile database ({e})") from None
    try:
        _check_ours(conn, path)
        conn.execute("PRAGMA foreign_keys = ON")
        _migrate(conn)
    except sqlite3.DatabaseError as e:
        conn.close()
        raise ProfileStoreError(
            f"{path}: not a readable SQLite database ({e}); lynx leaves it untouched - pass --db to use another "
            "file") from None
    except BaseException:
        conn.close()
        raise
    return conn


def _check_ours(conn: sqlite3.Connection, path: Path) -> None:
    """Refuse (before any write) a foreign, corrupt or newer file."""
    app_id = int(conn.execute("PRAGMA application_id").fetchone()[0])
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    if app_id != APPLICATION_ID:
        if app_id != 0 or tables or version != 0:
            raise ProfileStoreError(
                f"{path}: a SQLite file that is not a lynx profile store (application_id {app_id:#x}, tables "
                f"{', '.join(tables[:5]) or 'none'}); lynx leaves it untouched - pass --db to use another file")
        return  # an empty database: ours to initialise
    if version > SCHEMA_VERSION:
        raise ProfileStoreError(
            f"{path}: profile store schema version {version} was written by a newer lynx (this one reads up to "
            f"{SCHEMA_VERSION}); upgrade lynx or pass --db to use another file")
    status = conn.execute("PRAGMA quick_check").fetchone()[0]
    if status != "ok":
        raise ProfileStoreError(f"{path}: the profile database is corrupt ({status}); lynx leaves it untouched")


def load_profile_graph(profile_id: str, db: Path | None) -> LayerGraph:
    """The measured `LayerGraph` of a stored profile (``lynx plan --profile ID``)."""
    with ProfileStore.open(db) as store:
        return store.get(profile_id).graph


def save_profile(db: Path | None, graph: LayerGraph, info: RunInfo, ops: Sequence[OpStats],
                 extra: Mapping[str, Any]) -> int:
    with ProfileStore.open(db, create=True) as store:
        return store.add(graph, info, ops, extra)

