"""Turn a validated request into a batch in the database and jobs on the target's queue.

Order matters for "never half-created": models and Redis are checked first, then the batch and
its items are written in one transaction, then the jobs are enqueued. If enqueueing fails
(Redis went away in between), the rows just written are removed again and the error says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from sqlalchemy import Engine, delete, select

from polspec.errors import PolspecError
from polspec.jobs.queue import connect, display_redis_url, enqueue_items, queue_name
from polspec.jobs.spec import GenerateSpec, ItemInput, check_models
from polspec.settings import redis_url
from polspec.store.engine import make_engine, session_scope
from polspec.store.items import database_id
from polspec.store.migrate import ensure_schema
from polspec.store.schema import Batch, Item


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
