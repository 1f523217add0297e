"""Sweep items store their prompt and repeat as columns, beside their cell.

Until now the pairing of a sweep's results (same prompt and repeat in another cell) rested on
the item key ``<cell key>/<prompt key>/r<repeat>``, re-parsed by the report. This revision adds
``items.prompt_key`` and ``items.repeat``, fills them for every existing sweep item from that
key, and then makes the database hold the contract: a sweep item has all of cell, prompt key
and repeat, any other item none, and no cell has two items of one prompt and repeat.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from polspec.errors import PolspecError

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out here rather than imported from the schema, so that this revision keeps meaning
# what it meant when the schema moves on.
_SWEEP_COORDINATES = ("(cell_id IS NULL AND prompt_key IS NULL AND repeat IS NULL)"
                      " OR (cell_id IS NOT NULL AND prompt_key IS NOT NULL AND repeat IS NOT NULL)")

_items = sa.table("items", sa.column("id", sa.Integer), sa.column("cell_id", sa.Integer),
                  sa.column("item_key", sa.String), sa.column("prompt_key", sa.String),
                  sa.column("repeat", sa.Integer))
_cells = sa.table("cells", sa.column("id", sa.Integer), sa.column("key", sa.String))


def upgrade() -> None:
    with op.batch_alter_table("items") as batch:
        batch.add_column(sa.Column("prompt_key", sa.String(), nullable=True))
        batch.add_column(sa.Column("repeat", sa.Integer(), nullable=True))
    _backfill(op.get_bind())
    with op.batch_alter_table("items") as batch:
        batch.create_check_constraint(op.f("ck_items_sweep_coordinates"), _SWEEP_COORDINATES)
        batch.create_unique_constraint(op.f("uq_items_cell_id_prompt_key_repeat"), ["cell_id", "prompt_key", "repeat"])


def downgrade() -> None:
    with op.batch_alter_table("items") as batch:
        batch.drop_constraint(op.f("uq_items_cell_id_prompt_key_repeat"), type_="unique")
        batch.drop_constraint(op.f("ck_items_sweep_coordinates"), type_="check")
        batch.drop_column("repeat")
        batch.drop_column("prompt_key")


def _backfill(connection: sa.Connection) -> None:
    """Set the prompt key and repeat of every sweep item (one with a cell) from its item key."""
    # Read every key before writing any: updating a table while a cursor still walks it is
    # undefined on SQLite. Ids and keys of even a large sweep fit in memory.
    rows = connection.execute(sa.select(_items.c.id, _items.c.item_key, _cells.c.key)
                              .join(_cells, _cells.c.id == _items.c.cell_id)).all()
    values = []
    for item_id, item_key, cell_key in rows:
        prompt_key, repeat = parse_sweep_item_key(item_key, cell_key)
        values.append({"item_id": item_id, "new_prompt_key": prompt_key, "new_repeat": repeat})
    if values:  # one executemany; it refuses an empty list
        connection.execute(_items.update().where(_items.c.id == sa.bindparam("item_id"))
                           .values(prompt_key=sa.bindparam("new_prompt_key"), repeat=sa.bindparam("new_repeat")),
                           values)


def parse_sweep_item_key(item_key: str, cell_key: str) -> tuple[str, int]:
    """The (prompt key, repeat) of the sweep item key ``<cell key>/<prompt key>/r<repeat>``.

    The prompt key may itself contain ``/`` (dataset files name their own ids), so it is what
    lies between the cell key and the last ``/r``. A key of another shape is an error naming it.
    """
    rest = item_key.removeprefix(f"{cell_key}/")
    prompt_key, _, repeat = rest.rpartition("/")
    number = repeat.removeprefix("r")
    if rest == item_key or not prompt_key or number == repeat or not (number.isascii() and number.isdigit()):
        raise PolspecError(f"sweep item {item_key!r} of cell {cell_key!r} is not named "
                           f"'{cell_key}/<prompt>/r<repeat>'; cannot migrate it")
    return prompt_key, int(number)
