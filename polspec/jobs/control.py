"""Bring Redis back in line with the database: recover, cancel, retry.

The database is the record; Redis only delivers. Whatever Redis lost (a flush, a restart
without AOF, a worker killed mid-job), :func:`recover` finds the unfinished items and
re-enqueues those whose job cannot finish on its own:

- a *running* item whose worker is gone (dead pid on this host, or a lease that ran out) goes
  back to queued and gets a fresh job; unless its worker has now stopped while running it
  ``1 + RETRIES`` times (killed for memory, say, counted in ``Item.stops``): then it fails with
  that reason, as an item whose error repeats does, rather than take down worker after worker;
- so does, at once and with no stop counted, a running item that a worker recovering for
  itself left behind (claimed by it, and not among the items it decodes: the database failed
  as it finished, and another worker skipped its retried job while the lease still ran);
- a *queued* item gets a fresh job when its job is missing, already ended, not in its queue,
  unreadable, or names another function than :data:`~polspec.jobs.queue.JOB_FUNCTION` (queued
  by an older polspec, before the job function moved), or was started by a worker that stopped
  before it claimed the item.

Items of cancelled batches get no job; a running one whose worker is gone is marked cancelled
(it would read running for ever, and ``polspec retry --cancelled`` resumes it with the rest).
Re-enqueueing replaces the item's job (the job id is deterministic), so running recover twice
never delivers an item twice.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field

import redis
from rq.job import JobStatus
from rq.worker import BaseWorker
from sqlalchemy import Engine, select, update

from polspec.errors import PolspecError
from polspec.jobs.queue import (JOB_FUNCTION, RETRIES, delete_jobs, enqueue_items, job_id, job_states,
                               make_queue, queue_name)
from polspec.store.engine import session_scope
from polspec.store.items import (DEFAULT_LEASE_S, Worker, database_id, database_now, max_tokens, owner_gone,
                                 reopen_items, settle_batch)
from polspec.store.queries import find_batch
from polspec.store.schema import Batch, Item, Status

_WAITING = {JobStatus.QUEUED, JobStatus.DEFERRED, JobStatus.SCHEDULED}
GONE_EVERY_TIME = f"its worker stopped while running it, {1 + RETRIES} times (killed for memory?)"


@dataclass
class Requeued:
    """Items given a fresh job, by the reason they needed one; running items failed instead,
    their worker having stopped on every attempt; and running items of cancelled batches
    marked cancelled, their worker gone."""

    reasons: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    failed: int = 0
    cancelled: int = 0

    @property
    def total(self) -> int:
        return sum(self.reasons.values())

    @property
    def changed(self) -> bool:
        """Whether recover changed anything."""
        return bool(self.total or self.failed or self.cancelled)

    def describe(self) -> str:
        """In words: "re-enqueued 4 items (3 job missing, 1 worker gone)", and "failed 2 items
        ..." where any failed."""
        said = []
        if self.total:
            reasons = ", ".join(f"{count} {reason}" for reason, count in self.reasons.items())
            said.append(f"re-enqueued {counted(self.total)} ({reasons})")
        if self.failed:
            said.append(f"failed {counted(self.failed)} whose worker stopped while running "
                        f"{'it' if self.failed == 1 else 'them'}, {1 + RETRIES} times (killed for memory?)")
        if self.cancelled:
            said.append(f"marked {counted(self.cancelled)} of cancelled batches cancelled, whose worker stopped "
                        f"while running {'it' if self.cancelled == 1 else 'them'}")
        return "; ".join(said)


