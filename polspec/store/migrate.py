"""Schema migrations, run from code: no ``alembic.ini`` is needed at run time.

The Alembic environment and revisions ship inside the package (``polspec/migrations/``).
Commands call :func:`ensure_schema`, which upgrades an out-of-date database; the worker calls
:func:`require_current_schema` instead and refuses to run on an old schema, so that a worker
never changes a database under other running workers.

Only one process migrates a database at a time: SQLite takes an ``flock`` on a lock file next
to the database file, PostgreSQL a transaction-scoped advisory lock. A migration runs in one
transaction, so it applies completely or not at all, and the revision is read again under the
lock, so a process that waited finds the work done.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import URL, Connection, Engine, inspect, text

from polspec.errors import DatabaseProblem, PolspecError
from polspec.files import file_lock
from polspec.settings import database_url_set
from polspec.store.engine import display_url, make_engine, on_read_only_storage, parse_url, sqlite_file

# Any fixed 64-bit number: PostgreSQL advisory locks are keyed by integers.
_PG_LOCK_KEY = int.from_bytes(hashlib.sha256(b"polspec schema migration").digest()[:8], "big", signed=True)


def alembic_config(connection: Connection | None = None) -> Config:
    """The Alembic configuration; ``env.py`` migrates ``connection`` when one is given."""
    config = Config()
    config.set_main_option("script_location", "polspec:migrations")
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """The newest revision this version of polspec knows."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "polspec ships at least one revision"
    return head


def current_revision(url: str | None = None) -> str | None:
    """The database's revision; None for an empty database, or a SQLite file that does not exist
    (which this leaves uncreated: asking is not writing)."""
    return _revision_and_other_tables(url)[0]


def _revision_and_other_tables(url: str | None) -> tuple[str | None, list[str]]:
    """The database's revision and its tables other than Alembic's, read on a read-only
    connection (nor is a SQLite file switched to WAL); none of either for a SQLite file that
    does not exist."""
    path = sqlite_file(parse_url(url))
    if path is not None and not path.exists():
        return None, []
    engine = make_engine(url, readonly=True)
    try:
        with engine.connect() as connection:
            return (MigrationContext.configure(connection).get_current_revision(),
                    sorted(set(inspect(connection).get_table_names()) - {"alembic_version"}))
    finally:
        engine.dispose()


def upgrade(url: str | None = None, revision: str = "head") -> str | None:
    """Upgrade the database to ``revision``; an up-to-date database is left as it is. Returns
    the revision it was at, read under the migration lock (another process may have upgraded
    it between a read before and this call)."""
    with migrating(url) as connection:
        before = _require_known(connection, url)
        command.upgrade(alembic_config(connection), revision)
        return before


def downgrade(url: str | None, revision: str) -> None:
    """Downgrade the database to ``revision`` (``"base"`` drops every table), for development:
    what the later revisions added goes with their data (energy windows, sweep cells, batch
    sizes, the database's id), and no command offers it."""
    with migrating(url) as connection:
        _require_known(connection, url)
        command.downgrade(alembic_config(connection), revision)


def ensure_schema(url: str | None = None) -> None:
    """Upgrade the database to the head revision if it is behind (commands call this first)."""
    if current_revision(url) != head_revision():
        upgrade(url)


@contextmanager
def upgraded_database(url: str | None = None, *, readonly: bool = False, create: bool = True) -> Iterator[Engine]:
    """An engine on the database at ``url``, upgraded first if it is behind; disposed afterwards.

    What every command that reads or writes results opens (the worker refuses an old schema
    with :func:`require_current_schema` instead). Commands that need existing data (reading
    results, cancelling a batch) pass ``create=False``: a SQLite file the user named (``url`` or
    ``POLSPEC_DB_URL``) that does not exist is then an error, not a new empty database, so a
    mistyped URL is not read as "nothing stored yet". The default database under
    ``POLSPEC_HOME`` is still created, empty. Nor do they add polspec's tables to a database
    that holds other tables and none of polspec's. Commands that only read pass ``readonly``
    too: they take no write lock, and a SQLite file on a read-only mount is read where it is
    at the head revision (one behind it is an error there: it cannot be upgraded).
    """
    path = sqlite_file(parse_url(url))
    if not create:
        require_named_database(url)
    if create:
        ensure_schema(url)
    elif (revision := _existing_revision(url)) != head_revision():
        if is_newer_than_polspec(revision):
            raise _unknown_revision(revision, url)
        if path is not None and on_read_only_storage(path):
            raise PolspecError(f"database {display_url(url)} is at revision {revision or 'none (empty)'}, polspec "
                               f"needs {head_revision()}, and it lies on read-only storage: run polspec db upgrade "
                               "on a copy that can be written")
        upgrade(url)
    engine = make_engine(url, readonly=readonly)
    try:
        yield engine
    finally:
        engine.dispose()


