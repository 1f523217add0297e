"""The polspec worker: an RQ ``SimpleWorker`` that keeps models resident and its jobs alive.

Why a subclass (facts in ``design/QUEUE.md``):

- ``SimpleWorker`` runs jobs in its own process, the only RQ worker that keeps models loaded
  between jobs (the forking ``Worker`` loses them with each child, and Metal is not fork-safe);
- it sends no heartbeat while a job runs, so a job longer than the registry TTL would be
  declared abandoned while it still runs. Here a side thread renews RQ's heartbeats every
  ``job_monitoring_interval`` and the item's lease in the database, while generation stays on
  the main thread (MLX streams are thread-local);
- Redis may restart while an item runs. The result is already in the database by then, so
  the worker waits for Redis to come back instead of quitting. A database that fails (a
  restart, SQLite locked past its busy timeout) as a result is stored keeps the result waiting
  in the worker (:func:`~polspec.worker.tasks.store_result`); one that fails as an item
  joins a batch in flight sends its job back to the queue, and the batch goes on; one that
  fails as a job starts (a lone job, a batch's first) ends the job, which goes back to RQ for
  a retry, and the worker waits for the database: RQ's loop would quit on the error, with
  status 0, and leave the items running until a worker starts again; or, where RQ took the
  error itself (a job run alone), take job after job, each failing at once until its retries
  ran out, and leave their items queued with no job. Once either is back the worker runs
  :func:`~polspec.jobs.control.recover`, which gives a job to every item the outage left
  without one;
- the same recover runs at RQ's maintenance (every 10-15 minutes) when the worker's queues are
  empty: items whose jobs Redis lost while the worker waited for work (a restart without
  persistence, a flush) run without anyone typing ``polspec recover``. The pause before a
  retry grows across outages that follow one another until a job ends without one: a full disk
  passes the check for the database and fails the next write;
- only :data:`~polspec.jobs.queue.JOB_FUNCTION` is run: anyone who can write to Redis can name
  any importable function, and polspec refuses before importing it;
- with ``batch`` other than 1 a job whose item may share forwards starts a continuous batch
  (:mod:`polspec.worker.batching`), which takes more jobs from the queue itself. RQ's loop
  still delivers the first job, and handles signals, maintenance and burst mode;
- RQ listens for commands (``rq.command.send_shutdown_command`` and the like) on a pub/sub
  thread that wakes once a minute, and its teardown waits for that thread: with redis-py 8
  every worker exit (the end of a burst, Ctrl+C) could take up to a minute. Here the thread
  wakes every :data:`PUBSUB_POLL_S`.
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
from sqlalchemy import text

from polspec.errors import DatabaseFailure, PolspecError
from polspec.jobs.control import recover
from polspec.jobs.queue import JOB_FUNCTION
from polspec.processes import this_host_and_boot
from polspec.store.engine import session_scope
from polspec.store.items import Pairing, item_pairings, renew_leases
from polspec.worker import FIRST_PAUSE_S, HEARTBEAT_GRACE_S, HEARTBEAT_INTERVAL_S, WAIT_MAX_S, context
from polspec.worker.batching import BatchCap, BatchRun, batch_cap, job_item

log = logging.getLogger("polspec.worker")

PUBSUB_POLL_S = 0.5


class PolspecJob(Job):
    """An RQ job that refuses to import or run anything but polspec's job function."""

    def perform(self):
        if self.func_name != JOB_FUNCTION:
            raise PolspecError(f"refusing job {self.id}: {self.func_name!r} is not a polspec job function")
        return super().perform()


