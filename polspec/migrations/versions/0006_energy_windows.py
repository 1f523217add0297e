"""The energy of a batch of items that decoded together, measured as one window.

A meter reads the whole machine, so items decoded in one batch cannot each have their own
joules; until now a batched worker recorded none at all. This revision adds
``energy_windows`` (one row per continuous batch: joules or the reason there are none, and
the tokens and sequences the window decoded) and ``results.energy_window_id``, which names the
window a result's item decoded in. Results written before it decoded in no recorded window.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "energy_windows",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("worker_host", sa.String(), nullable=False),
        sa.Column("worker_pid", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("sequences", sa.Integer(), nullable=False),
        sa.Column("generated_tokens", sa.Integer(), nullable=False),
        sa.Column("energy_joules", sa.Double(), nullable=True),
        sa.Column("energy_source", sa.String(), nullable=True),
        sa.Column("energy_unavailable_reason", sa.Text(), nullable=True),
        sa.CheckConstraint("ended_at IS NULL"
                           " OR (energy_joules IS NOT NULL AND energy_source IS NOT NULL)"
                           " OR (energy_joules IS NULL AND energy_unavailable_reason IS NOT NULL)",
                           name=op.f("ck_energy_windows_energy_accounted")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_energy_windows")),
    )
    with op.batch_alter_table("results") as batch:
        batch.add_column(sa.Column("energy_window_id", sa.Integer(), nullable=True))
        batch.create_index(batch.f("ix_results_energy_window_id"), ["energy_window_id"])
        batch.create_foreign_key(batch.f("fk_results_energy_window_id_energy_windows"), "energy_windows",
                                 ["energy_window_id"], ["id"], ondelete="SET NULL")


def downgrade() -> None:
    with op.batch_alter_table("results") as batch:
        batch.drop_constraint(batch.f("fk_results_energy_window_id_energy_windows"), type_="foreignkey")
        batch.drop_index(batch.f("ix_results_energy_window_id"))
        batch.drop_column("energy_window_id")
    op.drop_table("energy_windows")
