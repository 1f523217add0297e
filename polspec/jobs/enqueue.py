"""Turn a validated request (a generation batch or a sweep) into rows in the database and jobs
on the target's queue.

Order matters for "never half-created": models and Redis are checked first, then the batch and
its items are written in one transaction, then the jobs are enqueued. If enqueueing fails
(Redis went away in between), the rows just written are removed again and the error says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from sqlalchemy import Engine, delete, func, select, update
from sqlalchemy.orm import Session

from polspec.errors import PolspecError
from polspec.jobs.queue import connect, display_redis_url, enqueue_items, queue_name
from polspec.jobs.control import recover
from polspec.jobs.spec import GenerateSpec, ItemInput, check_models
from polspec.jobs.sweep import SweepPlan
from polspec.settings import redis_url
from polspec.store.engine import make_engine, session_scope
from polspec.store.items import database_id
from polspec.store.migrate import ensure_schema
from polspec.store.schema import Batch, Cell, Item


@dataclass(frozen=True)
class Enqueued:
    """What ``enqueue_generate`` did: the batch, its queue, items added and items already there."""

    batch_id: int
    name: str | None
    queue: str
    added: int
    existing: int


def enqueue_generate(spec: GenerateSpec, items: list[ItemInput], name: str | None = None,
                     *, db_url: str | None = None, queue_url: str | None = None) -> Enqueued:
    """Create (or extend, for an existing ``name``) a generation batch and enqueue its new items.

    Items whose key the named batch already has are left alone, so enqueueing the same file
    twice under one name adds nothing twice.
    """
    check_models(spec, items)
    queue_url = queue_url or redis_url()
    connection = connect(queue_url)
    ensure_schema(db_url)
    engine = make_engine(db_url)
    try:
        batch_id, created, new_items, existing = _write_batch(engine, spec, items, name)
        try:
            enqueue_items(connection, queue_name(spec.target), database_id(engine), new_items)
        except redis.RedisError as error:
            _remove(engine, batch_id, created, [item_id for item_id, _ in new_items])
            raise PolspecError(f"Redis at {display_redis_url(queue_url)} failed while enqueueing ({error}); "
                               "nothing was added to the database") from None
        return Enqueued(batch_id, name, queue_name(spec.target), len(new_items), existing)
    finally:
        engine.dispose()


def _write_batch(engine: Engine, spec: GenerateSpec, items: list[ItemInput],
                 name: str | None) -> tuple[int, bool, list[tuple[int, int]], int]:
    wanted = spec.as_dict()
    with session_scope(engine) as session:
        batch = session.scalar(select(Batch).where(Batch.name == name)) if name else None
        created = batch is None
        if batch is None:
            batch = Batch(kind="generate", name=name, spec=wanted)
            session.add(batch)
            session.flush()
        else:
            _check_same_request(batch, wanted)
        known = set(session.scalars(select(Item.item_key).where(Item.batch_id == batch.id)))
        rows = [Item(batch_id=batch.id, item_key=item.key, prompt=item.prompt, messages=item.messages,
                     params=item.params(spec.params).as_dict())
                for item in items if item.key not in known]
        session.add_all(rows)
        session.flush()
        if rows and batch.status not in ("queued", "running"):
            batch.status = "queued"
        return batch.id, created, [(row.id, row.params["max_tokens"]) for row in rows], len(items) - len(rows)


def _check_same_request(batch: Batch, wanted: dict) -> None:
    for key in ("kind", "target", "draft", "params", "chat"):
        if batch.spec.get(key) != wanted[key]:
            raise PolspecError(f"batch {batch.name!r} (id {batch.id}) exists with a different {key}: "
                               f"{batch.spec.get(key)!r}, not {wanted[key]!r}; choose another --name")


def _remove(engine: Engine, batch_id: int, created: bool, item_ids: list[int]) -> None:
    with session_scope(engine) as session:
        if created:
            session.execute(delete(Batch).where(Batch.id == batch_id))
        else:
            session.execute(delete(Item).where(Item.id.in_(item_ids)))


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


def enqueue_sweep(plan: SweepPlan, *, db_url: str | None = None, queue_url: str | None = None) -> SweepEnqueued:
    """Write a sweep (batch, cells, items) and enqueue its items in the plan's order.

    A sweep of the same name with the same configuration is resumed instead: its finished
    items are kept, failed ones are queued again, and whatever has no job gets one.
    """
    queue_url = queue_url or redis_url()
    connection = connect(queue_url)
    ensure_schema(db_url)
    engine = make_engine(db_url)
    name = queue_name(plan.spec.target)
    try:
        with session_scope(engine) as session:
            batch = session.scalar(select(Batch).where(Batch.name == plan.name))
            if batch is not None:
                if batch.kind != "sweep" or batch.spec.get("config") != plan.config:
                    raise PolspecError(f"a batch named {plan.name!r} (id {batch.id}) exists with another "
                                       "configuration; give the sweep another name")
                session.execute(update(Item).where(Item.batch_id == batch.id, Item.status == "failed")
                                .values(status="queued", finished_at=None))
                batch.status = "running"
                batch_id = batch.id
            else:
                batch_id = _write_sweep(session, plan)
        if batch is not None:
            enqueued = recover(engine, connection, batch_id).total
        else:
            with session_scope(engine) as session:
                rows = session.execute(select(Item.id, Item.params).where(Item.batch_id == batch_id)
                                       .order_by(Item.id)).all()
            try:
                enqueue_items(connection, name, database_id(engine), [(row.id, row.params["max_tokens"]) for row in rows])
            except redis.RedisError as error:
                _remove(engine, batch_id, True, [])
                raise PolspecError(f"Redis at {display_redis_url(queue_url)} failed while enqueueing ({error}); "
                                   "nothing was added to the database") from None
            enqueued = len(rows)
        with session_scope(engine) as session:
            done = session.scalar(select(func.count()).select_from(Item)
                                  .where(Item.batch_id == batch_id, Item.status == "done"))
        return SweepEnqueued(batch_id, plan.name, name, len(plan.cells), len(plan.items), enqueued, done,
                             batch is not None)
    finally:
        engine.dispose()


def _write_sweep(session: Session, plan: SweepPlan) -> int:
    batch = Batch(kind="sweep", name=plan.name, spec=plan.spec.as_dict() | {"kind": "sweep", "config": plan.config})
    session.add(batch)
    session.flush()
    cells = {cell.key: Cell(batch_id=batch.id, key=cell.key, config=cell.config, baseline=cell.baseline)
             for cell in plan.cells}
    session.add_all(cells.values())
    session.flush()
    session.add_all(Item(batch_id=batch.id, cell_id=cells[item.cell].id, item_key=item.key, prompt=item.item.prompt,
                         messages=item.item.messages, params=item.item.overrides) for item in plan.items)
    session.flush()
    return batch.id
