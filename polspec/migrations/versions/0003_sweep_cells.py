"""Sweep cells: one row per configuration of a sweep, and the cell of each sweep item.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "cells",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("batch_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("baseline", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], name=op.f("fk_cells_batch_id_batches"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_cells")),
        sa.UniqueConstraint("batch_id", "key", name=op.f("uq_cells_batch_id_key")),
    )
    with op.batch_alter_table("items") as batch:
        batch.add_column(sa.Column("cell_id", sa.Integer(), nullable=True))
        batch.create_foreign_key(op.f("fk_items_cell_id_cells"), "cells", ["cell_id"], ["id"], ondelete="CASCADE")
        batch.create_index(op.f("ix_items_cell_id"), ["cell_id"])


def downgrade() -> None:
    with op.batch_alter_table("items") as batch:
        batch.drop_index(op.f("ix_items_cell_id"))
        batch.drop_constraint(op.f("fk_items_cell_id_cells"), type_="foreignkey")
        batch.drop_column("cell_id")
    op.drop_table("cells")
