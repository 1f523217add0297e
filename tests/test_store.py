"""The results database: migrations, SQLite set-up, constraints and ``polspec db``.

Runs on a real SQLite file, and on PostgreSQL too where there is one (conftest's ``pg_url``: the
server ``POLSPEC_TEST_PG_URL`` names, else a local one; each test gets a fresh database there,
dropped afterwards).
"""

from __future__ import annotations

import json
import re
import multiprocessing
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from click.testing import CliRunner
from sqlalchemy import Engine, func, inspect, make_url, select, text
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session

from polspec.cli import main
from polspec.cli.db import db
from polspec.cli.results import _window_line
from polspec.decoding.params import DecodingParams
from polspec.errors import DatabaseFailure, PolspecError
from polspec.jobs.datasets import load_dataset
from polspec.jobs.enqueue import enqueue_generate
from polspec.jobs.spec import GenerateSpec
from polspec.jobs.control import cancel, recover
from polspec.store.engine import display_url, make_engine, session_scope, sqlite_file
from polspec.store.energy_windows import close_energy_window, open_energy_window
from polspec.store.items import (
    Worker,
    cancelled_items,
    claim_item,
    database_id,
    fail_item,
    finish_item,
    reopen_items,
    settle_batch,
)
from polspec.store.migrate import (
    alembic_config,
    current_revision,
    downgrade,
    ensure_schema,
    head_revision,
    require_current_schema,
    upgrade,
)
from polspec.store.queries import batch_progress, item_detail, item_rows, run_sql
from polspec.store.schema import Batch, Cell, EnergyWindow, Item, Result, Status, metadata, utcnow
from conftest import sqlite_url
from helpers import new_result, wait_for
import store_procs

TABLES = {"batches", "cells", "items", "results", "energy_windows", "polspec_meta", "alembic_version"}


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    upgrade(db_url)
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


def new_batch(session: Session, name: str | None = None) -> Batch:
    batch = Batch(kind="generate", name=name, spec={"target": "gemma3-270m", "k": 2})
    session.add(batch)
    session.flush()
    return batch


def new_item(session: Session, batch: Batch, key: str) -> Item:
    item = Item(batch_id=batch.id, item_key=key, prompt="Napisz wiersz o Wiśle.", params={"max_tokens": 16})
    session.add(item)
    session.flush()
    return item


def table_names(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return set(inspect(connection).get_table_names())
    finally:
        engine.dispose()


def schema_differences(url: str) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            return compare_metadata(context, metadata)
    finally:
        engine.dispose()


# --- migrations ---------------------------------------------------------------------------


def test_upgrade_from_empty_creates_the_tables_at_head(db_url: str) -> None:
    assert current_revision(db_url) is None
    upgrade(db_url)
    assert current_revision(db_url) == head_revision()
    assert TABLES <= table_names(db_url)
    assert schema_differences(db_url) == []


def test_upgrade_from_every_earlier_revision_matches_the_models(db_url: str) -> None:
    script = ScriptDirectory.from_config(alembic_config())
    revisions = [revision.revision for revision in reversed(list(script.walk_revisions()))]
    for start in revisions:
        downgrade(db_url, "base")
        upgrade(db_url, start)
        assert current_revision(db_url) == start
        upgrade(db_url)
        assert current_revision(db_url) == head_revision()
        assert schema_differences(db_url) == []


def test_upgrade_from_0001_keeps_the_rows_and_gives_the_database_an_id(db_url: str) -> None:
    upgrade(db_url, "0001")
    engine = make_engine(db_url)
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO batches (id, kind, spec, status, created_at, updated_at) "
                                "VALUES (1, 'generate', '{}', 'queued', :now, :now)"), {"now": "2026-11-30 12:00:00"})
        connection.execute(text("INSERT INTO items (batch_id, item_key, prompt, params, status, attempts, created_at, "
                                "updated_at) VALUES (1, 'a', 'Wisła', '{}', 'running', 1, :now, :now)"),
                           {"now": "2026-11-30 12:00:00"})
    engine.dispose()
    upgrade(db_url)
    engine = make_engine(db_url)
    with session_scope(engine) as session:
        item = session.scalar(select(Item))
        assert (item.item_key, item.status, item.worker_pid, item.heartbeat_at) == ("a", "running", None, None)
    with engine.connect() as connection:  # the migration's id, read before database_id() could make one
        (made,) = connection.execute(text("SELECT value FROM polspec_meta WHERE key = 'database_id'")).scalars().all()
    assert re.fullmatch("[0-9a-f]{12}", made) and database_id(engine) == made
    engine.dispose()


def _sweep_at_0004(db_url: str, cells: list[tuple[int, str]], items: list[tuple[int | None, str]]) -> None:
    """A database at revision 0004 holding sweep 1 with ``cells`` (id, key) and ``items``
    (cell id, item key), and generation batch 2, which takes the items without a cell."""
    upgrade(db_url, "0004")
    engine = make_engine(db_url)
    now = {"now": "2026-12-01 12:00:00"}
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO batches (id, kind, spec, status, created_at, updated_at) VALUES "
                                "(1, 'sweep', '{}', 'done', :now, :now), (2, 'generate', '{}', 'done', :now, :now)"), now)
        for cell_id, key in cells:
            connection.execute(text("INSERT INTO cells (id, batch_id, key, config, baseline) "
                                    "VALUES (:id, 1, :key, '{}', :baseline)"),
                               {"id": cell_id, "key": key, "baseline": "baseline" in key})
        for cell_id, item_key in items:
            connection.execute(text("INSERT INTO items (batch_id, cell_id, item_key, prompt, params, status, attempts, "
                                    "created_at, updated_at) VALUES (:batch, :cell, :key, 'Wisła', '{}', 'done', 1, "
                                    ":now, :now)"),
                               {"batch": 1 if cell_id else 2, "cell": cell_id, "key": item_key} | now)
    engine.dispose()