def _existing_revision(url: str | None) -> str | None:
    """The revision of a database that must be polspec's (or empty); a database with tables but
    no polspec revision is refused. An empty ``alembic_version`` is what a downgrade to base
    leaves: polspec's own, and empty."""
    revision, tables = _revision_and_other_tables(url)
    if revision is None and tables:
        named = ", ".join(tables[:3]) + (", ..." if len(tables) > 3 else "")
        raise PolspecError(f"database {display_url(url)} holds tables that are not polspec's ({named}) and none "
                           "of polspec's (is POLSPEC_DB_URL right? polspec db upgrade adds polspec's tables to it)")
    return revision


def require_current_schema(url: str | None = None) -> None:
    """Raise :class:`PolspecError` unless the database is at the head revision."""
    path = sqlite_file(parse_url(url))
    if path is not None and not path.exists():  # "run db upgrade" would create a mistyped file
        raise _no_such_file(url)
    current, head = current_revision(url), head_revision()
    if current == head:
        return
    if is_newer_than_polspec(current):
        raise _unknown_revision(current, url)
    raise PolspecError(
        f"database {display_url(url)} is at revision {current or 'none (empty)'}, "
        f"polspec needs {head}: run polspec db upgrade"
    )


def require_named_database(url: str | None = None) -> None:
    """Raise :class:`PolspecError` where the user named a SQLite file (``url`` or
    ``POLSPEC_DB_URL``) that does not exist: a mistyped one, which "run polspec db upgrade"
    would create, empty. The default database under ``POLSPEC_HOME`` may not exist yet."""
    path = sqlite_file(parse_url(url))
    if path is not None and not path.exists() and (url is not None or database_url_set()):
        raise _no_such_file(url)


def _no_such_file(url: str | None) -> PolspecError:
    check = "is POLSPEC_DB_URL right? " if database_url_set() else ""
    return PolspecError(f"database {display_url(url)}: no such file, nothing has been stored there "
                        f"({check}enqueueing or polspec db upgrade creates it)")


@contextmanager
def migrating(url: str | None = None) -> Iterator[Connection]:
    """A connection inside one transaction, held by one migrating process at a time.

    The transaction commits when the block ends and rolls back if it raises. On SQLite,
    foreign keys are off meanwhile (checked before the commit): Alembic's batch mode copies a
    table and drops the old one, and with foreign keys on, that drop would delete every
    row that references the table through ``ON DELETE CASCADE``.
    """
    engine = make_engine(url)
    sqlite = engine.dialect.name == "sqlite"
    try:
        with _file_lock(engine.url), engine.connect() as connection:
            if sqlite:
                _sqlite_pragma_outside_transaction(connection, "PRAGMA foreign_keys = OFF")
            try:
                with connection.begin():
                    if engine.dialect.name == "postgresql":
                        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK_KEY})
                    yield connection
                    if sqlite:
                        _check_foreign_keys(connection, url)
            finally:
                if sqlite:
                    _sqlite_pragma_outside_transaction(connection, "PRAGMA foreign_keys = ON")
    finally:
        engine.dispose()


def _file_lock(url: URL) -> AbstractContextManager[None]:
    # Next to the database file rather than under POLSPEC_HOME: two processes with different
    # homes that share a database must still take the same lock.
    path = sqlite_file(url)
    return nullcontext() if path is None else file_lock(path.with_name(path.name + ".migrate-lock"), "migration lock")


def _sqlite_pragma_outside_transaction(connection: Connection, pragma: str) -> None:
    # SQLite ignores PRAGMA foreign_keys inside a transaction, and any statement run through
    # the Connection would begin one: go to the driver connection directly.
    connection.connection.driver_connection.execute(pragma)


def _check_foreign_keys(connection: Connection, url: str | None) -> None:
    violations = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
    if violations:
        raise PolspecError(
            f"database {display_url(url)}: migration left {len(violations)} rows with broken "
            f"foreign keys (first: {tuple(violations[0])}); nothing was changed"
        )


def is_newer_than_polspec(revision: str | None) -> bool:
    """Whether ``revision`` is one this polspec does not know: a newer polspec upgraded the database."""
    script = ScriptDirectory.from_config(alembic_config())
    return revision is not None and not any(known.revision == revision for known in script.walk_revisions())


def _require_known(connection: Connection, url: str | None) -> str | None:
    """The database's revision, refused if this polspec does not know it."""
    current = MigrationContext.configure(connection).get_current_revision()
    if is_newer_than_polspec(current):
        raise _unknown_revision(current, url)
    return current


def newer_schema(revision: str) -> str:
    """What to tell a user whose database is at a revision this polspec does not know."""
    return f"revision {revision} is newer than this polspec knows (a newer polspec upgraded it): upgrade polspec"


def _unknown_revision(revision: str, url: str | None) -> DatabaseProblem:
    return DatabaseProblem(display_url(url), newer_schema(revision))
