"""Engines and sessions for the results database, set up for many concurrent writers.

Any SQLAlchemy URL works (``POLSPEC_DB_URL``); the default is SQLite under ``POLSPEC_HOME``.
On SQLite every connection gets WAL, ``synchronous=NORMAL``, a busy timeout
(``POLSPEC_DB_BUSY_TIMEOUT_MS``, default 30000) and enforced foreign keys, and every
transaction starts with ``BEGIN IMMEDIATE``: with a plain deferred ``BEGIN`` a transaction
that reads and then writes fails at once with "database is locked" when another process wrote
in between, whatever the busy timeout. Other databases are left as their driver sets them up.

Errors that come from the database's surroundings (file cannot be opened, server unreachable,
locked beyond the timeout, read-only) are raised as :class:`DatabaseProblem` naming the URL, with
the password hidden; those from a database operation are its subclass :class:`DatabaseFailure`.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

from sqlalchemy import URL, Engine, create_engine, event, make_url
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError
from sqlalchemy.orm import Session

from polspec.errors import DatabaseFailure, DatabaseProblem, PolspecError
from polspec.files import user_path
from polspec.settings import database_url, db_busy_timeout_ms


def display_url(url: str | URL | None = None) -> str:
    """The URL as it may be shown to users: the password is replaced by ``***``, and the
    database is as typed (SQLAlchemy would percent-encode ``:memory:`` and a path's Polish
    letters)."""
    parsed = parse_url(url)
    bare = URL.create(parsed.drivername, parsed.username, parsed.password, parsed.host, parsed.port,
                      query=parsed.query)
    head, mark, query = bare.render_as_string(hide_password=True).partition("?")
    return head + ("" if parsed.database is None else "/" + parsed.database) + mark + query


def make_engine(url: str | URL | None = None, *, readonly: bool = False) -> Engine:
    """An engine for ``url`` (default ``POLSPEC_DB_URL``), set up as the module docstring says.

    Creates the directory of a SQLite file. With ``readonly`` every transaction is read-only:
    SQLite opens the file with ``mode=ro`` (the file must exist) and takes no write lock, so
    long queries never hold up writers; PostgreSQL runs ``READ ONLY`` transactions.
    """
    parsed = parse_url(url)
    shown = display_url(parsed)
    sqlite = parsed.get_backend_name() == "sqlite"
    timeout_ms = db_busy_timeout_ms() if sqlite else 0
    if sqlite and parsed.database in (None, "", ":memory:"):
        # Each connection would get its own empty database: the schema an upgrade writes would
        # be gone for the next command, which would ask for the upgrade again.
        raise DatabaseProblem(shown, "an in-memory SQLite database lasts one connection; give a file, "
                                     "e.g. sqlite:///results/polspec.db")
    if sqlite and parsed.database.startswith("file:"):
        # SQLite's own URI form would slip past the checks above and below, which read a path.
        raise DatabaseProblem(shown, "give the SQLite file as a path, e.g. sqlite:///results/polspec.db, "
                                     "not as a file: URI")
    path = sqlite_file(parsed)
    if path is not None and path.is_dir():  # SQLite would only say "disk I/O error"
        raise DatabaseProblem(shown, "a directory, not a database file")
    if path is not None and not readonly:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise DatabaseProblem(shown, f"cannot create {path.parent}: {error.strerror}") from error
    if path is not None and readonly:
        # A URI so that SQLite itself refuses every write, whatever SQL a user sends.
        path = path.resolve()
        query = {"mode": "ro", "uri": "true"}
        if on_read_only_storage(path) and not path.with_name(path.name + "-wal").exists():
            # SQLite opens a WAL database only where it can make the shared-memory file beside
            # it. On read-only storage no writer can be at work and, with no WAL left, the file
            # holds everything: read it as it stands (a copy on a read-only mount, a snapshot).
            query["immutable"] = "1"
        parsed = parsed.set(database=f"file:{quote(str(path))}", query=query)

    options: dict[str, object] = {}
    if not sqlite:
        # A long-lived worker outlives server restarts and idle-connection timeouts.
        options["pool_pre_ping"] = True
    if readonly and parsed.get_backend_name() == "postgresql":
        options["execution_options"] = {"postgresql_readonly": True}
        if parsed.get_driver_name() == "psycopg":
            # Every statement prepared, so sent by the extended protocol, which takes one
            # statement: in a simple query "COMMIT; DELETE ..." would end the read-only
            # transaction and write (``results sql`` sends what users type).
            options["connect_args"] = {"prepare_threshold": 0}
    try:
        engine = create_engine(parsed, **options)
    except (ImportError, NoSuchModuleError) as error:
        raise DatabaseProblem(shown, f"no driver for it is installed ({error})") from error
    except (ValueError, TypeError) as error:  # an option of the URL's query the driver cannot read
        raise DatabaseProblem(shown, f"an option of the URL is wrong ({error})") from error

    @event.listens_for(engine, "handle_error")
    def _to_polspec_error(context: ExceptionContext) -> None:
        # PEP 249: OperationalError is the database's operation failing, not the program's
        # logic (constraint violations are IntegrityError and stay catchable as such). SQLite
        # also reports SQL syntax errors this way, which suits ``results sql`` as one line too.
        # So is a file that is no SQLite database, or a damaged one, though SQLite says it
        # through a plain DatabaseError.
        damaged = getattr(context.original_exception, "sqlite_errorname", "") in ("SQLITE_NOTADB", "SQLITE_CORRUPT")
        failed = isinstance(context.sqlalchemy_exception, OperationalError) or damaged
        # Connecting, the driver refuses what the URL asks (PostgreSQL's `?sslmod=` typo) with a
        # ProgrammingError; a role that may not read or write a table gets SQLSTATE 42501. Told
        # in one line too, but as the setup's fault, not an outage to wait out: a worker fails
        # the item with the reason rather than decode it again and again.
        connecting = context.connection is None and isinstance(context.sqlalchemy_exception, DBAPIError)
        refused = getattr(context.original_exception, "sqlstate", None) == "42501"
        if context.is_pre_ping or not (failed or connecting or refused):
            return
        reason = " ".join(str(context.original_exception).split())
        if sqlite and "locked" in reason:
            reason += f" (busy timeout {timeout_ms} ms; POLSPEC_DB_BUSY_TIMEOUT_MS sets it)"
        raise (DatabaseFailure if failed else DatabaseProblem)(shown, reason)

    if sqlite:
        _set_up_sqlite(engine, timeout_ms=timeout_ms, readonly=readonly)
    return engine


@contextmanager
def session_scope(engine: Engine, *, reads_only: bool = False) -> Iterator[Session]:
    """A session in one transaction: committed when the block ends, rolled back if it raises.

    Objects stay readable after the commit (``expire_on_commit=False``). ``reads_only``: the
    block only reads, so on SQLite it takes no write lock, and another process writing for
    longer than the busy timeout (a large sweep's enqueue, a migration) does not make it fail;
    a worker's once-a-second cancel check failing so dropped every item it was decoding.
    """
    bind = engine.execution_options(**{_READS_ONLY: True}) if reads_only else engine
    with Session(bind, expire_on_commit=False) as session, session.begin():
        yield session


_READS_ONLY = "polspec_reads_only"


def sqlite_file(url: URL) -> Path | None:
    """The database file of a SQLite URL; None for other databases, in-memory ones and ``file:`` URIs."""
    database = url.database
    if url.get_backend_name() != "sqlite" or not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def on_read_only_storage(path: Path) -> bool:
    """Whether ``path`` lies on a file system mounted read-only (where nobody can write it; a
    folder only closed to this user is another matter: its owner may be writing)."""
    try:
        return bool(os.statvfs(path.parent).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def parse_url(url: str | URL | None = None) -> URL:
    """``url`` (default ``POLSPEC_DB_URL``) parsed, or a :class:`PolspecError` saying why it is not one."""
    try:
        parsed = make_url(url if url is not None else database_url())
    except (ArgumentError, ValueError) as error:  # ValueError: a port that is no number
        where = "" if url is not None else " (POLSPEC_DB_URL)"
        raise PolspecError(f"not a database URL{where}: {error}") from error
    if parsed.get_backend_name() == "sqlite" and (parsed.database or "").startswith("~"):
        # sqlite:///~/wyniki.db means the home directory, as in a shell, not a folder named "~"
        parsed = parsed.set(database=str(user_path(parsed.database)))
    # A bare postgresql:// means psycopg2 to SQLAlchemy; polspec ships psycopg 3.
    return parsed.set(drivername="postgresql+psycopg") if parsed.drivername == "postgresql" else parsed


def _set_up_sqlite(engine: Engine, *, timeout_ms: int, readonly: bool) -> None:
    # SQLAlchemy's documented recipe for SQLite transactions: the driver must not emit its own
    # BEGIN (isolation_level=None), then the "begin" event emits the one we want.
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, connection_record) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        # The busy timeout first: switching to WAL needs a lock another process may hold.
        cursor.execute(f"PRAGMA busy_timeout = {timeout_ms}")
        if not readonly:
            cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()
        if readonly:  # mode=ro covers the database file, not another one ATTACH would create
            dbapi_connection.set_authorizer(_refuse_attach)

    # A writer's transaction takes the write lock at once: one that read first and wrote later
    # could not get it while another held it, and would fail at once, whatever the busy timeout.
    # A reader's needs none: in WAL mode it reads beside a writer without waiting.
    @event.listens_for(engine, "begin")
    def _on_begin(connection) -> None:
        reads_only = readonly or connection.get_execution_options().get(_READS_ONLY, False)
        connection.exec_driver_sql("BEGIN" if reads_only else "BEGIN IMMEDIATE")


def _refuse_attach(action: int, *_) -> int:
    return sqlite3.SQLITE_DENY if action == sqlite3.SQLITE_ATTACH else sqlite3.SQLITE_OK
