"""Results record the batch size their item decoded at (mean sequences per forward).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Every result written before batching decoded alone.
    with op.batch_alter_table("results") as batch:
        batch.add_column(sa.Column("batch_size", sa.Double(), nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table("results") as batch:
        batch.drop_column("batch_size")