def counted(count: int, noun: str = "item") -> str:
    """``count`` and ``noun``, plural where the count asks for it: "1 item", "2 failed items"."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def recover(engine: Engine, connection: redis.Redis, batch_id: int | None = None,
            me: Worker | None = None, lease_s: float = DEFAULT_LEASE_S,
            holding: Collection[int] | None = None) -> Requeued:
    """Re-enqueue the unfinished items (of one batch, or all) that no job will finish.
    ``holding``: for a worker ``me``, the items it decodes now; its other running items are
    left behind."""
    me = me or Worker.this_process()
    db_id = database_id(engine)
    # Queued items as three columns, not whole rows: a resumed sweep may have hundreds of
    # thousands, and loading them as objects (prompts, the batch's spec once per item) cost
    # a minute and gigabytes. Running items, a few per worker, are read whole for owner_gone.
    batch_only = [Item.batch_id == batch_id] if batch_id is not None else []
    cancelled = Batch.status == Status.CANCELLED.value
    # Reads only (each change below is a compare-and-set of its own): on SQLite a write lock
    # held while reading every queued and running item held up every worker's claim and finish.
    with session_scope(engine, reads_only=True) as session:
        now = database_now(session)
        queued = session.execute(select(Item.id, Item.batch_id, max_tokens()).join(Batch)
                                 .where(Item.status == Status.QUEUED.value, ~cancelled, *batch_only)
                                 .order_by(Item.id)).all()
        running = session.execute(select(Item, cancelled).join(Batch)
                                  .where(Item.status == Status.RUNNING.value, *batch_only).order_by(Item.id)).all()
        # Every batch's, cancelled ones too: on PostgreSQL each read sees what was committed
        # before it, and a batch cancelled since the items were read is still theirs (a worker
        # skips their jobs).
        targets = select(Batch.id, Batch.spec["target"].as_string())
        if batch_id is not None:
            targets = targets.where(Batch.id == batch_id)
        queues = {batch: queue_name(target) for batch, target in session.execute(targets)}
    jobs = job_states(connection, [job_id(db_id, item_id) for item_id, _, _ in queued])
    waiting_ids: dict[str, set[str]] = {}
    report = Requeued()
    to_enqueue: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for item, of_cancelled_batch in running:
        left_behind = holding is not None and me.holds(item) and item.id not in holding
        if not left_behind and not owner_gone(item, me, now, lease_s):
            continue
        if of_cancelled_batch:
            report.cancelled += _cancel_abandoned(engine, item)
        elif left_behind:  # its worker did not stop: no stop counts against it
            if _requeue_abandoned(engine, item, stopped=False):
                report.reasons["left behind by this worker"] += 1
                to_enqueue[queues[item.batch_id]].append((item.id, item.params["max_tokens"]))
        elif item.stops + 1 >= 1 + RETRIES:  # it stopped on every try, this one included
            report.failed += _fail_abandoned(engine, item)
        elif _requeue_abandoned(engine, item):
            report.reasons["worker gone"] += 1
            to_enqueue[queues[item.batch_id]].append((item.id, item.params["max_tokens"]))
    for item_id, item_batch, tokens in queued:
        name, this_job = queues[item_batch], job_id(db_id, item_id)
        job = jobs[this_job]
        if job is None:
            reason = "job missing"
        elif job.status in _WAITING and job.func_name != JOB_FUNCTION:
            reason = "job of an older polspec" if job.func_name else "job unreadable"
        elif job.status in _WAITING:
            if name not in waiting_ids:
                waiting_ids[name] = set(make_queue(connection, name).get_job_ids())
            if this_job in waiting_ids[name]:
                continue
            reason = "job not in its queue"
        elif job.status == JobStatus.STARTED:
            if not _starter_gone(connection, job.worker_name, me):
                continue  # claimed by its worker any moment now
            reason = "job's worker gone"
        else:
            reason = f"job {job.status.value}" if job.status else "job without a status"
        report.reasons[reason] += 1
        to_enqueue[name].append((item_id, tokens))
    for name, items in to_enqueue.items():
        enqueue_items(connection, name, db_id, sorted(items))  # by id, the enqueue order: a sweep's is drift-fair
    return report


def _starter_gone(connection: redis.Redis, worker_name: str | None, me: Worker) -> bool:
    """Whether the worker that started a job whose item it has not claimed yet has stopped:
    killed between RQ's start and the claim (milliseconds; longer while a batch takes its jobs).
    RQ retries such a job only once its registry entry expired and a worker's maintenance came
    by, so a burst run ended without the item. Stopped: RQ's record of the worker is gone (it
    expires minutes after the worker's last heartbeat) or records its death, or it names this
    host and a dead pid (a polspec worker records the host as
    :func:`~polspec.processes.this_host_and_boot` names it). A record without host or pid (RQ rebuilds
    one from a heartbeat alone after it expired, e.g. while Redis was away) says nothing: left
    to RQ, as a job of a live worker must be."""
    if not worker_name:
        return False
    key = BaseWorker.redis_worker_namespace_prefix + worker_name
    with connection.pipeline(transaction=False) as pipeline:
        pipeline.exists(key)
        pipeline.hmget(key, "hostname", "pid", "death")
        exists, (host, pid, death) = pipeline.execute()
    if not exists or death:
        return True
    return host is not None and pid is not None and me.sees_stopped(host.decode(), int(pid))


def _requeue_abandoned(engine: Engine, item: Item, stopped: bool = True) -> bool:
    """Queue an abandoned running item again, unless it was claimed or renewed since it was read
    (another recover or a worker got there first); True if this call requeued it. ``stopped``:
    its worker stopped while running it (counted in ``stops``), rather than left it behind."""
    with session_scope(engine) as session:
        return session.execute(
            update(Item).where(*_unchanged_since_read(item))
            .values(status=Status.QUEUED.value, stops=Item.stops + int(stopped),
                    last_error="worker stopped while running it" if stopped else
                    "left behind by its worker (the database failed as it finished)")).rowcount == 1


def _fail_abandoned(engine: Engine, item: Item) -> bool:
    """Fail an abandoned running item (see the module docstring), on the terms of
    :func:`_requeue_abandoned`; True if this call failed it."""
    with session_scope(engine) as session:
        failed = session.execute(
            update(Item).where(*_unchanged_since_read(item))
            .values(status=Status.FAILED.value, stops=Item.stops + 1, last_error=GONE_EVERY_TIME,
                    finished_at=database_now(session))).rowcount == 1
        if failed:
            settle_batch(session, session.get(Batch, item.batch_id))
        return failed


def _cancel_abandoned(engine: Engine, item: Item) -> bool:
    """Mark an abandoned running item of a cancelled batch cancelled, on the terms of
    :func:`_requeue_abandoned` and while the batch stays cancelled; True if this call did."""
    with session_scope(engine) as session:
        # The item's lock, then the batch's, as a claim or a finish takes them: a resume committed
        # meanwhile (retry --cancelled) is read here, and the item is left for the next recover.
        if session.execute(select(Item.id).where(*_unchanged_since_read(item)).with_for_update()).first() is None:
            return False
        if session.get(Batch, item.batch_id, with_for_update=True, populate_existing=True).status != \
                Status.CANCELLED.value:
            return False
        session.execute(update(Item).where(Item.id == item.id).values(
            status=Status.CANCELLED.value, stops=Item.stops + 1, last_error="worker stopped while running it",
            finished_at=database_now(session)))
        return True


def _unchanged_since_read(item: Item) -> tuple:
    """The conditions under which a running item read earlier is still as it was: running, on
    the same attempt, its lease not renewed."""
    heartbeat = Item.heartbeat_at.is_(None) if item.heartbeat_at is None else Item.heartbeat_at == item.heartbeat_at
    return Item.id == item.id, Item.status == Status.RUNNING.value, Item.attempts == item.attempts, heartbeat


def cancel(engine: Engine, connection: redis.Redis | None, batch_id: int) -> tuple[int, bool]:
    """Cancel a batch: its queued items are cancelled and their jobs removed; running ones stop
    at their next round (the worker checks). Returns the number of items cancelled now, and
    whether the batch was cancelled already. A finished batch is refused: marking it cancelled
    would only hide that it finished."""
    with session_scope(engine) as session:
        batch = find_batch(session, batch_id)
        # The items before the batch, in the order a claim or a finish locks them (its item, then
        # the batch): the other order deadlocks with a claim on PostgreSQL. Then the batch's
        # status as it stands once no finish can change it.
        queued = (Item.batch_id == batch_id, Item.status == Status.QUEUED.value)
        ids = list(session.scalars(select(Item.id).where(*queued).with_for_update()))
        session.refresh(batch, with_for_update=True)
        if batch.status in (Status.DONE.value, Status.FAILED.value):
            raise PolspecError(f"batch {batch_id} has finished ({batch.status}); there is nothing to cancel")
        already = batch.status == Status.CANCELLED.value
        # By the condition, not by the ids: a list of a sweep's hundreds of thousands of ids is
        # more than SQLite takes in one statement.
        session.execute(update(Item).where(*queued).values(status=Status.CANCELLED.value,
                                                            finished_at=database_now(session)))
        batch.status = Status.CANCELLED.value
    if connection is not None and ids:
        db_id = database_id(engine)
        try:
            delete_jobs(connection, [job_id(db_id, item_id) for item_id in ids])
        except redis.RedisError:
            pass  # the cancel holds: a worker that takes a job left behind finds its item cancelled and skips it
    return len(ids), already


def retry(engine: Engine, connection: redis.Redis, batch_id: int, statuses: tuple[Status, ...]) -> int:
    """Queue a batch's items of these statuses (failed, cancelled) again; a cancelled batch is
    reopened for them. Returns how many were queued."""
    with session_scope(engine) as session:
        batch = find_batch(session, batch_id)
        if batch.status == Status.CANCELLED.value and Status.CANCELLED not in statuses:
            # Reopened for its failed items alone, it would read done with its cancelled ones never run.
            raise PolspecError(f"batch {batch_id} is cancelled; polspec retry {batch_id} --cancelled resumes it "
                               "(with --failed, its failed items too)")
        items = reopen_items(session, batch, statuses)
        target = batch.spec["target"]
    if items:
        enqueue_items(connection, queue_name(target), database_id(engine), items)
    return len(items)
