"""Alembic environment for polspec, configured from code by :mod:`polspec.store.migrate`.

``polspec.store.migrate`` hands in a connection that already holds the migration lock and its
transaction. Run any other way (say ``alembic revision --autogenerate`` through
``polspec.store.migrate.alembic_config()``), it opens one the same way on ``POLSPEC_DB_URL``.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from polspec.settings import database_url
from polspec.store.migrate import migrating
from polspec.store.schema import metadata


def run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        # SQLite cannot ALTER most of a table: batch mode recreates it. On PostgreSQL batch
        # operations are plain ALTERs, so one set of revisions serves both.
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("polspec migrations run online only: use polspec db upgrade")

given = context.config.attributes.get("connection")
if given is not None:
    run(given)
else:
    with migrating(database_url()) as connection:
        run(connection)
