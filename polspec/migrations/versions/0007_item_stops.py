"""How many times an item's worker stopped while running it (killed, or its lease ran out).

``recover`` fails an item whose worker stopped on each of its tries, as an item whose error
repeats fails after its retries, instead of queueing it again for ever: a prompt that gets its
worker killed for memory took down worker after worker. ``attempts`` cannot tell: it counts
every claim, retries after ordinary errors included. Items written before this revision
start at 0.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("items") as batch:
        batch.add_column(sa.Column("stops", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("items") as batch:
        batch.drop_column("stops")
