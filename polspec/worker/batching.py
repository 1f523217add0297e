"""Continuous batches of queued items: how a batched worker feeds the batched decoder.

RQ hands a worker one job at a time. A batched polspec worker takes the first job from RQ's
loop as usual, then takes more jobs itself (:func:`take_jobs`): it reads the head of the
job's queue, keeps the jobs whose items share the first one's
:class:`~polspec.store.items.Pairing` (same target, same draft, same batch size) and removes
each from the queue with ``LREM``, which only one of two workers racing for a job can win.
Items that do not fit stay queued for a later batch.

Per item, what a job run alone guarantees still holds: the item is claimed in the database
before it joins the batch, its lease and its job's heartbeat are renewed while it decodes,
and the moment it finishes its result and status are written in one transaction and its job
goes through RQ's own success or failure handling (results, retries, failure reasons).
Between rounds the batch drops cancelled items and items past their job's RQ timeout (which
fail, and retry, as a timed-out job does), and a freed slot takes the next queued item. A
warm shutdown (the first Ctrl+C) stops taking items and finishes the ones in flight.

A round that fails (out of memory, most likely, or something in one item) takes the whole
batch down, and a batch cannot tell which: where the worker chose the batch size (not a sweep
cell, whose size is what it measures), its items go back to the queue with their tries intact
and the worker decodes that pairing at most half as many at a time (of those in flight, rounded
up), down to one at a time, where an item's own error counts against it alone. The cap holds for
:data:`CAP_HOLD_S`, twice as long after each further failure: memory another program held
for a while does not halve a night's batches for good, and a real limit costs a failed batch
ever more rarely. Elsewhere every item in flight fails and is retried, as a job that raised.

Redis is only the delivery channel: if it fails mid-batch, decoding goes on, every result is
still written to the database, and the jobs' RQ bookkeeping is left to ``recover``. The
database failing mid-batch (a restart, SQLite locked past its busy timeout) drops nothing
either: decoding goes on without the cancel check and without new items (an item whose claim
failed goes back to the queue, and refills wait until a result is stored), and a finished
result waits in the worker until the database takes it (:func:`~polspec.worker.tasks.store_result`),
the batch with it, its other items' job timeouts held meanwhile.

Energy: where a meter works, the batch is measured as one energy window
(:mod:`polspec.store.energy_windows`) that each of its results names, from its first round to
its end, less any probe measured and any database write waited on meanwhile (the models are
loaded before). A meter reads the
whole machine, so an item's own joules stay unavailable, with the reason; a report sums whole
windows instead. Energy is a record, not the work: a meter or a window that fails leaves the
energy unavailable and every item decoding.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import mlx.core as mx
import redis
from rq.exceptions import DeserializationError
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.timeouts import JobTimeoutException
from rq.utils import now
from sqlalchemy import Engine

from polspec.decoding.batch import BatchDecoder, SequenceEvent, best_batch_size
from polspec.decoding.params import DecodingParams
from polspec.decoding.run import Transcript
from polspec.errors import DatabaseFailure, PolspecError
from polspec.jobs.queue import JOB_FUNCTION, JOB_TIMEOUT_PER_TOKEN_S
from polspec.jobs.spec import GenerateSpec
from polspec.models.loader import LoadedModel
from polspec.store.energy_windows import close_energy_window, open_energy_window
from polspec.store.items import Pairing, claim_item, fail_item, item_pairings
from polspec.store.schema import Status
from polspec.worker import FIRST_PAUSE_S, context
from polspec.worker.energy import EnergyReading, Measurement
from polspec.worker.tasks import (PROGRESS_INTERVAL_S, item_probe, known_cancelled, load_models, prompt_of,
                                  result_row, store_result, when_the_database_answers)

if TYPE_CHECKING:
    from polspec.worker.worker import PolspecWorker

log = logging.getLogger("polspec.worker")
T = TypeVar("T")

SCAN_DEPTH = 256  # queued jobs read per refill when looking for items that fit the batch
PROMPT_ALLOWANCE = 512  # prompt tokens allowed for per sequence when sizing a batch by memory
REFILL_WAIT_MAX_S = 300.0  # the longest a batch goes without refills after the database failed one
CAP_HOLD_S = 3600.0  # how long a batch cap first holds after a failed batch (see the module docstring)
# The largest plain step a chosen batch size may take, as a share of the job timeout's allowance
# a token: the probe times a step over a short context, steps grow as the sequences do, and an
# item must finish within its job's timeout however long it runs.
STEP_SHARE_OF_TIMEOUT = 0.75

ExcInfo = tuple[type[BaseException], BaseException, TracebackType]


def job_item(job: Job, database_id: str) -> int | None:
    """The item id of a polspec job for this database; None for any other job, and for a job
    whose data cannot be read (RQ's own handling fails it)."""
    try:
        if job.func_name != JOB_FUNCTION or len(job.args) != 2 or job.args[0] != database_id:
            return None
    except DeserializationError:
        return None
    return job.args[1] if isinstance(job.args[1], int) else None


def take_jobs(queue: Queue, engine: Engine, database_id: str, pairing: Pairing, count: int) -> list[Job]:
    """Up to ``count`` queued jobs of ``queue`` whose items have ``pairing``, removed from the
    queue in queue order; a job that another worker removes first stays its."""
    ids = queue.get_job_ids(0, SCAN_DEPTH)
    jobs = [job for job in Job.fetch_many(ids, connection=queue.connection, serializer=queue.serializer) if job]
    items = {job.id: job_item(job, database_id) for job in jobs}
    pairings = item_pairings(engine, [item for item in items.values() if item is not None])
    taken: list[Job] = []
    for job in jobs:
        if len(taken) == count:
            break
        if pairings.get(items[job.id]) == pairing and queue.connection.lrem(queue.key, 1, job.id):
            taken.append(job)
    return taken


@dataclass(frozen=True)
class BatchCap:
    """After a batch of a pairing failed: at most ``size`` of its items decoded together until
    ``until`` (``time.monotonic()``); ``hold_s`` is how long it holds, doubled by the next failure."""

    size: int
    until: float
    hold_s: float


def batch_cap(caps: dict[Pairing, BatchCap], pairing: Pairing) -> int | None:
    """The most items of ``pairing`` a worker decodes together now; None where no cap holds."""
    cap = caps.get(pairing)
    return cap.size if cap is not None and time.monotonic() < cap.until else None


@dataclass
class _Running:
    """An item decoding in the batch, and its RQ job."""

    job: Job
    execution: Execution
    max_tokens: int
    deadline: float  # time.monotonic() past which the job's RQ timeout has run out
    timings: dict[str, Any]
    joined: float = field(default_factory=time.perf_counter)
    transcript: Transcript = field(default_factory=Transcript)
    timed_out: bool = False


class BatchRun:
    """One continuous batch: items of one pairing join and leave until none is in flight and
    none that fits is queued (see the module docstring). ``max_batch=None`` sizes the batch
    with :func:`~polspec.decoding.batch.best_batch_size` once the models are loaded."""

    def __init__(self, worker: PolspecWorker, queue: Queue, pairing: Pairing, max_batch: int | None):
        self.worker, self.queue, self.pairing, self.wanted = worker, queue, pairing, max_batch
        self.ctx = context.current()
        self.running: dict[int, _Running] = {}
        self.decoder: BatchDecoder | None = None
        self.target: LoadedModel | None = None
        self.draft: LoadedModel | None = None
        self.full_size = 0  # the batch's size where no cap holds, set with the decoder
        self.next_check = 0.0
        self.refill_pause, self.refill_after = 0.0, 0.0  # refills wait this long after the database failed one
        self.redis_failed = False
        self.energy = Measurement(self.ctx.meter, mx.synchronize)
        self.window_id: int | None = None
        self.window_failure: str | None = None  # why the window could not be recorded
        self.window_sequences = self.window_tokens = 0

    def run(self, job: Job) -> None:
        """Decode ``job`` (delivered by RQ's loop) and every job that joins it."""
        stopped = None  # why the batch ended before its last item did
        try:
            self._start(job, first=True)
            self._refill()
            while self.running:
                self._measure()
                try:
                    events = self.decoder.step()
                except Exception as error:  # noqa: BLE001 - out of memory and the like (see the module docstring)
                    stopped = f"decoding failed in the middle of the batch: {type(error).__name__}: {error}"
                    self._fail_batch(sys.exc_info())
                    break
                for event in events:
                    self._record(event)
                # Looking for new items costs Redis and database round trips: only when a slot
                # was freed, or once a second.
                if self._check() or any(event.finished for event in events):
                    self._refill()
        except (SystemExit, KeyboardInterrupt):
            stopped = "the worker stopped in the middle of the batch"
            raise
        except DatabaseFailure as error:  # the worker waits for the database; RQ retries the items
            stopped = f"the database failed in the middle of the batch: {error}"
            exc_info = sys.exc_info()
            for running in list(self.running.values()):
                self._fail(running.job, running.execution, exc_info, record=False)
            self.running.clear()
            raise
        except BaseException as error:
            stopped = f"the batch ended on an error: {type(error).__name__}: {error}"
            raise
        finally:
            # Leases of items left behind (the worker stopping, Redis failing) run out, so that
            # recover or another worker can take them; this worker's heartbeat must not renew them.
            self.ctx.current_items.difference_update(self.running)
            self._close_window(stopped)
        mx.clear_cache()

    # --- the batch's energy -----------------------------------------------------------------

    def _measure(self) -> None:
        """Before a round: the batch's energy window exists (so that every result can name it)
        and its meter runs."""
        if self.ctx.meter is None or self.window_failure is not None:
            return
        if self.window_id is None:
            try:
                self.window_id = open_energy_window(self.ctx.engine, self.ctx.me)
            except Exception as error:  # noqa: BLE001 - the database's fault; decoding goes on unmeasured
                self.window_failure = f"its energy window could not be recorded: {error}"
                log.warning("the batch's energy goes unrecorded: %s", self.window_failure)
                return
        self.energy.resume()
        self.energy.renew()  # a batch can decode for hours: its meter is read every minute

    def _close_window(self, stopped: str | None) -> None:
        """Record the batch's energy; ``stopped`` says why the batch ended early, if it did:
        then the joules include sequences that never finished, and are not recorded."""
        if self.window_id is None:
            return
        self.energy.pause()
        reading = self.energy.reading() if stopped is None else EnergyReading(unavailable_reason=stopped)
        try:
            close_energy_window(self.ctx.engine, self.window_id, sequences=self.window_sequences,
                                generated_tokens=self.window_tokens, joules=reading.joules,
                                source=reading.source, unavailable_reason=reading.unavailable_reason)
        except Exception as error:  # noqa: BLE001 - every result is stored already; the window stays open
            log.warning("could not record the energy of the batch (window %d): %s", self.window_id, error)

    # --- items joining ----------------------------------------------------------------------

    def _start(self, job: Job, first: bool = False) -> None:
        """RQ's bookkeeping for a starting job, then the item's claim, and the item joins."""
        if job.args[1] in self.running:
            # Its job again, under the same id (a recover read it as queued as this batch took
            # it): the claim would pass, this worker holding the item, and the decoder refuse
            # it, which would fail an item that is decoding. The first delivery ends the job.
            log.info("item %d is in this batch already: its job's second delivery is dropped", job.args[1])
            return
        execution = self.worker.prepare_execution(job)
        self.worker.prepare_job_execution(job, remove_from_intermediate_queue=first and len(self.worker.queues) == 1)
        job.started_at = now()
        self.worker.active[job.id] = (job, execution)
        item_id = job.args[1]
        try:
            claim = claim_item(self.ctx.engine, item_id, self.ctx.me, self.ctx.lease_s)
        except DatabaseFailure:  # the item never ran: RQ queues its job again, with its try given back
            job.retries_left = (job.retries_left or 0) + 1
            self._fail(job, execution, sys.exc_info(), record=False)
            raise
        if isinstance(claim, str):
            self._succeed(job, execution, {"item": item_id, "skipped": claim})
            return
        self.ctx.current_items.add(item_id)
        try:
            spec, params = GenerateSpec.from_dict(claim.spec), DecodingParams(**claim.params)
            timings = self._prepare(spec, params)
            self.decoder.add(item_id, prompt_of(claim), params, spec.chat)
        except PolspecError as error:  # this item cannot run (a prompt too long, a model that fails to load)
            reason = str(error)
            self._outside_the_window(lambda: when_the_database_answers(
                lambda: fail_item(self.ctx.engine, item_id, self.ctx.me, reason, final=True),
                f"the failure of item {item_id}"))
            self.ctx.current_items.discard(item_id)  # its lease renewed while the failure waited
            self._succeed(job, execution, {"item": item_id, "failed": reason})
            return
        except Exception:  # noqa: BLE001 - out of memory while loading and the like: RQ tries the job again
            self._fail(job, execution, sys.exc_info())
            return
        deadline = time.monotonic() + (job.timeout or Queue.DEFAULT_TIMEOUT)
        self.running[item_id] = _Running(job, execution, params.max_tokens, deadline,
                                         timings | {"attempt": claim.attempt})

    def _prepare(self, spec: GenerateSpec, params: DecodingParams) -> dict[str, float]:
        """Models and decoder (the first item loads them), and the pair's probe: read by the
        first item, measured with its batch table when an ``auto`` item needs one that lacks it."""
        clock = time.perf_counter()
        if self.target is None:
            self.target, self.draft = load_models(self.ctx, spec)
        load_s = time.perf_counter() - clock
        clock = time.perf_counter()
        held = self.decoder.probe if self.decoder is not None else None
        if self.decoder is None or (params.k == "auto" and not (held and held.batch)):
            # A probe is not decoding: left out of the window.
            held = self._outside_the_window(lambda: item_probe(self.target, self.draft, params, batched=True))
        probe_s = time.perf_counter() - clock
        longest = params.max_tokens + PROMPT_ALLOWANCE
        if self.decoder is None:
            # Without a probe's table the size is found by timing steps: no decoding either.
            self.full_size = self.wanted or self._outside_the_window(lambda: best_batch_size(
                self.target, self.draft, held, longest, STEP_SHARE_OF_TIMEOUT * JOB_TIMEOUT_PER_TOKEN_S))
            self.decoder = BatchDecoder(self.target, self.draft, self._allowed(), held, longest)
            log.info("decoding %s%s in batches of up to %d", spec.target, f" + {spec.draft}" if spec.draft else "",
                     self.decoder.max_batch)
        self.decoder.probe = held
        return {"model_load_s": load_s, "probe_s": probe_s}

    def _allowed(self) -> int:
        """The batch's size now: its full size, or less while a cap holds."""
        return min(self.full_size, batch_cap(self.worker.batch_caps, self.pairing) or self.full_size)

    def _refill(self) -> None:
        if self.decoder:
            self.decoder.max_batch = self._allowed()  # a cap that ran out widens the batch
        free = self.decoder.max_batch - len(self.running) if self.decoder else 0
        if free <= 0 or self.worker._stop_requested or time.monotonic() < self.refill_after:
            return
        try:
            jobs = take_jobs(self.queue, self.ctx.engine, self.ctx.database_id, self.pairing, free)
        except redis.RedisError as error:
            self._redis_failed(error)
            return
        except DatabaseFailure as error:  # the batch in flight goes on
            log.debug("no refill: %s", error)
            self._refill_later()
            return
        for index, job in enumerate(jobs):
            try:
                self._start(job)
            except redis.RedisError as error:  # taken off the queue already: recover queues its item again
                self._redis_failed(error)
                return
            except DatabaseFailure as error:
                log.warning("the database failed as item %d joined the batch (%s): it goes back to the queue, "
                            "and the batch in flight goes on", job.args[1], error)
                self._put_back(jobs[index + 1:])
                self._refill_later()
                return

    def _refill_later(self) -> None:
        """Refills wait after the database failed one, longer each time, until a result is
        stored: under SQLite's lock a claim waits out the whole busy timeout first, and the
        batch with it (the reads that choose the jobs pass, as readers do)."""
        self.refill_pause = min(max(2 * self.refill_pause, FIRST_PAUSE_S), REFILL_WAIT_MAX_S)
        self.refill_after = time.monotonic() + self.refill_pause

    def _put_back(self, jobs: list[Job]) -> None:
        """Jobs taken off the queue but not started go back to its head, in their order."""
        if not jobs:
            return
        try:
            self.queue.connection.lpush(self.queue.key, *reversed([job.id for job in jobs]))
        except redis.RedisError as error:  # recover queues their items again
            self._redis_failed(error)

    # --- between rounds and leaving ---------------------------------------------------------

    def _check(self) -> bool:
        """Once a second: drop cancelled items and items past their timeout, publish progress.
        Returns whether it ran."""
        if time.monotonic() < self.next_check or not self.running:
            return False
        self.next_check = time.monotonic() + PROGRESS_INTERVAL_S
        for item_id in known_cancelled(self.ctx, list(self.running)):
            self.decoder.remove(item_id)
        for item_id, running in self.running.items():
            if time.monotonic() > running.deadline and not running.timed_out:
                running.timed_out = True
                self.decoder.remove(item_id)
            running.job.meta.update(tokens=len(running.transcript.tokens), max_tokens=running.max_tokens,
                                    batch=len(self.running))
        try:
            for running in self.running.values():
                running.job.save_meta()
        except redis.RedisError as error:  # progress is a courtesy; results do not depend on Redis
            self._redis_failed(error)
        return True

    def _fail_batch(self, exc_info: ExcInfo) -> None:
        """A round failed: every item in flight fails, as a job that raised; where the worker
        chose the batch size, with its tries given back, and the pairing's batches halved."""
        count = len(self.running)
        if count > 1 and self.pairing.batch is None:
            before = self.worker.batch_caps.get(self.pairing)
            hold = 2 * before.hold_s if before is not None else CAP_HOLD_S
            cap = self.worker.batch_caps[self.pairing] = BatchCap((count + 1) // 2, time.monotonic() + hold, hold)
            log.warning("a batch of %d failed (%s: %s): its items go back to the queue, and for %d minutes this "
                        "worker decodes them at most %d at a time", count, exc_info[0].__name__, exc_info[1],
                        round(hold / 60), cap.size)
            for running in self.running.values():
                running.job.retries_left = (running.job.retries_left or 0) + 1  # RQ's retry takes it back
        for running in list(self.running.values()):
            self._fail(running.job, running.execution, exc_info)
        self.running.clear()

    def _record(self, event: SequenceEvent) -> None:
        running = self.running[event.key]
        if event.commit is not None:
            running.transcript.add(event.commit)
        if not event.finished:
            return
        self.window_sequences += 1
        self.window_tokens += event.metrics.generated_tokens
        del self.running[event.key]
        if running.timed_out:
            self._fail(running.job, running.execution, _timeout(running.job))
            return
        if event.metrics.finish_reason == "cancelled":
            self._outside_the_window(lambda: when_the_database_answers(
                lambda: fail_item(self.ctx.engine, event.key, self.ctx.me, "cancelled while running", final=True,
                                  status=Status.CANCELLED),
                f"the cancel of item {event.key}"))
            self.ctx.current_items.discard(event.key)
            self._succeed(running.job, running.execution, {"item": event.key, "cancelled": True})
            return
        generation = running.transcript.result(self.target, event.metrics)
        energy = EnergyReading(unavailable_reason=self._energy_reason(event.metrics.batch_size))
        result = result_row(self.target, self.draft, generation, energy, self.decoder.probe if self.draft else None,
                            running.timings | {"generation_s": time.perf_counter() - running.joined}, self.window_id)
        clock = time.monotonic()
        try:
            # The batch waits while the database fails: every row's result would wait alike.
            stored = self._outside_the_window(lambda: store_result(self.ctx, event.key, result))
        except Exception:  # noqa: BLE001 - refused: the item fails with the reason after RQ's retries
            self._fail(running.job, running.execution, sys.exc_info())
            return
        finally:
            for other in self.running.values():  # their RQ timeouts bound decoding, not the batch's pause
                other.deadline += time.monotonic() - clock
        self.ctx.current_items.discard(event.key)  # renewed while its result waited
        self.refill_pause = self.refill_after = 0.0  # the database takes writes: refill at once
        self._succeed(running.job, running.execution,
                      {"item": event.key, "stored": stored, "tokens": result.generated_tokens})

    def _outside_the_window(self, write: Callable[[], T]) -> T:
        """``write()`` (a probe, a database write) with the batch's meter paused: it is no
        decoding, and a write waits as long as the database fails
        (:func:`when_the_database_answers`), its idle joules no decoding's (over an hour, RAPL's
        counter would also wrap unseen)."""
        measuring = self.energy.running
        self.energy.pause()
        try:
            return write()
        finally:
            if measuring:
                self.energy.resume()

    def _energy_reason(self, batch_size: float) -> str:
        if self.ctx.meter is None:
            return self.ctx.meter_reason
        whole = (f"energy window {self.window_id} holds the whole batch's joules" if self.window_id is not None
                 else self.window_failure)
        return (f"decoded in a batch of {batch_size:.1f} sequences on average: {self.ctx.meter_reason} "
                f"reads the whole machine, not one item; {whole}")

    def _succeed(self, job: Job, execution: Execution, summary: dict[str, Any]) -> None:
        self._end(job, lambda: self.worker._finalize_success(job, self.queue, execution, summary))

    def _fail(self, job: Job, execution: Execution, exc_info: ExcInfo, record: bool = True) -> None:
        """Fail the item as a job that raised: final on the last RQ attempt, else retried."""
        item_id = job.args[1]
        if record:
            error = exc_info[1]
            reason = f"{type(error).__name__}: {error}"
            self._outside_the_window(lambda: when_the_database_answers(
                lambda: fail_item(self.ctx.engine, item_id, self.ctx.me, reason, final=not job.retries_left),
                f"the failure of item {item_id}"))
        self.ctx.current_items.discard(item_id)  # its lease renewed while the failure waited
        self._end(job, lambda: self.worker._finalize_failure(job, self.queue, execution, exc_info))

    def _end(self, job: Job, finalize: Callable[[], None]) -> None:
        """The job leaves the heartbeat's care and RQ records how it ended."""
        self.worker.active.pop(job.id, None)
        try:
            finalize()
        except redis.RedisError as error:
            self._redis_failed(error)
        self.worker.job_ended()

    def _redis_failed(self, error: redis.RedisError) -> None:
        if not self.redis_failed:
            log.warning("Redis failed mid-batch (%s): decoding goes on, results go to the database", error)
        self.redis_failed = True


def _timeout(job: Job) -> ExcInfo:
    try:
        raise JobTimeoutException(f"Task exceeded maximum timeout value ({job.timeout} seconds)")
    except JobTimeoutException:
        return sys.exc_info()
