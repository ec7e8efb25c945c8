"""The profile store: round trip, ids, schema migrations, and refusing (without touching) files that are
not ours. No torch needed: the graphs here come from the analytic model."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lynx.cost.layer import build_layer_graph
from lynx.graph import LayerGraph
from lynx.models import load_model
from lynx.profile.errors import ProfileStoreError
from lynx.profile.store import (
    APPLICATION_ID,
    SCHEMA_VERSION,
    OpStats,
    ProfileStore,
    RunInfo,
    _migrate,
    default_db_path,
    load_profile_graph,
    save_profile,
)
from lynx.spec import ParallelSpec, load_hardware


def _graph(tp: int = 1, mb: int = 2, seq: int = 256) -> LayerGraph:
    par = ParallelSpec(tp=tp, micro_batch_size=mb, global_batch_size=mb, seq_length=seq)
    g = build_layer_graph(load_model("gpt-300m"), load_hardware("a100-40g-nvlink"), par)
    return replace(g, meta=replace(g.meta, source="profile", dtype="fp32", device="cpu: test"))


def _stats(g: LayerGraph) -> list[OpStats]:
    return [OpStats(o.name, o.fwd_time, o.fwd_time / 10, o.bwd_time - o.wgrad_time, 1e-6, o.wgrad_time, 0.0,
                    o.out_bytes, o.out_bytes) for o in g.ops]


INFO = RunInfo(model="gpt-300m", dtype="fp32", device="cpu: test", torch_version="2.x", lynx_version="0.1.0",
               python_version="3.11", host="h", warmup=1, repeats=3, threads=2, wall_s=1.5,
               created_at="2026-01-01T00:00:00+00:00")


def test_round_trip_is_exact(tmp_path: Path) -> None:
    db = tmp_path / "p.sqlite"
    g = _graph()
    pid = save_profile(db, g, INFO, _stats(g), {"layer_fwd_s": 0.5})
    with ProfileStore.open(db) as st:
        rec = st.get(str(pid))
    assert rec.graph.meta.source == f"profile:{pid}"
    assert replace(rec.graph, meta=g.meta) == g  # every float and tuple back bit for bit
    assert rec.ops == tuple(_stats(g))
    assert rec.info == INFO and rec.extra == {"layer_fwd_s": 0.5}
    assert load_profile_graph(str(pid), db) == rec.graph


def test_every_run_gets_a_new_id_and_latest_resolves(tmp_path: Path) -> None:
    db = tmp_path / "p.sqlite"
    a = save_profile(db, _graph(), INFO, _stats(_graph()), {})
    b = save_profile(db, _graph(tp=2), INFO, _stats(_graph(tp=2)), {})
    assert b == a + 1
    with ProfileStore.open(db) as st:
        assert [s.id for s in st.summaries()] == [a, b]
        assert [s.tp for s in st.summaries()] == [1, 2]
        assert st.resolve("latest") == b and st.resolve(f"#{a}") == a
        with pytest.raises(ProfileStoreError, match="no profile 99"):
            st.get("99")
        with pytest.raises(ProfileStoreError, match="expected a number"):
            st.get("abc")


def test_missing_file_is_not_created_by_readers(tmp_path: Path) -> None:
    db = tmp_path / "none.sqlite"
    with pytest.raises(ProfileStoreError, match="no profile database"):
        load_profile_graph("1", db)
    assert not db.exists()


@pytest.mark.parametrize("content", [b"this is not sqlite at all" * 100, b"SQLite format 3\x00" + b"\xff" * 2000])
def test_corrupt_file_is_refused_and_untouched(tmp_path: Path, content: bytes) -> None:
    db = tmp_path / "bad.sqlite"
    db.write_bytes(content)
    for create in (False, True):
        with pytest.raises(ProfileStoreError, match="untouched|corrupt|not a readable"), \
                ProfileStore.open(db, create=create):
            pass
    with pytest.raises(ProfileStoreError):
        save_profile(db, _graph(), INFO, _stats(_graph()), {})
    assert db.read_bytes() == content


def test_foreign_sqlite_file_is_refused_and_untouched(tmp_path: Path) -> None:
    db = tmp_path / "other.sqlite"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE customers (name TEXT)")
    conn.commit()
    conn.close()
    before = db.read_bytes()
    with pytest.raises(ProfileStoreError, match="not a lynx profile store"):
        save_profile(db, _graph(), INFO, _stats(_graph()), {})
    assert db.read_bytes() == before


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "new.sqlite"
    save_profile(db, _graph(), INFO, _stats(_graph()), {})
    conn = sqlite3.connect(db)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(ProfileStoreError, match="newer lynx"):
        load_profile_graph("1", db)


def test_version_1_store_is_migrated_in_place(tmp_path: Path) -> None:
    db = tmp_path / "v1.sqlite"
    conn = sqlite3.connect(db, isolation_level=None)
    _migrate(conn, target=1)  # what lynx with schema 1 wrote
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 1
    assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    conn.close()
    # schema 1 has no calibrations table; writing one needs the migration to version 2
    g = _graph()
    pid = save_profile(db, g, INFO, _stats(g), {})
    with ProfileStore.open(db) as st:
        cid = st.add_calibration(pid, "hw", {"matmul_efficiency": 0.5}, {}, "2026-01-01")
        assert st.calibrations(pid)[0]["id"] == cid
        assert st.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_a_failed_write_leaves_no_half_profile(tmp_path: Path) -> None:
    db = tmp_path / "p.sqlite"
    g = _graph()
    bad = _stats(g)
    bad[3] = replace(bad[3], fwd_s=None)  # type: ignore[arg-type]  # violates NOT NULL in `ops`
    with pytest.raises(sqlite3.IntegrityError):
        save_profile(db, g, INFO, bad, {})
    with ProfileStore.open(db) as st:
        assert st.summaries() == []
        assert st.conn.execute("SELECT COUNT(*) FROM ops").fetchone()[0] == 0


def test_odd_characters_in_the_path(tmp_path: Path) -> None:
    db = tmp_path / "we?ird #dir" / "p s.sqlite"
    pid = save_profile(db, _graph(), INFO, _stats(_graph()), {})
    assert load_profile_graph(str(pid), db).names == _graph().names


def test_mismatched_stats_are_refused(tmp_path: Path) -> None:
    g = _graph()
    with pytest.raises(ProfileStoreError, match="do not match"):
        save_profile(tmp_path / "p.sqlite", g, INFO, _stats(g)[:-1], {})


def test_default_path_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_db_path() == tmp_path / "lynx" / "profiles.sqlite"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_db_path() == Path.home() / ".cache" / "lynx" / "profiles.sqlite"


def test_store_and_calibration_do_not_import_torch() -> None:
    code = ("import sys, lynx.profile.store, lynx.profile.calibrate, lynx.cli.profile; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_store_that_cannot_be_written_is_named_before_work(tmp_path: Path) -> None:
    """`lynx profile calibrate` checks the database can take the result before fitting: an immutable file
    (chattr +i, which stops root too) is one ProfileStoreError naming it and --no-save."""
    import os
    import shutil

    from lynx.profile.store import ProfileStore

    db = tmp_path / "p.sqlite"
    with ProfileStore.open(db, create=True) as st:
        st.check_writable()  # a fresh, writable store passes
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(db)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here (needs root and a file system that supports it)")
    try:
        assert not os.access(db, os.W_OK)
        with ProfileStore.open(db) as st, pytest.raises(ProfileStoreError, match="cannot be written.*--no-save"):
            st.check_writable()
    finally:
        subprocess.run(["chattr", "-i", str(db)], check=True)
