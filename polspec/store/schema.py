"""The results database: batches of items, and one result per finished item.

The database is the record of every batch; Redis only delivers work. Contract:

- ``batches``: one row per ``polspec enqueue`` call. ``name`` is optional and unique, so
  re-enqueueing under the same name finds the existing batch. Counts per status are not stored:
  they are a ``GROUP BY`` over ``items``, which cannot drift from the truth.
- ``items``: one row per prompt, keyed by the caller's ``item_key``, unique within its batch;
  resuming and retrying go by this key, never by prompt text. An item has a ``prompt`` or
  chat ``messages`` (at least one, enforced by the database).
- ``polspec_meta``: facts about the database itself; ``database_id`` is a random id made
  when the schema is created. Job ids carry it, so a worker never runs a job that was
  enqueued against another database sharing its Redis.
- ``cells``: the configurations of a sweep (a batch of kind ``sweep``); each of its items
  belongs to one cell and names its prompt and repeat in columns, which is what pairs a
  result with the baseline's. Generation batches have no cells.
- ``results``: at most one row per item (``item_id`` is unique), so a retried item can never
  produce two results. Raw outputs (``text``, ``token_ids``) are kept apart from ``metrics``
  so metrics can be recomputed without regenerating. Energy is either measured (joules with
  its source) or NULL with the reason it could not be measured, never 0 or a silent estimate;
  the database enforces this.
- ``energy_windows``: the energy of a batch of items that decoded together, measured as a
  whole, since a meter reads the whole machine and cannot tell one item's joules from
  another's. The results of those items point at it (``results.energy_window_id``); their own
  energy stays unavailable, with the reason.

Timestamps are timezone-aware UTC on every backend. Every constraint is named through
``NAMING_CONVENTION`` so that Alembic can alter them on SQLite (batch mode) and PostgreSQL alike.
A schema change here needs a new revision in ``polspec/migrations/versions/``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Status(StrEnum):
    """The lifecycle shared by items and batches: queued -> running -> done | failed | cancelled."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


_STATUS_CHECK = "status IN ({})".format(", ".join(f"'{status.value}'" for status in Status))


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in and out. SQLite stores no zone, so its naive values are read as UTC.

    Naive datetimes are refused on write: their zone is unknown.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware datetime (UTC)")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# None must be SQL NULL (not the JSON text 'null') so that "IS NULL" and NOT NULL mean what they say.
_JSON = JSON(none_as_null=True)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        datetime: UTCDateTime(),
        str: String(),
        dict[str, Any]: _JSON,
        list[int]: _JSON,
        list[dict[str, Any]]: _JSON,
    }


metadata = Base.metadata