def test_upgrade_from_0004_gives_sweep_items_their_prompt_and_repeat(db_url: str) -> None:
    speculative = "pl-wiki/gemma3-270m/aligned/k2/p5/s0/b4"
    _sweep_at_0004(db_url, [(1, "pl-wiki/baseline/s0"), (2, speculative)], [
        (1, "pl-wiki/baseline/s0/wiki-001/r0"),
        (1, "pl-wiki/baseline/s0/wiki-001/r1"),
        (2, f"{speculative}/wiki-001/r1"),
        (2, f"{speculative}/my/set/7/r12"),  # a dataset file's own id may contain "/"
        (None, "pl-wiki/baseline/s0/wiki-001/r0"),  # a generation item is no sweep item, whatever its key
    ])
    upgrade(db_url)
    engine = make_engine(db_url)
    with session_scope(engine) as session:
        rows = session.execute(select(Item.cell_id, Item.prompt_key, Item.repeat).order_by(Item.id)).all()
    engine.dispose()
    assert [tuple(row) for row in rows] == [(1, "wiki-001", 0), (1, "wiki-001", 1), (2, "wiki-001", 1),
                                            (2, "my/set/7", 12), (None, None, None)]
    downgrade(db_url, "0004")  # and back: the columns go, the rows stay
    assert table_names(db_url) >= {"items", "cells"}
    upgrade(db_url)
    assert current_revision(db_url) == head_revision()


def test_a_sweep_item_key_that_does_not_parse_stops_the_upgrade_with_one_line(db_url: str) -> None:
    _sweep_at_0004(db_url, [(1, "pl-wiki/baseline/s0")], [(1, "pl-wiki/baseline/s0/wiki-001")])
    with pytest.raises(PolspecError, match=r"^sweep item 'pl-wiki/baseline/s0/wiki-001' of cell "
                                           r"'pl-wiki/baseline/s0' is not named .*; cannot migrate it$"):
        upgrade(db_url)
    assert current_revision(db_url) == "0004"  # the migration is one transaction: nothing half done


def test_downgrade_to_base_then_upgrade_round_trip(db_url: str) -> None:
    upgrade(db_url)
    engine = make_engine(db_url)
    with session_scope(engine) as session:
        new_item(session, new_batch(session), "a")
    engine.dispose()

    downgrade(db_url, "base")
    assert current_revision(db_url) is None
    assert table_names(db_url) & TABLES <= {"alembic_version"}

    upgrade(db_url)
    assert current_revision(db_url) == head_revision()
    engine = make_engine(db_url)
    with session_scope(engine) as session:
        assert session.scalar(select(func.count()).select_from(Item)) == 0
    engine.dispose()


def test_concurrent_ensure_schema_migrates_once(db_url: str) -> None:
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        revisions = pool.map(store_procs.ensure_then_read_revision, [db_url] * 4)
    assert revisions == [head_revision()] * 4


def test_concurrent_upgrades_each_tell_the_revision_they_found(db_url: str) -> None:
    """What ``polspec db upgrade`` prints: one process migrated, the others found it done (each
    said it had upgraded from empty when the revision was read before the migration lock)."""
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        found = pool.map(upgrade, [db_url] * 3)
    assert sorted(found, key=str) == [head_revision(), head_revision(), None]


def test_require_current_schema_refuses_an_out_of_date_database(db_url: str) -> None:
    shown = display_url(db_url)
    path = sqlite_file(make_url(db_url))
    if path is not None:  # a file that is not there is no database to upgrade but maybe a typo
        with pytest.raises(PolspecError, match=r"no such file, nothing has been stored there "
                                               r"\((is POLSPEC_DB_URL right\? )?enqueueing or polspec db upgrade "
                                               r"creates it\)$"):
            require_current_schema(db_url)
        assert not path.exists()
        path.parent.mkdir(parents=True)
        path.touch()  # an empty SQLite database
    with pytest.raises(PolspecError, match="run polspec db upgrade") as error:
        require_current_schema(db_url)
    assert shown in str(error.value) and "\n" not in str(error.value)

    ensure_schema(db_url)
    require_current_schema(db_url)


def test_a_revision_from_a_newer_polspec_is_refused(engine: Engine) -> None:
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = 'ffff'"))
    url = engine.url.render_as_string(hide_password=False)
    for action in (require_current_schema, upgrade, ensure_schema):
        with pytest.raises(PolspecError, match=r"revision ffff is newer than this polspec knows \(a newer polspec"):
            action(url)


# --- SQLite set-up ------------------------------------------------------------------------


def test_sqlite_pragmas_are_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(sqlite_url(tmp_path))
    with engine.connect() as connection:
        pragma = lambda name: connection.exec_driver_sql(f"PRAGMA {name}").scalar()  # noqa: E731
        assert pragma("journal_mode") == "wal"
        assert pragma("foreign_keys") == 1
        assert pragma("busy_timeout") == 30000
        assert pragma("synchronous") == 1  # NORMAL
    engine.dispose()

    monkeypatch.setenv("POLSPEC_DB_BUSY_TIMEOUT_MS", "1234")
    engine = make_engine(sqlite_url(tmp_path))
    with engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 1234
    engine.dispose()

    monkeypatch.setenv("POLSPEC_DB_BUSY_TIMEOUT_MS", "soon")
    with pytest.raises(PolspecError, match="POLSPEC_DB_BUSY_TIMEOUT_MS"):
        make_engine(sqlite_url(tmp_path))


def test_sqlite_transactions_take_the_write_lock_at_begin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = sqlite_url(tmp_path)
    upgrade(url)
    monkeypatch.setenv("POLSPEC_DB_BUSY_TIMEOUT_MS", "100")
    first, second, reader = make_engine(url), make_engine(url), make_engine(url, readonly=True)
    with first.connect() as holder:
        # A read alone: under a deferred BEGIN this would take no write lock.
        holder.execute(select(func.count()).select_from(Batch))
        with second.connect() as other, pytest.raises(PolspecError, match=r"locked \(busy timeout 100 ms") as error:
            other.execute(select(func.count()).select_from(Batch))
        assert url in str(error.value)
        # Read-only connections do not wait for writers.
        with reader.connect() as connection:
            assert connection.scalar(select(func.count()).select_from(Batch)) == 0
    for engine in (first, second, reader):
        engine.dispose()


