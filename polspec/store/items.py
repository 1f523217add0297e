"""The item lifecycle in the database: create a batch, claim an item, finish or fail it.

The database decides who runs an item, not Redis: a worker *claims* an item in one write
transaction and keeps a lease on it (``heartbeat_at``) while it runs. An item can be claimed
when it is queued, or when it is running but its worker is gone: a dead process on this host,
or a lease older than ``lease_s`` (another host stopped renewing it). So a job that Redis
delivers twice, or that recovery re-enqueues while its first worker still runs, is skipped,
and a result is written at most once (the ``results.item_id`` unique key backs this up).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Engine, exists, func, select, update
from sqlalchemy.orm import Session

from polspec.processes import pid_alive, this_host_and_boot
from polspec.store.engine import session_scope
from polspec.store.schema import Batch, Item, Meta, Result, Status, utcnow

DEFAULT_LEASE_S = 60.0
UNFINISHED = (Status.QUEUED.value, Status.RUNNING.value)
NUL_STAND_IN = "\ufffd"  # what a stored result has for U+0000 (see without_nul)


@dataclass(frozen=True)
class Worker:
    """The process that claims items: where its pid means something (host, pid namespace and
    boot, :func:`~polspec.processes.this_host_and_boot`), and the pid."""

    host: str
    pid: int

    @classmethod
    def this_process(cls) -> Worker:
        return cls(this_host_and_boot(), os.getpid())

    def sees_stopped(self, host: str | None, pid: int | None) -> bool:
        """Whether process ``pid`` of ``host`` is another on this host, where its pid means
        something to this worker, and no longer runs."""
        return host == self.host and pid is not None and pid != self.pid and not pid_alive(pid)

    def holds(self, item: Item) -> bool:
        """Whether the item was last claimed by this worker."""
        return (item.worker_host, item.worker_pid) == (self.host, self.pid)


def database_id(engine: Engine) -> str:
    """The database's random id (made by the migration that created ``polspec_meta``)."""
    with session_scope(engine) as session:
        row = session.get(Meta, "database_id")
        if row is None:  # only if someone deleted it: make a new one rather than fail
            row = Meta(key="database_id", value=uuid.uuid4().hex[:12])
            session.add(row)
        return row.value


def database_now(session: Session) -> datetime:
    """Now, by the clock an item's times (start, lease, end) are written and judged by: the
    database server's on PostgreSQL, where workers on several machines share the work and their
    clocks may disagree by more than a lease (a worker behind would see every other's lease run
    out and requeue running items, and an item's span would mix two clocks); this machine's on
    SQLite, which one machine serves."""
    if session.get_bind().dialect.name == "postgresql":
        return session.scalar(select(func.now()))
    return utcnow()


def owner_gone(item: Item, me: Worker, now: datetime, lease_s: float) -> bool:
    """Whether a running item's worker has stopped: dead on this host, or its lease ran out."""
    if me.sees_stopped(item.worker_host, item.worker_pid):
        return True
    heartbeat = item.heartbeat_at or item.started_at
    return heartbeat is None or now - heartbeat > timedelta(seconds=lease_s)


@dataclass(frozen=True)
class Claim:
    """What a worker needs to run an item it claimed."""

    item_id: int
    item_key: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    params: dict[str, Any]
    spec: dict[str, Any]
    attempt: int


def claim_item(engine: Engine, item_id: int, me: Worker, lease_s: float = DEFAULT_LEASE_S) -> Claim | str:
    """Mark the item running for ``me`` and return it, or return why it is not to be run."""
    with session_scope(engine) as session:
        item = _locked_item(session, item_id)
        if item is None:
            return f"item {item_id} is not in the database"
        now = database_now(session)
        if item.batch.status == Status.CANCELLED.value or item.status == Status.CANCELLED.value:
            return f"item {item_id} is cancelled"
        if item.status in (Status.DONE.value, Status.FAILED.value):
            return f"item {item_id} is already {item.status}"
        if item.status == Status.RUNNING.value and not me.holds(item):
            if not owner_gone(item, me, now, lease_s):
                return f"item {item_id} is running on {item.worker_host} (pid {item.worker_pid})"
            item.stops += 1  # taken over: its worker stopped while running it
        item.status = Status.RUNNING.value
        item.attempts += 1
        item.worker_host, item.worker_pid = me.host, me.pid
        item.started_at = item.heartbeat_at = now
        item.last_error = None
        if item.batch.status == Status.QUEUED.value:
            item.batch.status = Status.RUNNING.value
        return Claim(item.id, item.item_key, item.prompt, item.messages, dict(item.params), item_spec(item),
                     item.attempts)