class Meta(Base):
    """One fact about the database (``database_id``), as a key and a text value."""

    __tablename__ = "polspec_meta"

    key: Mapped[str] = mapped_column(primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Batch(Base):
    """One enqueued batch: a generation run over a prompt set, or an evaluation sweep.

    ``spec`` is the validated job specification the batch was created from (models, decoding
    options, input source), kept verbatim for provenance. ``status`` summarises the items for
    listings; ``cancelled`` is set by ``polspec cancel`` and tells workers to skip the rest.
    """

    __tablename__ = "batches"
    __table_args__ = (
        UniqueConstraint("name"),
        CheckConstraint(_STATUS_CHECK, name="status"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[str]  # "generate" or "sweep"
    name: Mapped[str | None]
    spec: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(default=Status.QUEUED.value)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    items: Mapped[list[Item]] = relationship(back_populates="batch", passive_deletes=True)
    cells: Mapped[list[Cell]] = relationship(back_populates="batch", passive_deletes=True)


class Cell(Base):
    """One configuration of a sweep: dataset, draft (None for the target-only baseline),
    strategy, k, prefix and seed, in ``config``. Its items are the dataset's prompts."""

    __tablename__ = "cells"
    __table_args__ = (UniqueConstraint("batch_id", "key"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    batch_id: Mapped[int] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    key: Mapped[str]
    config: Mapped[dict[str, Any]]
    baseline: Mapped[bool]

    batch: Mapped[Batch] = relationship(back_populates="cells")


class Item(Base):
    """One prompt of a batch and where it stands.

    ``params`` holds the item's full decoding parameters (batch defaults merged with the
    item's own). ``attempts`` counts the times a worker started it; ``last_error`` is the
    reason of the latest failure; ``stops`` the times its worker stopped while running it
    (killed, or its lease ran out); ``worker_host`` and ``worker_pid`` the process that last
    took it (the host as :func:`~polspec.processes.this_host_and_boot` names it), so a restarted
    worker on the same machine can tell that a running item's worker died;
    ``heartbeat_at`` is the running worker's lease, renewed while it runs (see ``store.items``).

    A sweep item has its place in the sweep as columns: ``cell_id``, ``prompt_key`` (the
    dataset's id of its prompt) and ``repeat`` (0, 1, ...). Items of different cells with equal
    prompt key and repeat are the pairs the report compares; no cell has two of one pair. Every
    other item has none of the three (NULL): a generation item's ``item_key`` already is its
    whole identity, and copying it into ``prompt_key`` would make "is a sweep item" ambiguous.
    The database enforces all-or-none. ``item_key`` stays the unique name that resuming and
    retrying go by; nothing reads the sweep's coordinates out of it (revision 0005 did, once).
    """

    __tablename__ = "items"
    __table_args__ = (
        UniqueConstraint("batch_id", "item_key"),
        CheckConstraint(_STATUS_CHECK, name="status"),
        CheckConstraint("prompt IS NOT NULL OR messages IS NOT NULL", name="has_input"),
        CheckConstraint("(cell_id IS NULL AND prompt_key IS NULL AND repeat IS NULL)"
                        " OR (cell_id IS NOT NULL AND prompt_key IS NOT NULL AND repeat IS NOT NULL)",
                        name="sweep_coordinates"),
        UniqueConstraint("cell_id", "prompt_key", "repeat"),
        # Progress and recovery count and select items by batch and status.
        Index("ix_items_batch_id_status", "batch_id", "status"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    batch_id: Mapped[int] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    cell_id: Mapped[int | None] = mapped_column(ForeignKey("cells.id", ondelete="CASCADE"), index=True)
    item_key: Mapped[str]
    prompt_key: Mapped[str | None]
    repeat: Mapped[int | None]
    prompt: Mapped[str | None] = mapped_column(Text)
    messages: Mapped[list[dict[str, Any]] | None]
    params: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(default=Status.QUEUED.value)
    attempts: Mapped[int] = mapped_column(default=0)
    stops: Mapped[int] = mapped_column(default=0, server_default="0")
    last_error: Mapped[str | None] = mapped_column(Text)
    worker_host: Mapped[str | None]
    worker_pid: Mapped[int | None]
    heartbeat_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]

    batch: Mapped[Batch] = relationship(back_populates="items")
    cell: Mapped[Cell | None] = relationship()
    result: Mapped[Result | None] = relationship(back_populates="item", passive_deletes=True)


class Result(Base):
    """The output of one finished item.

    ``metrics`` holds every decoder metric; the numeric columns repeat the ones people filter
    and sort by. ``versions`` records package and model versions and hashes, ``timings`` the
    phases in seconds. ``acceptance_rate`` is NULL without a draft model. ``batch_size`` is
    how many sequences the item shared its forwards with, on average over its rounds (1: it
    decoded alone, a latency run; more: a throughput run).
    """

    __tablename__ = "results"
    __table_args__ = (
        UniqueConstraint("item_id"),
        CheckConstraint(
            "(energy_joules IS NOT NULL AND energy_source IS NOT NULL)"
            " OR (energy_joules IS NULL AND energy_unavailable_reason IS NOT NULL)",
            name="energy_accounted",
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    item_id: Mapped[int] = mapped_column(ForeignKey("items.id", ondelete="CASCADE"))
    text: Mapped[str] = mapped_column(Text)
    token_ids: Mapped[list[int]]
    metrics: Mapped[dict[str, Any]]
    prompt_tokens: Mapped[int]
    generated_tokens: Mapped[int]
    decode_tokens_per_s: Mapped[float]
    acceptance_rate: Mapped[float | None]
    batch_size: Mapped[float] = mapped_column(default=1.0, server_default="1")
    energy_joules: Mapped[float | None]
    energy_source: Mapped[str | None]
    energy_unavailable_reason: Mapped[str | None] = mapped_column(Text)
    energy_window_id: Mapped[int | None] = mapped_column(ForeignKey("energy_windows.id", ondelete="SET NULL"),
                                                         index=True)
    backend: Mapped[str]
    device: Mapped[str]
    versions: Mapped[dict[str, Any]]
    timings: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    item: Mapped[Item] = relationship(back_populates="result")


class EnergyWindow(Base):
    """The energy of one continuous batch, from its first round to its end: the sequences
    that decoded together in it, their prefills and the worker's bookkeeping between rounds;
    neither model loading nor probing.

    A worker opens the window at the batch's first round and closes it when the batch ends,
    with the joules and ``source`` (the meter), or NULL joules and the reason. ``ended_at``
    NULL means the batch is still decoding or its end was never recorded (its worker was
    killed): the joules are unknown.
    ``generated_tokens`` and ``sequences`` count every sequence that decoded in the window,
    cancelled and failed ones too, so a window whose results are fewer, or hold fewer tokens,
    spent some of its energy on output that was not kept: its joules are not the kept results' alone.
    """

    __tablename__ = "energy_windows"
    __table_args__ = (
        CheckConstraint(
            "ended_at IS NULL"
            " OR (energy_joules IS NOT NULL AND energy_source IS NOT NULL)"
            " OR (energy_joules IS NULL AND energy_unavailable_reason IS NOT NULL)",
            name="energy_accounted",
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    worker_host: Mapped[str]
    worker_pid: Mapped[int]
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None]
    sequences: Mapped[int] = mapped_column(default=0)
    generated_tokens: Mapped[int] = mapped_column(default=0)
    energy_joules: Mapped[float | None]
    energy_source: Mapped[str | None]
    energy_unavailable_reason: Mapped[str | None] = mapped_column(Text)