def test_a_worker_s_reads_go_on_while_another_process_writes_for_long(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A large sweep's enqueue holds SQLite's write lock for minutes: a worker's once-a-second
    cancel check, taking it too, failed after the busy timeout and dropped every item the
    worker was decoding; the progress bar beside it failed alike."""
    url = sqlite_url(tmp_path)
    upgrade(url)
    monkeypatch.setenv("POLSPEC_DB_BUSY_TIMEOUT_MS", "100")
    worker, enqueue = make_engine(url), make_engine(url)
    with session_scope(worker) as session:
        batch = new_batch(session)
        item_id = new_item(session, batch, "a").id
    with session_scope(enqueue) as writing:
        writing.add(Batch(kind="sweep", spec={}))
        writing.flush()
        assert cancelled_items(worker, [item_id, item_id + 1]) == {item_id + 1}  # the second is no item
        assert [(row.id, row.status) for row in batch_progress(worker)] == [(batch.id, "queued")]
        with pytest.raises(DatabaseFailure, match="locked"):  # a write waits for it, as it must
            claim_item(worker, item_id, Worker("host", 1), 60)
    for engine in (worker, enqueue):
        engine.dispose()


def test_concurrent_read_then_write_transactions_all_complete(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    upgrade(url)
    engine = make_engine(url)
    with session_scope(engine) as session:
        assert new_batch(session).id == 1

    workers, rounds = 4, 10
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pool.starmap(store_procs.read_then_write, [(url, rounds)] * workers)

    # Serialised transactions: every read saw every earlier write, so the keys are 0..n-1.
    with session_scope(engine) as session:
        keys = session.scalars(select(Item.item_key)).all()
    assert sorted(keys, key=int) == [str(n) for n in range(workers * rounds)]
    engine.dispose()


def test_unwritable_data_directory_is_a_one_line_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    url = f"sqlite:///{blocker / 'polspec.db'}"
    with pytest.raises(PolspecError, match="cannot create") as error:
        make_engine(url)
    assert url in str(error.value)


def test_unreachable_server_error_names_the_url_without_password() -> None:
    url = "postgresql+psycopg://polspec:hunter2@127.0.0.1:1/polspec"
    pytest.importorskip("psycopg")
    with pytest.raises(DatabaseFailure) as error:  # a PolspecError the worker retries on
        current_revision(url)
    message = str(error.value)
    assert "postgresql+psycopg://polspec:***@127.0.0.1:1/polspec" in message
    assert "hunter2" not in message and "\n" not in message


def test_results_show_gives_its_numbers_without_exponents(engine: Engine) -> None:
    """1234.5 tok/s read 1.23e+03."""
    with session_scope(engine) as session:
        item = new_item(session, new_batch(session), "a")
        item.status = Status.DONE.value
        result = new_result(item)
        result.metrics = {"decode_tokens_per_s": 1234.5, "acceptance_per_candidate": 0.83333, "prefill_s": 0.000123}
        session.add(result)
    url = engine.url.render_as_string(hide_password=False)
    shown = CliRunner().invoke(main, ["results", "show", str(item.batch_id), "a"], env={"POLSPEC_DB_URL": url})
    assert shown.exit_code == 0, shown.output
    assert "metrics: decode_tokens_per_s=1234, acceptance_per_candidate=0.833, prefill_s=0.000123\n" in shown.output


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_an_in_memory_database_is_refused_in_one_line(url: str) -> None:
    for command in (["upgrade"], ["current"]):  # it used to upgrade a database the next command lost
        result = CliRunner().invoke(main, ["db", *command], env={"POLSPEC_DB_URL": url})
        assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
        assert result.output.startswith(f"polspec: error: database {url}: an in-memory SQLite database lasts one "
                                        "connection; give a file")


@pytest.mark.parametrize("url", ["sqlite:///file::memory:?uri=true", "sqlite:///file:{tmp}/none.db?uri=true"])
def test_a_sqlite_file_uri_is_refused_in_one_line(url: str, tmp_path: Path) -> None:
    url = url.format(tmp=tmp_path)
    for args in (["db", "upgrade"], ["db", "current"], ["status"]):  # status created and migrated none.db
        result = CliRunner().invoke(main, args, env={"POLSPEC_DB_URL": url})
        assert result.exit_code == 1 and result.output == (f"polspec: error: database {url}: give the SQLite file as "
                                                           "a path, e.g. sqlite:///results/polspec.db, not as a file: "
                                                           "URI\n"), (args, result.output)
    assert list(tmp_path.iterdir()) == []


def test_a_sqlite_path_from_the_home_directory_is_taken_from_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path / "..")
    result = CliRunner().invoke(main, ["db", "upgrade"], env={"POLSPEC_DB_URL": "sqlite:///~/wyniki/polspec.db"})
    assert result.exit_code == 0, result.output
    assert (tmp_path / "wyniki" / "polspec.db").exists() and not (tmp_path / ".." / "~").exists()


def test_a_database_url_is_shown_as_typed_but_for_its_password() -> None:
    assert display_url("sqlite:////srv/wyniki łódź/polspec.db") == "sqlite:////srv/wyniki łódź/polspec.db"
    assert display_url("postgresql+psycopg://ala:hunter2@db-host:5433/polspec?sslmode=require") == \
        "postgresql+psycopg://ala:***@db-host:5433/polspec?sslmode=require"


def test_a_database_url_whose_port_is_no_number_is_one_line() -> None:
    result = CliRunner().invoke(main, ["status"], env={"POLSPEC_DB_URL": "postgresql://u:pw@h:notaport/db"})
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert result.output.startswith("polspec: error: not a database URL (POLSPEC_DB_URL): ")


def test_a_database_url_option_the_driver_refuses_is_one_line(db_url: str) -> None:
    """SQLite's driver refused `?timeout=abc` as the engine was made, psycopg an unknown option
    (`?sslmod=`, a typo) as it connected: tracebacks."""
    url = db_url + ("?timeout=abc" if db_url.startswith("sqlite") else "?sslmod=require")
    result = CliRunner().invoke(main, ["db", "upgrade"], env={"POLSPEC_DB_URL": url})
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert result.output.startswith(f"polspec: error: database {display_url(url)}: ")


# --- schema contract ----------------------------------------------------------------------


def test_rows_round_trip(engine: Engine) -> None:
    with session_scope(engine) as session:
        item = new_item(session, new_batch(session, name="wieczór"), "a")
        session.add(new_result(item, energy_joules=1.5, energy_source="powermetrics"))
    with session_scope(engine) as session:
        item = session.scalars(select(Item).where(Item.messages.is_(None))).one()
        assert item.status == "queued" and item.attempts == 0
        assert item.batch.spec == {"target": "gemma3-270m", "k": 2}
        assert item.result is not None and item.result.text == "Płynie Wisła płynie…"
        assert item.result.token_ids == [1, 2, 3]
        assert item.created_at.tzinfo == UTC and item.result.created_at.tzinfo == UTC


def test_item_key_is_unique_within_a_batch(engine: Engine) -> None:
    with session_scope(engine) as session:
        first, second = new_batch(session, "first"), new_batch(session, "second")
        new_item(session, first, "a")
        new_item(session, second, "a")
    with pytest.raises(IntegrityError), session_scope(engine) as session:
        new_item(session, session.get(Batch, first.id), "a")


def test_batch_name_is_unique_but_optional(engine: Engine) -> None:
    with session_scope(engine) as session:
        new_batch(session)
        new_batch(session)
        new_batch(session, "nightly")
    with pytest.raises(IntegrityError), session_scope(engine) as session:
        new_batch(session, "nightly")


def test_one_result_per_item(engine: Engine) -> None:
    with session_scope(engine) as session:
        item = new_item(session, new_batch(session), "a")
        session.add(new_result(item))
    with pytest.raises(IntegrityError), session_scope(engine) as session:
        session.add(new_result(item))


def test_energy_is_measured_or_explained(engine: Engine) -> None:
    with session_scope(engine) as session:
        item = new_item(session, new_batch(session), "a")
    with pytest.raises(IntegrityError), session_scope(engine) as session:
        session.add(new_result(item, energy_joules=None, energy_unavailable_reason=None))
    with pytest.raises(IntegrityError), session_scope(engine) as session:
        session.add(new_result(item, energy_joules=2.0, energy_source=None))


def test_an_energy_window_is_open_or_closed_with_joules_or_the_reason(engine: Engine) -> None:
    me = Worker("host", 42)
    measured, stopped = open_energy_window(engine, me), open_energy_window(engine, me)
    close_energy_window(engine, measured, sequences=3, generated_tokens=40, joules=12.5, source="rapl",
                        unavailable_reason=None)
    close_energy_window(engine, stopped, sequences=1, generated_tokens=5, joules=None, source=None,
                        unavailable_reason="the worker stopped in the middle of the batch")
    with session_scope(engine) as session:
        rows = {window.id: window for window in session.scalars(select(EnergyWindow))}
        item = new_item(session, new_batch(session), "a")
        session.add(new_result(item, energy_joules=None, energy_unavailable_reason="decoded in a batch",
                               energy_window_id=measured))
    assert (rows[measured].worker_host, rows[measured].worker_pid, rows[measured].energy_joules) == ("host", 42, 12.5)
    assert rows[measured].ended_at >= rows[measured].started_at and rows[stopped].energy_joules is None
    opened = open_energy_window(engine, me)
    with pytest.raises(IntegrityError), session_scope(engine) as session:  # closed without joules or a reason
        session.get(EnergyWindow, opened).ended_at = utcnow()
    with session_scope(engine) as session:
        for key, window_id in (("b", stopped), ("c", opened)):
            session.add(new_result(new_item(session, session.get(Batch, item.batch_id), key), energy_joules=None,
                                   energy_unavailable_reason="decoded in a batch", energy_window_id=window_id))
    shown = {key: _window_line(item_detail(engine, item.batch_id, key)["batch_energy"]) for key in "abc"}
    assert shown == {"a": f"window {measured}, 12.5 J (rapl) over 40 tokens of 3 sequences",
                     "b": f"window {stopped}, unavailable: the worker stopped in the middle of the batch",
                     "c": f"window {opened} is open: its batch is still decoding, or its end was never recorded "
                          "(a killed worker)"}
    with session_scope(engine) as session:  # a window deleted by hand leaves its results, unnamed
        session.delete(session.get(EnergyWindow, measured))
    with session_scope(engine) as session:
        assert session.scalar(select(Result.energy_window_id).where(Result.item_id == item.id)) is None


def test_item_needs_an_input_and_a_known_status(engine: Engine) -> None:
    with session_scope(engine) as session:
        batch = new_batch(session)
    with pytest.raises(IntegrityError), session_scope(engine) as session:
        session.add(Item(batch_id=batch.id, item_key="a", params={}))
    with pytest.raises(IntegrityError), session_scope(engine) as session:
        session.add(Item(batch_id=batch.id, item_key="a", prompt="x", params={}, status="lost"))
    with session_scope(engine) as session:
        session.add(Item(batch_id=batch.id, item_key="a", messages=[{"role": "user", "content": "Cześć"}], params={}))


def test_a_sweep_item_has_cell_prompt_and_repeat_or_none_and_one_item_per_pair(engine: Engine) -> None:
    with session_scope(engine) as session:
        batch = new_batch(session)
        cell = Cell(batch_id=batch.id, key="pl-wiki/baseline/s0", config={}, baseline=True)
        session.add(cell)
        session.flush()
        session.add(Item(batch_id=batch.id, cell_id=cell.id, item_key="a", prompt_key="wiki-001", repeat=0,
                         prompt="x", params={}))
    for partial in ({"cell_id": cell.id, "prompt_key": "wiki-001"}, {"prompt_key": "wiki-001", "repeat": 0},
                    {"cell_id": cell.id, "prompt_key": "wiki-001", "repeat": 0}):  # the last one: its pair is taken
        with pytest.raises(IntegrityError), session_scope(engine) as session:
            session.add(Item(batch_id=batch.id, item_key="b", prompt="x", params={}, **partial))


def test_foreign_keys_are_enforced_and_deletes_cascade(engine: Engine) -> None:
    with pytest.raises(IntegrityError), session_scope(engine) as session:
        session.add(Item(batch_id=999, item_key="a", prompt="x", params={}))
    with session_scope(engine) as session:
        batch = new_batch(session)
        session.add(new_result(new_item(session, batch, "a")))
    with engine.begin() as connection:
        connection.execute(text("DELETE FROM batches"))
    with session_scope(engine) as session:
        assert session.scalar(select(func.count()).select_from(Item)) == 0
        assert session.scalar(select(func.count()).select_from(Result)) == 0


def finish_while(engine: Engine, item_id: int, other: threading.Thread) -> None:
    """Finish the item as ``finish_item`` does (its result, done, its batch settled), holding the
    transaction open from ``other``'s start until it waits for this one's locks; then wait for it."""
    with session_scope(engine) as session:
        item = session.scalar(select(Item).where(Item.id == item_id).with_for_update())
        session.add(new_result(item))
        item.status = "done"
        settle_batch(session, item.batch)
        other.start()
        wait_until_blocked(engine, other)
    other.join()


def wait_until_blocked(engine: Engine, thread: threading.Thread) -> None:
    """Wait until ``thread`` waits for a lock this test's open transaction holds: on PostgreSQL
    until the server shows a lock not granted; SQLite shows none, and its writer waits out
    its busy timeout, so there two seconds."""
    if engine.dialect.name == "postgresql":
        with engine.connect() as connection:
            wait_for(lambda: connection.scalar(text("SELECT count(*) FROM pg_locks WHERE NOT granted")) > 0, 30,
                     "the other transaction to wait for a lock")
    else:
        thread.join(timeout=2)
    assert thread.is_alive()


def test_two_workers_finishing_a_batch_s_last_items_at_once_leave_it_done(engine: Engine) -> None:
    """Each finish settles the batch by its items' statuses. On PostgreSQL (read committed) two
    finishes at once each saw the other's item still running and left the batch running for
    good; the second must wait for the first's commit and read its item done."""
    with session_scope(engine) as session:
        batch = new_batch(session)
        first, second = new_item(session, batch, "a").id, new_item(session, batch, "b").id
    one, other = Worker("host", 1), Worker("host", 2)
    claim_item(engine, first, one)
    claim_item(engine, second, other)
    finishing = threading.Thread(target=lambda: finish_item(engine, second, other, new_result(Item(id=second))))
    # The first item's finish, held open while the other finishes: without the wait the other
    # finishes first, reading the first item running.
    finish_while(engine, first, finishing)
    with session_scope(engine) as session:
        assert session.get(Batch, batch.id).status == "done"


def test_a_result_kept_while_its_lease_ran_out_is_stored_unless_another_worker_claimed_the_item(
        engine: Engine, redis_url: str) -> None:
    """A worker keeps a finished result while the database is away; meanwhile its lease runs out,
    and the first recover once the database answers queues the item again. The result was
    refused (the item no longer running), and the item decoded again. Now it is stored while
    no worker has claimed the item since; once another has, that one's decoding wins. A finish
    whose commit went through but whose answer was lost reads as stored, once."""
    with session_scope(engine) as session:
        batch = new_batch(session)
        kept, taken = new_item(session, batch, "a").id, new_item(session, batch, "b").id
    me, other = Worker("host", 1), Worker("host", 2)
    for item_id in (kept, taken):
        claim_item(engine, item_id, me)
    requeued = recover(engine, redis.Redis.from_url(redis_url), batch.id, me=other, lease_s=0)
    assert requeued.total == 2
    claim_item(engine, taken, other)
    assert finish_item(engine, kept, me, new_result(Item(id=kept)))
    assert not finish_item(engine, taken, me, new_result(Item(id=taken)))
    assert finish_item(engine, kept, me, new_result(Item(id=kept)))  # again: stored already, not twice
    with session_scope(engine) as session:
        results = session.scalars(select(Result.item_id)).all()
        assert results == [kept] and session.get(Item, taken).status == "running"


def test_an_enqueue_by_name_reads_its_batch_after_a_finish_that_settles_it(db_url: str, redis_url: str) -> None:
    """On PostgreSQL the enqueue read the named batch unlocked: running, as its last item
    finished and made it done; the items it added stayed queued in a batch that read done, and
    a script waiting for done stopped early."""
    upgrade(db_url)
    engine = make_engine(db_url)
    params = DecodingParams(max_tokens=8)
    prompts, spec = load_dataset("pl-short", params, 2), GenerateSpec("gemma3-270m", None, params, None, "dataset:pl-short")
    batch_id = enqueue_generate(spec, prompts[:1], "nightly", db_url=db_url, queue_url=redis_url).batch_id
    with session_scope(engine) as session:
        item_id = session.scalar(select(Item.id).where(Item.batch_id == batch_id))
    claim_item(engine, item_id, Worker("host", 1))
    adding = threading.Thread(target=lambda: enqueue_generate(spec, prompts, "nightly", db_url=db_url,
                                                              queue_url=redis_url))
    finish_while(engine, item_id, adding)
    with session_scope(engine) as session:
        statuses = session.scalars(select(Item.status).where(Item.batch_id == batch_id).order_by(Item.id)).all()
        assert (session.get(Batch, batch_id).status, statuses) == ("queued", ["done", "queued"])
    engine.dispose()


def test_a_generated_nul_character_does_not_lose_the_result(engine: Engine) -> None:
    """A byte-level tokenizer decodes its token for byte 0 to U+0000, which PostgreSQL's text and
    JSON refuse: the result was lost and its item failed. It is stored with U+FFFD, counted."""
    with session_scope(engine) as session:
        item_id = new_item(session, new_batch(session), "a").id
    me = Worker("host", 1)
    claim_item(engine, item_id, me)
    result = new_result(Item(id=item_id))
    result.text, result.token_ids = "Wisła\0 płynie\0", [1, 0, 2, 0]
    result.metrics = result.metrics | {"spans": [["Wisła\0", True], [" płynie\0", False]]}
    assert finish_item(engine, item_id, me, result)
    with session_scope(engine) as session:
        stored = session.scalar(select(Result).where(Result.item_id == item_id))
        assert (stored.text, stored.token_ids) == ("Wisła\ufffd płynie\ufffd", [1, 0, 2, 0])
        assert stored.metrics["spans"] == [["Wisła\ufffd", True], [" płynie\ufffd", False]]
        assert (stored.metrics["nul_replaced"], stored.metrics["rounds"]) == (2, 3)
        assert session.get(Item, item_id).status == "done"


def test_cancelling_a_batch_while_a_worker_claims_its_first_item_deadlocks_neither(engine: Engine) -> None:
    """A claim locks its item, then marks the batch running. On PostgreSQL a cancel that wrote
    the batch first and then waited for the queued items took the locks the other way round:
    "deadlock detected", and one of the two failed."""
    with session_scope(engine) as session:
        batch = new_batch(session)
        first, second = new_item(session, batch, "a").id, new_item(session, batch, "b").id
    cancelled: list[object] = []

    def cancel_batch() -> None:
        try:
            cancelled.append(cancel(engine, None, batch.id))
        except Exception as error:  # the deadlock's loser, reported below
            cancelled.append(error)

    cancelling = threading.Thread(target=cancel_batch)
    with session_scope(engine) as session:  # claim_item of the first item, held open while cancel runs
        item = session.scalar(select(Item).where(Item.id == first).with_for_update())
        cancelling.start()
        wait_until_blocked(engine, cancelling)  # cancel now waits for this transaction's locks
        item.status = "running"
        item.batch.status = "running"
    cancelling.join()
    assert cancelled == [(1, False)]
    with session_scope(engine) as session:
        assert session.get(Batch, batch.id).status == "cancelled"
        assert [session.get(Item, first).status, session.get(Item, second).status] == ["running", "cancelled"]


def test_a_cancel_that_waits_for_a_batch_s_last_finish_refuses_the_finished_batch(engine: Engine) -> None:
    """Cancel refuses a finished batch. On PostgreSQL it decided on the status it read before
    the finish committed, then wrote cancelled over done."""
    with session_scope(engine) as session:
        item_id = new_item(session, batch := new_batch(session), "a").id
    me = Worker("host", 1)
    claim_item(engine, item_id, me)
    refused: list[object] = []

    def cancel_batch() -> None:
        try:
            refused.append(cancel(engine, None, batch.id))
        except PolspecError as error:
            refused.append(str(error))

    cancelling = threading.Thread(target=cancel_batch)
    finish_while(engine, item_id, cancelling)  # the last item's finish, held open while cancel runs
    assert refused == [f"batch {batch.id} has finished (done); there is nothing to cancel"]
    with session_scope(engine) as session:
        assert session.get(Batch, batch.id).status == "done"


def test_a_finish_that_waits_for_a_cancel_leaves_the_batch_cancelled(engine: Engine) -> None:
    """A finish settles its batch by its items, unless the batch is cancelled. On PostgreSQL it
    read the status before it waited for the cancel's lock, and wrote done over cancelled."""
    with session_scope(engine) as session:
        batch = new_batch(session)
        running, queued = new_item(session, batch, "a").id, new_item(session, batch, "b").id
    me = Worker("host", 1)
    claim_item(engine, running, me)
    finishing = threading.Thread(target=lambda: finish_item(engine, running, me, new_result(Item(id=running))))
    with session_scope(engine) as session:  # cancel, held open while the finish runs
        session.scalar(select(Item).where(Item.id == queued).with_for_update()).status = "cancelled"
        session.get(Batch, batch.id).status = "cancelled"
        session.flush()
        finishing.start()
        wait_until_blocked(engine, finishing)
    finishing.join()
    with session_scope(engine) as session:
        assert session.get(Batch, batch.id).status == "cancelled"
        assert session.get(Item, running).status == "done"


def test_an_item_stopped_by_a_cancel_that_was_resumed_meanwhile_is_queued_again(engine: Engine) -> None:
    """cancel, then retry --cancelled before the worker dropped the running item: the resume
    reopened only the cancelled items, and the worker then wrote this one cancelled; the batch
    read done without it ever running."""
    with session_scope(engine) as session:
        batch = new_batch(session)
        running, queued = new_item(session, batch, "a").id, new_item(session, batch, "b").id
    me = Worker("host", 1)
    claim_item(engine, running, me)
    cancel(engine, None, batch.id)
    with session_scope(engine) as session:
        assert reopen_items(session, session.get(Batch, batch.id), (Status.CANCELLED,)) == [(queued, 16)]
    assert fail_item(engine, running, me, "cancelled while running", final=True, status=Status.CANCELLED) \
        == Status.QUEUED
    with session_scope(engine) as session:
        assert [session.get(Item, running).status, session.get(Batch, batch.id).status] == ["queued", "running"]


def test_a_failure_to_retry_in_a_cancelled_batch_cancels_the_item(engine: Engine) -> None:
    """Queued for a retry, the item waited in a cancelled batch: its retry was skipped as
    cancelled, and a resume (which reopens cancelled items) left it queued with no job."""
    with session_scope(engine) as session:
        batch = new_batch(session)
        item_id = new_item(session, batch, "a").id
    me = Worker("host", 1)
    claim_item(engine, item_id, me)
    cancel(engine, None, batch.id)
    assert fail_item(engine, item_id, me, "MemoryError: out of memory", final=False) == Status.CANCELLED
    with session_scope(engine) as session:
        item = session.get(Item, item_id)
        assert (item.status, item.last_error, item.batch.status) == \
            ("cancelled", "MemoryError: out of memory", "cancelled")


def test_a_lease_is_judged_by_the_database_s_clock_when_machines_share_it(pg_url: str, monkeypatch) -> None:
    """Workers on several machines share a PostgreSQL database: one whose clock runs ten minutes
    behind wrote leases that every other worker read as run out, and a second worker took over
    the item it was decoding."""
    from polspec.store import items

    upgrade(pg_url)
    engine = make_engine(pg_url)
    with session_scope(engine) as session:
        item_id = new_item(session, new_batch(session), "a").id
    laptop = Worker("laptop", 1)
    with monkeypatch.context() as behind:
        behind.setattr(items, "utcnow", lambda: utcnow() - timedelta(minutes=10))
        claim_item(engine, item_id, laptop)
        assert claim_item(engine, item_id, Worker("server", 2), lease_s=60) == \
            f"item {item_id} is running on laptop (pid 1)"
        assert finish_item(engine, item_id, laptop, new_result(Item(id=item_id)))
    with session_scope(engine) as session:  # its span on one clock too, as status and report read it
        item = session.get(Item, item_id)
        assert timedelta(0) <= item.finished_at - item.started_at < timedelta(minutes=1)
    engine.dispose()


def test_a_worker_in_another_pid_namespace_keeps_its_item_while_its_lease_runs(engine: Engine) -> None:
    """Containers that share the host's network share its host name but not its pids: a worker
    looked up another container's worker pid in its own table, found no such process and took
    over the item it was decoding."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to run a process in a pid namespace of its own")
    seen = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c",
                           "from polspec.processes import this_host_and_boot; print(this_host_and_boot())"],
                          capture_output=True, text=True)
    if seen.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here: {seen.stderr.strip()}")
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has here, as another namespace's worker pid would be
    container = Worker(seen.stdout.strip(), gone.pid)
    with session_scope(engine) as session:
        item_id = new_item(session, new_batch(session), "a").id
    claim_item(engine, item_id, container)
    assert claim_item(engine, item_id, Worker.this_process()) == \
        f"item {item_id} is running on {container.host} (pid {gone.pid})"


def test_a_worker_on_another_machine_of_the_same_host_name_keeps_its_item_while_its_lease_runs(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two machines may share a host name (laptops keep their default names): a worker on one
    looked up the other's worker pid in its own table, found no such process and took over the
    item it was decoding. The machines tell each other apart by their boots."""
    from polspec import processes

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has here, as another machine's worker pid would be
    with monkeypatch.context() as elsewhere:
        elsewhere.setattr(processes, "boot_id", lambda: "0123456789ab")
        other_machine = Worker(Worker.this_process().host, gone.pid)
    assert other_machine.host.partition(" boot ")[0] == Worker.this_process().host.partition(" boot ")[0]
    with session_scope(engine) as session:
        item_id = new_item(session, new_batch(session), "a").id
    claim_item(engine, item_id, other_machine)
    assert claim_item(engine, item_id, Worker.this_process()) == \
        f"item {item_id} is running on {other_machine.host} (pid {gone.pid})"
    assert not isinstance(claim_item(engine, item_id, Worker.this_process(), lease_s=0), str)  # its lease ran out


def test_readonly_engine_refuses_writes(engine: Engine) -> None:
    url = engine.url.render_as_string(hide_password=False)
    reader = make_engine(url, readonly=True)
    with reader.connect() as connection:
        assert connection.scalar(select(func.count()).select_from(Batch)) == 0
    with pytest.raises((PolspecError, DBAPIError), match="read-?only"), reader.begin() as connection:
        connection.execute(text("DELETE FROM batches"))
    with pytest.raises(PolspecError, match=r"^results sql only reads: the query would change the database \("):
        run_sql(reader, "DELETE FROM batches")  # in words that do not blame the file
    # Statements that select nothing printed an empty line and succeeded.
    assert run_sql(reader, "SELECT 1 AS a WHERE 1 = 0") == (["a"], [])  # a query with no rows is an answer
    setting = "PRAGMA foreign_keys = OFF" if reader.dialect.name == "sqlite" else "SET search_path TO public"
    with pytest.raises(PolspecError, match=re.escape("results sql shows what a query selects, and this statement "
                                                     f"selects nothing: {setting!r}")):
        run_sql(reader, setting)
    reader.dispose()


def test_a_query_that_ends_the_read_only_transaction_writes_nothing(engine: Engine) -> None:
    """PostgreSQL runs several statements in one simple query: a COMMIT among them would end the
    read-only transaction and let the statements after it write."""
    with session_scope(engine) as session:
        new_item(session, new_batch(session), "a")
    reader = make_engine(engine.url.render_as_string(hide_password=False), readonly=True)
    for sql in ("COMMIT; DELETE FROM items; COMMIT", "SELECT 1; DELETE FROM items"):
        with pytest.raises(PolspecError, match="^the database refused the query: "):
            run_sql(reader, sql)
    reader.dispose()
    with session_scope(engine) as session:
        assert session.scalar(select(func.count()).select_from(Item)) == 1


def test_an_export_gives_the_seed_a_sampled_item_drew(engine: Engine) -> None:
    """Without a seed asked for, the decoder draws one and its metrics keep it: the export
    gives that seed, with which the item is rerun exactly."""
    with session_scope(engine) as session:
        batch = new_batch(session)
        drawn, asked = new_item(session, batch, "drawn"), new_item(session, batch, "asked")
        drawn.params = {"max_tokens": 16, "temperature": 0.7, "seed": None}
        asked.params = {"max_tokens": 16, "temperature": 0.7, "seed": 5}
        for item in (drawn, asked):
            result = new_result(item)
            result.metrics = {**result.metrics, "seed": 4242 if item is drawn else 5}
            session.add(result)
        greedy = new_item(session, batch, "greedy")
        session.add(new_result(greedy))
    rows = {row["id"]: row for row in item_rows(engine, batch.id)}
    assert {key: row["seed"] for key, row in rows.items()} == {"drawn": 4242, "asked": 5, "greedy": None}


def test_a_query_runs_as_written_with_colons_and_percent_signs(engine: Engine) -> None:
    with session_scope(engine) as session:
        new_item(session, new_batch(session), "a").prompt = "Godz. 10:30 (100%)"
    reader = make_engine(engine.url.render_as_string(hide_password=False), readonly=True)
    columns, rows = run_sql(reader, "SELECT prompt, 7 % 4 AS rest FROM items WHERE prompt LIKE '%:30 (100%%'")
    reader.dispose()
    assert columns == ["prompt", "rest"] and rows == [("Godz. 10:30 (100%)", 3)]


# --- polspec db ---------------------------------------------------------------------------


def test_cli_upgrade_and_current(db_url: str) -> None:
    runner = CliRunner()
    env = {"POLSPEC_DB_URL": db_url}
    shown = display_url(db_url)
    if (path := sqlite_file(make_url(db_url))) is not None:  # an empty database, as a new PostgreSQL one is
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()

    before = json.loads(runner.invoke(db, ["current", "--json"], env=env, catch_exceptions=False).output)
    assert before == {"url": shown, "current": None, "head": head_revision(), "up_to_date": False}

    result = runner.invoke(db, ["upgrade"], env=env, catch_exceptions=False)
    assert result.exit_code == 0
    assert f"upgraded from revision none (empty) to {head_revision()}" in result.output

    after = json.loads(runner.invoke(db, ["current", "--json"], env=env, catch_exceptions=False).output)
    assert after == {"url": shown, "current": head_revision(), "head": head_revision(), "up_to_date": True}

    again = runner.invoke(db, ["upgrade"], env=env, catch_exceptions=False)
    assert again.exit_code == 0 and "already at revision" in again.output


# --- progress -----------------------------------------------------------------------------


def test_eta_counts_parallel_workers_once_and_skips_idle_hours(engine: Engine) -> None:
    """Two workers overlap on a and b (90 s busy), the sweep sits idle for hours, then c runs
    (60 s): 150 s for 3 items, so the 2 queued items need 100 s more. f failed within a second:
    counting it would pace the batch at 151 s for 4 items, 75.5 s left."""
    start = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
    runs = {"a": (0, 60), "b": (30, 90), "c": (5 * 3600, 5 * 3600 + 60), "f": (6 * 3600, 6 * 3600 + 1)}
    with session_scope(engine) as session:
        batch = new_batch(session)
        for key in ("a", "b", "c", "d", "e", "f"):
            item = new_item(session, batch, key)
            if key in runs:
                item.status = "failed" if key == "f" else "done"
                item.started_at, item.finished_at = (start + timedelta(seconds=s) for s in runs[key])
                if key != "f":
                    session.add(new_result(item))
    (progress,) = batch_progress(engine, batch.id)
    assert progress.busy_s == 150
    assert progress.eta_s == pytest.approx(100)


def test_a_watch_reads_again_only_the_batches_that_may_have_changed(engine: Engine) -> None:
    """status --watch read every result of every batch ever run, every two seconds. A batch done
    (or failed) then and now, with the same items per status, is the earlier read's; one reopened
    since, or done again with more items between two reads, is read again."""
    with session_scope(engine) as session:
        done, running = new_batch(session), new_batch(session)
        for batch, status in ((done, "done"), (running, "running")):
            item = new_item(session, batch, "a")
            item.status = batch.status = status
            if status == "done":
                session.add(new_result(item))
    before = {progress.id: progress for progress in batch_progress(engine)}
    again = {progress.id: progress for progress in batch_progress(engine, before=before.values())}
    assert again[done.id] is before[done.id] and again[running.id] is not before[running.id]
    assert again[running.id] == before[running.id]  # read again, to the same numbers
    with session_scope(engine) as session:  # a retry reopens the done batch
        session.get(Batch, done.id).status = "queued"
        session.scalar(select(Item).where(Item.batch_id == done.id)).status = "queued"
    reopened = {progress.id: progress for progress in batch_progress(engine, before=again.values())}
    assert (reopened[done.id].status, reopened[done.id].counts) == ("queued", {"queued": 1})
    with session_scope(engine) as session:  # an item added and done, the batch done again, between two reads
        item = new_item(session, session.get(Batch, done.id), "b")
        item.status = "done"
        session.add(new_result(item))
        session.get(Batch, done.id).status = "done"
        session.scalar(select(Item).where(Item.batch_id == done.id, Item.item_key == "a")).status = "done"
    grown = {progress.id: progress for progress in batch_progress(engine, before=again.values())}
    assert (grown[done.id].counts, grown[done.id].generated_tokens) == ({"done": 2}, 6)


def test_throughput_leaves_out_the_model_load_and_probe_an_item_waited_for(engine: Engine) -> None:
    """a is claimed first and waits 60 s for the models and 10 s for the probe, then decodes
    alongside b: the batch decoded from b's claim at 50 s to 100 s, not for all 100 s."""
    start = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
    with session_scope(engine) as session:
        batch = new_batch(session)
        for key, span, waited in (("a", (0, 100), {"model_load_s": 60.0, "probe_s": 10.0}), ("b", (50, 100), {}),
                                  ("c", None, {})):
            item = new_item(session, batch, key)
            if span is not None:
                item.status = "done"
                item.started_at, item.finished_at = (start + timedelta(seconds=s) for s in span)
                result = new_result(item)
                result.timings = {"decode_s": 0.24, **waited}
                session.add(result)
    (progress,) = batch_progress(engine, batch.id)
    assert progress.busy_s == 50
    assert progress.aggregate_tokens_per_s == pytest.approx(6 / 50)
    assert progress.eta_s == pytest.approx(25)