def item_spec(item: Item) -> dict[str, Any]:
    """The batch's spec as it applies to this item: a sweep item's cell says which draft, and
    may set the batch size it decodes at."""
    spec = dict(item.batch.spec)
    if item.cell is not None:
        spec["draft"] = item.cell.config["draft"]
        spec["batch"] = item.cell.config.get("batch")
    return spec


@dataclass(frozen=True)
class Pairing:
    """What an item needs from a batched worker: its models, and the batch size it asks for
    (a sweep cell's ``batch``; None lets the worker choose). Items with equal pairings may
    decode in one batch; a sweep item only with its own cell's, so that a cell's speed is its own."""

    target: str
    draft: str | None
    batch: int | None
    cell: int | None


def item_pairings(engine: Engine, item_ids: list[int]) -> dict[int, Pairing]:
    """The pairing of each item that exists and may still run (queued, or running elsewhere);
    a read, so that a worker can choose its batch's next items before claiming them."""
    with session_scope(engine, reads_only=True) as session:
        items = session.scalars(select(Item).where(Item.id.in_(item_ids), Item.status.in_(UNFINISHED)))
        return {item.id: Pairing((spec := item_spec(item))["target"], spec.get("draft"), spec.get("batch"),
                                 item.cell_id) for item in items}


def renew_leases(engine: Engine, item_ids: list[int], me: Worker) -> int:
    """Refresh the lease on running items; returns how many are still this worker's."""
    with session_scope(engine) as session:
        return session.execute(
            update(Item)
            .where(Item.id.in_(item_ids), Item.status == Status.RUNNING.value,
                   Item.worker_host == me.host, Item.worker_pid == me.pid)
            .values(heartbeat_at=database_now(session))
        ).rowcount


def cancelled_items(engine: Engine, item_ids: list[int]) -> set[int]:
    """Which of these items (or their batches) are cancelled, or gone from the database."""
    with session_scope(engine, reads_only=True) as session:
        live = dict(session.execute(
            select(Item.id, Batch.status).join(Batch)
            .where(Item.id.in_(item_ids), Item.status != Status.CANCELLED.value)).all())
    return {item_id for item_id in item_ids if live.get(item_id, Status.CANCELLED.value) == Status.CANCELLED.value}


def finish_item(engine: Engine, item_id: int, me: Worker, result: Result) -> bool:
    """Store the result and mark the item done, in one transaction; whether the item has this
    worker's result now.

    An item that another worker claimed meanwhile keeps what it has (False). One a recover
    queued again while this worker still held it (its lease ran out while the database was
    away) and no worker has claimed since takes the result: it would be decoded again for
    nothing. One already done by this worker has its result (the commit went through, its
    answer was lost to the outage): True, and nothing is written twice.
    """
    with session_scope(engine) as session:
        item = _locked_item(session, item_id)
        if item is None or not me.holds(item):
            return False
        stored = session.scalar(select(Result.id).where(Result.item_id == item_id)) is not None
        if stored or item.status not in (Status.RUNNING.value, Status.QUEUED.value):
            return stored and item.status == Status.DONE.value
        result.item_id = item_id
        session.add(without_nul(result))
        item.status = Status.DONE.value
        item.finished_at = database_now(session)
        item.last_error = None
        settle_batch(session, item.batch)
        return True


def without_nul(result: Result) -> Result:
    """``result`` with each U+0000 in its text and draft spans replaced by U+FFFD, on every
    backend, and how many in its metrics (``nul_replaced``); its ``token_ids`` keep what was
    generated. A byte-level tokenizer decodes its token for byte 0 to U+0000, which
    PostgreSQL's text type refuses: the result would be lost and its item failed."""
    count = result.text.count("\0")
    if count:
        result.text = result.text.replace("\0", NUL_STAND_IN)
        result.metrics = result.metrics | {"nul_replaced": count}
        if "spans" in result.metrics:
            result.metrics["spans"] = [[text.replace("\0", NUL_STAND_IN), accepted]
                                       for text, accepted in result.metrics["spans"]]
    return result


