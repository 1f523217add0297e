"""The polspec worker: an RQ ``SimpleWorker`` that keeps models resident and its jobs alive.

Why a subclass (facts in ``design/QUEUE.md``):

- ``SimpleWorker`` runs jobs in its own process, the only RQ worker that keeps models loaded
  between jobs (the forking ``Worker`` loses them with each child, and Metal is not fork-safe);
- it sends no heartbeat while a job runs, so a job longer than the registry TTL would be
  declared abandoned while it still runs. Here a side thread renews RQ's heartbeats every
  ``job_monitoring_interval`` and the item's lease in the database, while generation stays on
  the main thread (MLX streams are thread-local);
- Redis may restart while an item runs. The result is already in the database by then, so
  the worker waits for Redis to come back instead of quitting;
- only :data:`~polspec.jobs.queue.JOB_FUNCTION` is run: anyone who can write to Redis can name
  any importable function, and polspec refuses before importing it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker

from polspec.errors import PolspecError
from polspec.jobs.queue import JOB_FUNCTION
from polspec.store.items import renew_lease
from polspec.worker import HEARTBEAT_GRACE_S, HEARTBEAT_INTERVAL_S, context

log = logging.getLogger("polspec.worker")

REDIS_WAIT_MAX_S = 30.0


class PolspecJob(Job):
    """An RQ job that refuses to import or run anything but polspec's job function."""

    def perform(self):
        if self.func_name != JOB_FUNCTION:
            raise PolspecError(f"refusing job {self.id}: {self.func_name!r} is not a polspec job function")
        return super().perform()


class PolspecWorker(SimpleWorker):
    """A no-fork worker with a heartbeat thread (see the module docstring)."""

    job_class = PolspecJob

    def __init__(self, queues, *, connection: redis.Redis, heartbeat_interval: int = HEARTBEAT_INTERVAL_S,
                 heartbeat_grace: int = HEARTBEAT_GRACE_S, **options):
        super().__init__(queues, connection=connection, serializer=JSONSerializer, job_class=PolspecJob,
                         job_monitoring_interval=heartbeat_interval, **options)
        self.heartbeat_grace = heartbeat_grace
        self.on_job_end: Callable[[], None] | None = None  # e.g. to redraw a progress bar

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        # The heartbeat thread renews the entry every interval, so it only has to outlive one
        # interval plus a grace; SimpleWorker's own choice (the whole job timeout) would keep
        # a killed worker's job looking alive for as long as the timeout.
        return int(self.job_monitoring_interval + self.heartbeat_grace)

    def execute_job(self, job: Job, queue: Queue) -> None:
        execution = self.prepare_execution(job)
        stop = threading.Event()
        beat = threading.Thread(target=self._beat, args=(job, execution, stop), name="polspec-heartbeat", daemon=True)
        beat.start()
        try:
            self.perform_job(job, queue, execution)
            self.set_state("idle")
        except redis.RedisError as error:
            log.warning("Redis failed after job %s (%s); its item's state is in the database. Waiting for Redis.",
                        job.id, error)
            self._wait_for_redis()
        finally:
            stop.set()
            beat.join()
            if self.on_job_end is not None:
                self.on_job_end()

    def _beat(self, job: Job, execution, stop: threading.Event) -> None:
        ctx = context.current()
        while not stop.wait(self.job_monitoring_interval):
            try:
                self.maintain_heartbeats(job, execution)
            except redis.RedisError as error:
                log.warning("heartbeat to Redis failed: %s", error)
            item = ctx.current_item
            if item is not None:
                try:
                    renew_lease(ctx.engine, item, ctx.me)
                except PolspecError as error:
                    log.warning("renewing the lease of item %s failed: %s", item, error)

    def _wait_for_redis(self) -> None:
        wait = 0.5
        while not self._stop_requested:
            try:
                self.connection.ping()
                return
            except redis.RedisError:
                time.sleep(wait)
                wait = min(wait * 2, REDIS_WAIT_MAX_S)
