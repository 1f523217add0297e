"""Turn a validated request (a generation batch or a sweep) into rows in the database and jobs
on the target's queue.

Order matters for "never half-created": models and Redis are checked first, then the batch and
its items are written in one transaction, then the jobs are enqueued. If enqueueing fails
(Redis went away in between, or Ctrl+C), the rows just written are removed again, then the jobs
already queued, and the error says so.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis
from sqlalchemy import Engine, delete, func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from polspec.errors import PolspecError
from polspec.jobs.queue import connect, delete_jobs, display_redis_url, enqueue_items, job_id, queue_name
from polspec.jobs.control import counted, recover
from polspec.jobs.spec import GenerateSpec, ItemInput, check_items_fit, check_models
from polspec.jobs.sweep import SweepPlan
from polspec.settings import redis_url
from polspec.store.engine import session_scope
from polspec.store.items import UNFINISHED, database_id, reopen_items, settle_batch
from polspec.store.migrate import upgraded_database
from polspec.store.schema import Batch, Cell, Item, Status


@dataclass(frozen=True)
class Enqueued:
    """What ``enqueue_generate`` did: the batch, its queue, items added and items already there."""

    batch_id: int
    name: str | None
    queue: str
    added: int
    existing: int


# Ids in one statement's IN list: SQLite takes 32,766 variables a statement by default (999 before
# 3.32), and a batch may add up to a million items.
IDS_PER_STATEMENT = 900


def enqueue_generate(spec: GenerateSpec, items: list[ItemInput], name: str | None = None,
                     *, db_url: str | None = None, queue_url: str | None = None) -> Enqueued:
    """Create (or extend, for an existing ``name``) a generation batch and enqueue its new items.

    Items whose key the named batch already has are left alone, so enqueueing the same file
    twice under one name adds nothing twice; one it has with another prompt is refused.
    """
    check_models(spec, items)
    check_items_fit(spec, items)
    queue_url = queue_url or redis_url()
    connection = connect(queue_url)
    with upgraded_database(db_url) as engine, _named_once(name):
        batch_id, created, new_items, existing = _write_batch(engine, spec, items, name)
        _enqueue_or_undo(engine, connection, queue_url, queue_name(spec.target), new_items, batch_id, created)
        return Enqueued(batch_id, name, queue_name(spec.target), len(new_items), existing)


def _write_batch(engine: Engine, spec: GenerateSpec, items: list[ItemInput],
                 name: str | None) -> tuple[int, bool, list[tuple[int, int]], int]:
    """The batch's id, whether it was created here, its new items as (id, max_tokens), and how
    many of ``items`` it had already."""
    wanted = spec.as_dict()
    with session_scope(engine) as session:
        # Locked, as a worker's finish and a cancel lock it (PostgreSQL; SQLite's write lock,
        # taken at BEGIN, holds every writer off): read unlocked, a batch whose last item
        # finished meanwhile read done with the items added here queued.
        batch = session.scalar(select(Batch).where(Batch.name == name).with_for_update()) if name else None
        created = batch is None
        if batch is None:
            batch = Batch(kind="generate", name=name, spec=wanted)
            session.add(batch)
            session.flush()
        else:
            _check_same_request(batch, wanted)
            if batch.status == Status.CANCELLED.value:
                # Reopening it would let its items still running ignore the cancel, and the
                # batch would read done with its cancelled items never run.
                raise PolspecError(f"batch {batch.name!r} (id {batch.id}) is cancelled; resume it with "
                                   f"polspec retry {batch.id} --cancelled, or choose another --name")
        known = _stored_items(session, batch.id)
        # Kept as it was, an edited text or line setting (its own max_tokens, seed) would never
        # run, and no one would be told.
        for what, kept, edited in (
                ("another prompt", "text", lambda item, stored: stored[:2] != (item.prompt, item.messages)),
                ("other settings of its own", "settings",
                 lambda item, stored: stored[2] != item.params(spec.params).as_dict())):
            keys = [item.key for item in items if item.key in known and edited(item, known[item.key])]
            if keys:
                raise PolspecError(f"batch {batch.name!r} (id {batch.id}) has id {keys[0]!r}"
                                   + (f" and {len(keys) - 1} more" if len(keys) > 1 else "")
                                   + f" with {what}; choose another --name (the batch keeps the {kept} it was "
                                     "enqueued with)")
        rows = [Item(batch_id=batch.id, item_key=item.key, prompt=item.prompt, messages=item.messages,
                     params=item.params(spec.params).as_dict())
                for item in items if item.key not in known]
        session.add_all(rows)
        session.flush()
        if rows and batch.status not in UNFINISHED:
            batch.status = Status.QUEUED.value
        return batch.id, created, [(row.id, row.params["max_tokens"]) for row in rows], len(items) - len(rows)


@contextmanager
def _named_once(name: str | None) -> Iterator[None]:
    """A batch of this ``name`` made by another enqueue between this one's read and write (on
    PostgreSQL; SQLite takes the two one after the other) is a one-line error: nothing of this
    enqueue was written, and running it again adds to that batch."""
    try:
        yield
    except IntegrityError as error:
        if name is None or "uq_batches_name" not in str(error.orig):
            raise
        raise PolspecError(f"another enqueue made a batch named {name!r} at the same moment; nothing of this "
                           "one was written: run it again to add to that batch") from None


def _stored_items(session: Session, batch_id: int) -> dict[str, tuple[str | None, list | None, dict[str, Any]]]:
    """Each item key of the batch with its prompt, messages and parameters as stored."""
    return {key: (prompt, messages, params) for key, prompt, messages, params in session.execute(
        select(Item.item_key, Item.prompt, Item.messages, Item.params).where(Item.batch_id == batch_id))}


def _check_same_request(batch: Batch, wanted: dict) -> None:
    for key in ("kind", "target", "draft", "params", "chat"):
        stored = batch.spec.get(key)
        if stored == wanted[key]:
            continue
        if key == "params":  # the parameters that differ, not two whole dictionaries
            differ = [name for name in sorted(set(stored) | set(wanted[key])) if stored.get(name) != wanted[key].get(name)]
            what = ", ".join(f"{name} ({stored.get(name)!r}, not {wanted[key].get(name)!r})" for name in differ)
            raise PolspecError(f"batch {batch.name!r} (id {batch.id}) exists with different parameters: {what}; "
                               "choose another --name")
        if key == "chat":
            stored, wanted_now = _CHAT_MODES[stored], _CHAT_MODES[wanted[key]]
            raise PolspecError(f"batch {batch.name!r} (id {batch.id}) was queued as {stored}, not {wanted_now}; "
                               "choose another --name")
        raise PolspecError(f"batch {batch.name!r} (id {batch.id}) exists with a different {key}: "
                           f"{stored!r}, not {wanted[key]!r}; choose another --name")


# A generation spec's ``chat``, in the words of the options that set it.
_CHAT_MODES = {None: "chat where the target has a template (the default)", False: "raw text (--raw)",
               True: "chat"}


def _enqueue_or_undo(engine: Engine, connection: redis.Redis, queue_url: str, name: str,
                     items: list[tuple[int, int]], batch_id: int, created: bool) -> None:
    """Enqueue the jobs of rows just written; if Redis fails, or the user interrupts, delete those
    rows again, and the jobs already enqueued, so that nothing is left half-created. Rows a worker
    has taken meanwhile (from the jobs of a chunk already enqueued) stay, with the batch, which
    is settled by its items: deleting them would delete their results, or drop the one decoding.
    A sweep some of whose rows were taken stays whole, for its resume to queue the rest (a sweep
    missing items could not be resumed)."""
    try:
        enqueue_items(connection, name, database_id(engine), items)
    except (redis.RedisError, KeyboardInterrupt) as error:
        # The rows first, in quick statements: a second Ctrl+C during the slower removal of the
        # jobs then leaves jobs that find no item, which a worker skips.
        ids, kept = [item_id for item_id, _ in items], set()
        with session_scope(engine) as session:
            undo = session.begin_nested()
            for start in range(0, len(ids), IDS_PER_STATEMENT):
                chunk = ids[start:start + IDS_PER_STATEMENT]
                # Untouched only; on PostgreSQL a row a worker is claiming waits for its claim and
                # is then read again, so a claimed row is never deleted.
                session.execute(delete(Item).where(Item.id.in_(chunk), Item.status == Status.QUEUED.value,
                                                   Item.attempts == 0))
                kept.update(session.scalars(select(Item.id).where(Item.id.in_(chunk))))
            batch = session.get(Batch, batch_id)
            whole = bool(kept) and batch.kind == "sweep"
            if whole:
                undo.rollback()
            else:
                undo.commit()
                if created and not kept:
                    session.execute(delete(Batch).where(Batch.id == batch_id))
                else:
                    # By its items, not back to its status before: a worker may have claimed a new
                    # item meanwhile and marked the batch running, which no item left would end.
                    settle_batch(session, batch)
        what = "interrupted" if isinstance(error, KeyboardInterrupt) else \
            f"Redis at {display_redis_url(queue_url)} failed while enqueueing ({error})"
        if whole:
            when = "" if isinstance(error, KeyboardInterrupt) else " once Redis takes writes"
            raise PolspecError(f"{what}; sweep {batch_id} was already being decoded, so it stays whole: run the "
                               f"sweep again{when} to queue the rest, or polspec cancel {batch_id}") from None
        try:
            delete_jobs(connection, [job_id(database_id(engine), item_id) for item_id in ids if item_id not in kept])
        except redis.RedisError:
            pass  # those left behind find no item, as above
        if not kept:
            if isinstance(error, KeyboardInterrupt):
                raise
            raise PolspecError(f"{what}; nothing was added to the database") from None
        raise PolspecError(f"{what}; of the {counted(len(ids))} it added, batch {batch_id} keeps the {len(kept)} a "
                           "worker had already taken (their results with them) and the rest were removed") from None


@dataclass(frozen=True)
class SweepEnqueued:
    """What ``enqueue_sweep`` did: a new sweep (``resumed`` False) or the unfinished part of an old one."""

    batch_id: int
    name: str
    queue: str
    cells: int
    items: int
    enqueued: int
    done: int
    resumed: bool
    earlier: list[int] = field(default_factory=list)  # unfinished sweeps of an unnamed file's other versions
    was_cancelled: bool = False  # a resumed sweep that had been cancelled
    reopened: dict[str, int] = field(default_factory=dict)  # a resume's items queued again, per status they had


def enqueue_sweep(plan: SweepPlan, *, db_url: str | None = None, queue_url: str | None = None) -> SweepEnqueued:
    """Write a sweep (batch, cells, items) and enqueue its items in the plan's order.

    A sweep of the same name with the same configuration is resumed instead: its finished
    items are kept, failed and cancelled ones are queued again, and whatever has no job gets one.
    """
    queue_url = queue_url or redis_url()
    connection = connect(queue_url)
    name = queue_name(plan.spec.target)
    with upgraded_database(db_url) as engine:
        with session_scope(engine) as session, _named_once(plan.name):
            # Not locked: a resume adds no items, and the batch's lock before its items' would
            # deadlock against a retry, which takes them the other way round.
            batch = session.scalar(select(Batch).where(Batch.name == plan.name))
            if batch is not None:
                if batch.kind != "sweep":
                    raise PolspecError(f"a batch named {plan.name!r} (id {batch.id}) exists and is no sweep; "
                                       "give the sweep another name")
                if batch.spec.get("config") != plan.config:
                    key, there, here = _first_difference(batch.spec.get("config") or {}, plan.config)
                    raise PolspecError(f"sweep {plan.name!r} (id {batch.id}) exists with another configuration "
                                       f"({key}: {there} there, {here} in this file); give the sweep another name")
                _check_same_prompts(session, batch, plan)
                was_cancelled = batch.status == Status.CANCELLED.value
                reopened = dict(session.execute(
                    select(Item.status, func.count()).where(Item.batch_id == batch.id, Item.status.in_(
                        [Status.FAILED.value, Status.CANCELLED.value])).group_by(Item.status)).all())
                reopen_items(session, batch, (Status.FAILED, Status.CANCELLED))
                batch.status = Status.RUNNING.value  # reopened even with nothing to rerun: judged by its items
                settle_batch(session, batch)
                batch_id = batch.id
            else:
                batch_id, new_items = _write_sweep(session, plan)
                earlier = [] if "name" in plan.config else list(session.scalars(  # a named one's edit is refused
                    select(Batch.id).where(Batch.kind == "sweep", Batch.id != batch_id,
                                           Batch.spec["source"].as_string() == plan.spec.source,
                                           Batch.status.in_([Status.QUEUED.value, Status.RUNNING.value]))
                    .order_by(Batch.id)))
        if batch is not None:
            try:
                enqueued = recover(engine, connection, batch_id).total
            except redis.RedisError as error:  # after the reopen above, which recover's next run completes
                raise PolspecError(f"Redis at {display_redis_url(queue_url)} failed part-way ({error}); sweep "
                                   f"{batch_id} is reopened in the database: polspec recover --batch {batch_id} "
                                   "queues its items once Redis takes writes") from None
        else:
            _enqueue_or_undo(engine, connection, queue_url, name, new_items, batch_id, created=True)
            enqueued = len(new_items)
        with session_scope(engine) as session:
            done = session.scalar(select(func.count()).select_from(Item)
                                  .where(Item.batch_id == batch_id, Item.status == Status.DONE.value))
            cells = session.scalar(select(func.count()).select_from(Cell).where(Cell.batch_id == batch_id))
            items = session.scalar(select(func.count()).select_from(Item).where(Item.batch_id == batch_id))
        if batch is None:
            return SweepEnqueued(batch_id, plan.name, name, cells, items, enqueued, done, False, earlier)
        return SweepEnqueued(batch_id, plan.name, name, cells, items, enqueued, done, True,
                             was_cancelled=was_cancelled, reopened=reopened)


def _first_difference(stored: dict[str, Any], wanted: dict[str, Any], within: str = "") -> tuple[str, str, str]:
    """The first key (dotted, in sorted order) whose value differs between two configurations,
    with the two values as TOML would show them ("none" where a key is missing)."""
    for key in sorted(set(stored) | set(wanted)):
        there, here = stored.get(key), wanted.get(key)
        if there == here:
            continue
        if isinstance(there, dict) and isinstance(here, dict):
            return _first_difference(there, here, f"{within}{key}.")
        return f"{within}{key}", *(json.dumps(value, ensure_ascii=False) if value is not None else "none"
                                   for value in (there, here))
    raise ValueError("the configurations are equal")


def _check_same_prompts(session: Session, batch: Batch, plan: SweepPlan) -> None:
    """A sweep resumes only where its file gives no item it lacks, and each item the text it has:
    a dataset edited since would otherwise have its new prompts left out, or its new texts
    never run, unseen (resuming adds and changes no items)."""
    stored = _stored_items(session, batch.id)
    new = sorted({item.key for item in plan.items} - set(stored))
    if new:
        raise PolspecError(f"sweep {plan.name!r} (id {batch.id}) was enqueued over other prompts: its datasets now "
                           f"give {len(new)} items it lacks (first: {new[0]!r}); give the sweep another name")
    changed = [planned.key for planned in plan.items
               if stored[planned.key][:2] != (planned.item.prompt, planned.item.messages)]
    if changed:
        raise PolspecError(f"sweep {plan.name!r} (id {batch.id}) was enqueued over other prompts: its datasets now "
                           f"give {len(changed)} items another text (first: {changed[0]!r}); give the sweep "
                           "another name")


def _write_sweep(session: Session, plan: SweepPlan) -> tuple[int, list[tuple[int, int]]]:
    """Write the sweep's batch, cells and items; return the batch id and its (item id,
    max_tokens) in plan order, which is the enqueue order."""
    batch = Batch(kind="sweep", name=plan.name, spec=plan.spec.as_dict() | {"kind": "sweep", "config": plan.config})
    session.add(batch)
    session.flush()
    cells = {cell.key: Cell(batch_id=batch.id, key=cell.key, config=cell.config, baseline=cell.baseline)
             for cell in plan.cells}
    session.add_all(cells.values())
    session.flush()
    # One bulk INSERT, not an Item object per row: a sweep may have a million items, and building
    # and flushing objects took most of a large enqueue. The ids are read back by item key
    # (unique in a batch), not by RETURNING, which SQLite has only since 3.35.
    session.execute(insert(Item), [
        {"batch_id": batch.id, "cell_id": cells[item.cell].id, "item_key": item.key, "prompt_key": item.prompt_key,
         "repeat": item.repeat, "prompt": item.item.prompt, "messages": item.item.messages,
         "params": item.item.overrides} for item in plan.items])
    ids = dict(session.execute(select(Item.item_key, Item.id).where(Item.batch_id == batch.id)).all())
    return batch.id, [(ids[item.key], item.item.overrides["max_tokens"]) for item in plan.items]