class PolspecWorker(SimpleWorker):
    """A no-fork worker with a heartbeat thread (see the module docstring).

    ``batch`` is how many items may decode together: 1 runs one job at a time, None lets
    the batch size follow the probe and memory; a sweep cell's own batch size wins.
    """

    job_class = PolspecJob

    def __init__(self, queues, *, connection: redis.Redis, heartbeat_interval: int = HEARTBEAT_INTERVAL_S,
                 heartbeat_grace: int = HEARTBEAT_GRACE_S, batch: int | None = 1, **options):
        super().__init__(queues, connection=connection, serializer=JSONSerializer, job_class=PolspecJob,
                         job_monitoring_interval=heartbeat_interval, **options)
        self.heartbeat_grace = heartbeat_grace
        self.batch = batch
        # The most items of a pairing decoded together for a while after a batch of them failed (see batching).
        self.batch_caps: dict[Pairing, BatchCap] = {}
        self.active: dict[str, tuple[Job, object]] = {}  # job id -> (job, execution): what the heartbeat renews
        self.on_job_end: Callable[[], None] | None = None  # e.g. to redraw a progress bar
        self.database_failure: DatabaseFailure | None = None  # why a job RQ ran failed, if the database did
        self.pause = FIRST_PAUSE_S  # before the next try of Redis or the database (see _wait_until)
        # RQ records the bare host name; recover compares this record with its own host, as items
        # name it (pid namespace and boot too), to tell a job whose worker was killed before its claim.
        self.hostname = this_host_and_boot()

    @property
    def asked_to_stop(self) -> bool:
        """Whether a stop was asked for (Ctrl+C, SIGTERM): RQ records it as a stop requested only
        while a job runs, and between jobs, e.g. as a dequeued job's item is read, ends its loop."""
        return self._stop_requested or self._shutdown_requested_date is not None

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        # The heartbeat thread renews the entry every interval, so it only has to outlive one
        # interval plus a grace; SimpleWorker's own choice (the whole job timeout) would keep
        # a killed worker's job looking alive for as long as the timeout. RQ scores registry
        # entries in whole seconds (``current_timestamp`` truncates, cleanup's bound is
        # inclusive), so an entry dies up to a second before its TTL: the extra second keeps
        # the whole grace for a late beat (with a grace of 1 a beat 0.2 s late, e.g. while a
        # model loads, was declared abandoned).
        return int(self.job_monitoring_interval + self.heartbeat_grace) + 1

    def subscribe(self) -> None:
        # RQ's own subscribe with a short poll instead of its 60 s (see the module docstring):
        # after teardown's UNSUBSCRIBE the thread sleeps a whole poll before it sees the stop.
        self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(sleep_time=PUBSUB_POLL_S, daemon=True,
                                                       exception_handler=self._pubsub_exception_handler)

    def execute_job(self, job: Job, queue: Queue) -> None:
        try:
            pairing, size = self._batching(job)
        except DatabaseFailure:  # the plain path runs it: its claim fails, and the worker waits (below)
            pairing, size = None, 1
        stop = threading.Event()
        beat = threading.Thread(target=self._beat, args=(stop,), name="polspec-heartbeat", daemon=True)
        beat.start()
        try:
            if size == 1:
                execution = self.prepare_execution(job)
                self.active[job.id] = (job, execution)
                self.perform_job(job, queue, execution)
                self.job_ended()
                if self.database_failure is not None:  # RQ took it, and retries the job
                    raise self.database_failure
            else:
                run = BatchRun(self, queue, pairing, size)
                run.run(job)
                if run.redis_failed:
                    self._wait_for_redis()
            self.pause = FIRST_PAUSE_S
            self.set_state("idle")
        except redis.RedisError as error:
            log.warning("Redis failed after job %s (%s); its item's state is in the database. Waiting for Redis.",
                        job.id, error)
            self._wait_for_redis()
        except DatabaseFailure as error:
            log.warning("the database failed (%s): the jobs in flight go back to RQ for a retry. Waiting for the "
                        "database.", error)
            self._wait_for_database()
        finally:
            self.database_failure = None
            stop.set()
            beat.join()
            self.active.clear()

    def request_force_stop(self, signum, frame) -> None:
        # RQ ignores a second signal that comes within a second of the first: its worker pool
        # sends duplicates. polspec runs no pool, and a quick double Ctrl+C means stop now.
        # Jobs run in this process (no work horse to take down): stopping is leaving. RQ's job
        # runner swallows the SystemExit; its loop ends on the stop flag, which the first
        # signal's handler sets last: a second signal during that handler would otherwise leave
        # the worker going on to the next item.
        log.warning("stopping now: the items in flight stay running until a worker or recover requeues them")
        self._stop_requested = True
        raise SystemExit()

    def handle_exception(self, job: Job, *exc_info) -> None:
        # A job cut short by the stop above raises SystemExit inside RQ's perform_job: RQ
        # fails (and so retries) the job, as it must, but its traceback would bury the one line
        # that said why. The item itself waits, running, for the next worker or recover.
        if exc_info[0] is SystemExit:
            return
        if isinstance(exc_info[1], DatabaseFailure):
            self.database_failure = exc_info[1]
        super().handle_exception(job, *exc_info)

    def run_maintenance_tasks(self) -> None:
        first = self.last_cleaned_at is None  # run_worker recovered just before
        super().run_maintenance_tasks()
        if first:
            return
        try:
            idle = all(queue.count == 0 for queue in self.queues)
        except redis.RedisError:  # RQ's loop waits for Redis
            return
        if idle:
            self._recover()

    def handle_warm_shutdown_request(self) -> None:
        # Said at warning level so that a user who pressed Ctrl+C sees it took, and what a
        # second one does.
        log.warning("stopping: no new items; finishing the %d in flight (Ctrl+C or SIGTERM again stops at once)",
                    len(self.active))

    def job_ended(self) -> None:
        if self.on_job_end is None:
            return
        try:
            self.on_job_end()
        except Exception as error:  # noqa: BLE001
            # A progress bar is a display: its database read failing must not fail the items
            # still decoding in a batch (each would lose its work and spend one of its retries).
            log.debug("the job-end callback failed: %s", error)

    def _batching(self, job: Job):
        """The job's item pairing and the batch size it decodes at (None: chosen by the batch);
        size 1 for anything that is not a polspec item able to run here, which the plain path
        refuses or skips as before."""
        ctx = context.current()
        item = job_item(job, ctx.database_id)
        pairing = item_pairings(ctx.engine, [item]).get(item) if item is not None else None
        if pairing is None:
            return None, 1
        if pairing.batch is not None:
            return pairing, pairing.batch
        return pairing, 1 if batch_cap(self.batch_caps, pairing) == 1 else self.batch

    def _beat(self, stop: threading.Event) -> None:
        ctx = context.current()
        while not stop.wait(self.job_monitoring_interval):
            # Any error is logged and the next beat tries again: a thread that died on one would
            # let the items' leases run out while they decode, and another worker take them over.
            for job, execution in self.active.copy().values():
                try:
                    self.maintain_heartbeats(job, execution)
                except Exception as error:  # noqa: BLE001
                    log.warning("heartbeat to Redis failed: %s", error)
            items = sorted(ctx.current_items.copy())
            if items:
                try:
                    renew_leases(ctx.engine, items, ctx.me)
                except Exception as error:  # noqa: BLE001
                    log.warning("renewing the leases of items %s failed: %s", items, error)

    def _recover(self) -> None:
        """Give a job to every unfinished item left without one (see the module docstring)."""
        ctx = context.current()
        try:
            requeued = recover(ctx.engine, self.connection, me=ctx.me, lease_s=ctx.lease_s, holding=ctx.current_items)
        # Any error: in RQ's maintenance it would end the worker. The next outage's end, or maintenance, tries again.
        except Exception as error:  # noqa: BLE001
            log.warning("could not recover items left without a job: %s: %s", type(error).__name__, error)
            return
        if requeued.changed:
            log.warning("items left without a job: %s", requeued.describe())

    def _wait_for_redis(self) -> None:
        self._wait_until(self.connection.ping, redis.RedisError)

    def _wait_for_database(self) -> None:
        def write_transaction() -> None:  # what a claim needs: on SQLite it takes the write lock
            with session_scope(context.current().engine) as session:
                session.execute(text("SELECT 1"))

        self._wait_until(write_transaction, DatabaseFailure)

    def _wait_until(self, answers: Callable[[], object], failure: type[Exception]) -> None:
        """Pause, then try ``answers``, with a growing pause, until it raises no ``failure`` (then
        recover what the outage left without a job) or a stop is asked for. The pause goes on
        growing from where it was until a job ends without an outage (see the module docstring)."""
        while not self._stop_requested:
            time.sleep(self.pause)
            self.pause = min(self.pause * 2, WAIT_MAX_S)
            try:
                answers()
            except failure:
                continue
            self._recover()
            return
