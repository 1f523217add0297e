"""A random id per database (job ids carry it); the worker's pid and lease on items.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    meta = op.create_table(
        "polspec_meta",
        sa.Column("key", sa.String(), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_polspec_meta")),
    )
    op.bulk_insert(meta, [{"key": "database_id", "value": uuid.uuid4().hex[:12]}])
    with op.batch_alter_table("items") as batch:
        batch.add_column(sa.Column("worker_pid", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("items") as batch:
        batch.drop_column("heartbeat_at")
        batch.drop_column("worker_pid")
    op.drop_table("polspec_meta")
