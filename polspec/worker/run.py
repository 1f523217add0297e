"""Start a worker: check the database, install the resident state, recover, then work.

``polspec worker`` is a thin layer over :func:`run_worker`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rq import Queue

from polspec import backend
from polspec.jobs.control import Requeued, recover
from polspec.jobs.queue import connect, queue_name
from polspec.models.registry import load_registry
from polspec.store.engine import make_engine
from polspec.store.items import DEFAULT_LEASE_S, Worker, database_id
from polspec.store.migrate import require_current_schema
from polspec.worker import HEARTBEAT_GRACE_S, HEARTBEAT_INTERVAL_S, context
from polspec.worker.energy import open_meter
from polspec.worker.model_cache import ModelCache
from polspec.worker.worker import PolspecWorker

QUEUE_PREFIX = queue_name("")


@dataclass(frozen=True)
class WorkerOptions:
    """How a worker runs: which queues (model aliases or queue names; all polspec queues when
    empty), burst mode (stop when the queues are empty), how many items decode together
    (``batch``: 1 one at a time, None as many as pay on this machine), and its timing."""

    queues: Sequence[str] = ()
    burst: bool = False
    batch: int | None = None
    heartbeat_interval: int = HEARTBEAT_INTERVAL_S
    heartbeat_grace: int = HEARTBEAT_GRACE_S
    lease_s: float = DEFAULT_LEASE_S
    log_level: str = "INFO"


def queue_names(connection, wanted: Sequence[str]) -> list[str]:
    """Queue names for ``wanted`` (aliases or names); by default the queue of every registered
    model and every polspec queue Redis knows, so a waiting worker also serves models whose
    first batch comes later. A name that is no model's queue is an error with close matches:
    a worker on a misspelled queue would wait for ever (or stop at once with ``--burst``)."""
    registry = load_registry()
    if wanted:
        names = [queue_name(registry.model(name.removeprefix(QUEUE_PREFIX)).alias) for name in wanted]
        return list(dict.fromkeys(names))  # an alias and its queue's name are one queue
    known = {queue_name(alias) for alias in registry.models}
    known |= {queue.name for queue in Queue.all(connection=connection) if queue.name.startswith(QUEUE_PREFIX)}
    return sorted(known)


def run_worker(options: WorkerOptions, *, on_start: Callable[[Requeued, list[str]], None] | None = None,
               on_job_end: Callable[[], None] | None = None, db_url: str | None = None,
               redis_url: str | None = None) -> bool:
    """Serve jobs until stopped (or, in burst mode, until the queues are empty).

    Refuses an out-of-date schema. Before the first job it re-enqueues unfinished items whose
    worker is gone (see :func:`polspec.jobs.control.recover`); in burst mode it recovers again
    when the queues are empty and goes on until nothing is left. Returns whether any job ran.
    """
    connection = connect(redis_url)
    require_current_schema(db_url)
    engine = make_engine(db_url)
    me = Worker.this_process()
    meter, meter_reason = open_meter(device=backend.setup().device)
    context.install(context.WorkerContext(engine, database_id(engine), ModelCache(), me, meter, meter_reason,
                                          options.lease_s))
    try:
        names = queue_names(connection, options.queues)  # a mistyped queue fails before recover writes
        requeued = recover(engine, connection, me=me, lease_s=options.lease_s, holding=())  # none yet
        if on_start is not None:
            on_start(requeued, names)
        worked = False
        while names:
            worker = PolspecWorker(names, connection=connection, heartbeat_interval=options.heartbeat_interval,
                                   heartbeat_grace=options.heartbeat_grace, batch=options.batch)
            worker.on_job_end = on_job_end
            worked = worker.work(burst=options.burst, logging_level=options.log_level) or worked
            # A burst worker finishes what the database holds, not only what Redis delivered:
            # jobs lost while Redis was away are re-enqueued and served before it stops.
            if not options.burst or worker.asked_to_stop or not recover(engine, connection, me=me,
                                                                       lease_s=options.lease_s, holding=()).total:
                break
        return worked
    finally:
        context.install(None)
        engine.dispose()
