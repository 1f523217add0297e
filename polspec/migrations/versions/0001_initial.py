"""Initial schema: batches, items, results.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATUS_CHECK = "status IN ('queued', 'running', 'done', 'failed', 'cancelled')"


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=True),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(STATUS_CHECK, name=op.f("ck_batches_status")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
        sa.UniqueConstraint("name", name=op.f("uq_batches_name")),
    )
    op.create_table(
        "items",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("batch_id", sa.Integer(), nullable=False),
        sa.Column("item_key", sa.String(), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=True),
        sa.Column("messages", sa.JSON(), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("worker_host", sa.String(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(STATUS_CHECK, name=op.f("ck_items_status")),
        sa.CheckConstraint("prompt IS NOT NULL OR messages IS NOT NULL", name=op.f("ck_items_has_input")),
        sa.ForeignKeyConstraint(
            ["batch_id"], ["batches.id"], name=op.f("fk_items_batch_id_batches"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_items")),
        sa.UniqueConstraint("batch_id", "item_key", name=op.f("uq_items_batch_id_item_key")),
    )
    op.create_index("ix_items_batch_id_status", "items", ["batch_id", "status"])
    op.create_table(
        "results",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("item_id", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("token_ids", sa.JSON(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("generated_tokens", sa.Integer(), nullable=False),
        sa.Column("decode_tokens_per_s", sa.Double(), nullable=False),
        sa.Column("acceptance_rate", sa.Double(), nullable=True),
        sa.Column("energy_joules", sa.Double(), nullable=True),
        sa.Column("energy_source", sa.String(), nullable=True),
        sa.Column("energy_unavailable_reason", sa.Text(), nullable=True),
        sa.Column("backend", sa.String(), nullable=False),
        sa.Column("device", sa.String(), nullable=False),
        sa.Column("versions", sa.JSON(), nullable=False),
        sa.Column("timings", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "(energy_joules IS NOT NULL AND energy_source IS NOT NULL)"
            " OR (energy_joules IS NULL AND energy_unavailable_reason IS NOT NULL)",
            name=op.f("ck_results_energy_accounted"),
        ),
        sa.ForeignKeyConstraint(
            ["item_id"], ["items.id"], name=op.f("fk_results_item_id_items"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_results")),
        sa.UniqueConstraint("item_id", name=op.f("uq_results_item_id")),
    )


def downgrade() -> None:
    op.drop_table("results")
    op.drop_index("ix_items_batch_id_status", table_name="items")
    op.drop_table("items")
    op.drop_table("batches")