def fail_item(engine: Engine, item_id: int, me: Worker, reason: str, *, final: bool,
              status: Status = Status.FAILED) -> Status | None:
    """Record a failure. ``final`` marks the item ``status``; otherwise it goes back to queued for
    a retry. Returns the status written (None: the item is not this worker's).

    The batch's status, read under its lock, has the last word on a cancellation: an item
    stopped because its batch was cancelled is queued again if the batch was resumed meanwhile
    (``retry --cancelled`` reopens only cancelled items, and this one was still running; its job
    has ended, so recover gives it one: a worker's idle maintenance, a burst's end), and
    one that would be retried in a cancelled batch is cancelled (its retry would be skipped, and
    the resume would not see it)."""
    with session_scope(engine) as session:
        item = _locked_item(session, item_id)
        if item is None or item.status != Status.RUNNING.value or not me.holds(item):
            return None
        session.refresh(item.batch, with_for_update=True)  # the item's lock first, as claim and finish take them
        batch_cancelled = item.batch.status == Status.CANCELLED.value
        if status is Status.CANCELLED and not batch_cancelled:
            final = False
        elif batch_cancelled and not final:
            final, status = True, Status.CANCELLED
        item.last_error = reason
        item.status = status.value if final else Status.QUEUED.value
        if final:
            item.finished_at = database_now(session)
            settle_batch(session, item.batch)
        return Status(item.status)


def _locked_item(session: Session, item_id: int) -> Item | None:
    # FOR UPDATE serialises claims on PostgreSQL; SQLite already holds the write lock (BEGIN IMMEDIATE).
    return session.scalar(select(Item).where(Item.id == item_id).with_for_update())


def max_tokens() -> ColumnElement[int]:
    """An item's ``max_tokens``, read in SQL from its parameters: its job's timeout is sized by
    it, and a sweep's hundreds of thousands of parameter records need not be parsed for it."""
    return Item.params["max_tokens"].as_integer()


def reopen_items(session: Session, batch: Batch, statuses: tuple[Status, ...]) -> list[tuple[int, int]]:
    """Mark a batch's items of these statuses queued again, with their count of stopped workers
    cleared, reopening the batch (cancelled or finished) when there are any; returns them as
    (item id, max_tokens) for their jobs, by id."""
    # By the condition, not the ids: a sweep's may be more than SQLite takes in one statement.
    # Stops from 0: an item failed for stopping its worker on every try gets as many tries again.
    chosen = (Item.batch_id == batch.id, Item.status.in_([status.value for status in statuses]))
    reopen = update(Item).where(*chosen).values(status=Status.QUEUED.value, finished_at=None, stops=0)
    if session.get_bind().dialect.update_returning:
        # One statement: on PostgreSQL an item failing between a read and an update would be
        # reopened without a job.
        rows = session.execute(reopen.returning(Item.id, max_tokens())).all()
    else:  # SQLite before 3.35, whose write lock, taken at BEGIN, keeps the two statements alike
        rows = session.execute(select(Item.id, max_tokens()).where(*chosen)).all()
        session.execute(reopen)
    if rows:
        batch.status = Status.RUNNING.value  # no longer cancelled: settle_batch judges it by its items
        settle_batch(session, batch)
    return sorted((item_id, tokens) for item_id, tokens in rows)  # by id, the enqueue order


def settle_batch(session: Session, batch: Batch) -> None:
    """Mark the batch by its items: queued while every unfinished one is queued and none has
    finished (nothing has run, or a retry queued all of it again), running while some run or
    wait beside finished ones, else done (or failed)."""
    session.flush()
    # On PostgreSQL two workers finishing a batch's last items at once would each read the
    # other's as running and leave the batch running for good: the second waits here for the
    # first to commit, then reads its item done; and a cancel committed meanwhile is read here,
    # not overwritten. (SQLite: the write lock was taken at BEGIN.)
    session.refresh(batch, with_for_update=True)
    if batch.status == Status.CANCELLED.value:
        return

    def any_item(*statuses: str) -> bool:
        # One index probe per status (ix_items_batch_id_status): this runs at every finish,
        # inside the write lock, and a DISTINCT over the batch's statuses read all its items.
        return session.scalar(select(exists().where(Item.batch_id == batch.id, Item.status.in_(statuses))))

    if any_item(Status.QUEUED.value) and not any_item(*(status.value for status in Status if status != Status.QUEUED)):
        batch.status = Status.QUEUED.value
    elif any_item(*UNFINISHED):
        batch.status = Status.RUNNING.value
    elif any_item(Status.FAILED.value):
        batch.status = Status.FAILED.value
    else:
        batch.status = Status.DONE.value
