"""Faults a batch must survive without losing or duplicating a result.

Workers run as real processes (``polspec worker``) where a test acts on one while it runs (a
kill, a signal, a cancel, Redis restarted under it) or runs two; the others, and every run after
a fault, run in this process. Redis is a real redis-server with AOF that the tests restart.
Every test ends by checking that each item has exactly one result.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest
import redis
from click.testing import CliRunner
from rq import Queue
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from sqlalchemy import func, make_url, select

from polspec.cli import main
from polspec.decoding.batch import BatchDecoder
from polspec.errors import DatabaseFailure
from polspec.jobs.queue import RETRIES, queue_name
from polspec.store.engine import make_engine, session_scope, sqlite_file
from polspec.store.schema import Item, Result
from polspec.store.items import claim_item
from polspec.worker import batching, tasks
from polspec.worker.worker import PolspecWorker
from conftest import sqlite_url
from helpers import shorten_unfinished, start_worker, statuses, wait_for, wait_for_line, worker_in_process

pytestmark = pytest.mark.slow
TARGET = "smollm2-135m"


def enqueue(env: dict[str, str], limit: int, max_tokens: int) -> int:
    result = CliRunner().invoke(main, ["enqueue", "generate", "--dataset", "pl-instruct", "--limit", str(limit),
                                       "--target", TARGET, "--max-tokens", str(max_tokens), "--raw", "--json"], env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["batch"]


def finish(worker: subprocess.Popen, timeout: float = 300) -> str:
    output, _ = worker.communicate(timeout=timeout)
    assert worker.returncode == 0, output
    return output


def assert_each_item_done_once(env: dict[str, str], count: int) -> list[Item]:
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        items = list(session.scalars(select(Item)))
        results = session.scalars(select(Result.item_id)).all()
    engine.dispose()
    assert len(items) == count and [item.status for item in items] == ["done"] * count
    assert sorted(results) == sorted(item.id for item in items)  # one result per item, none twice
    return items


def requeued_after_a_kill(count: int) -> str:
    """What a worker says when it starts after one was killed running ``count`` items."""
    return f"re-enqueued {count} {'item' if count == 1 else 'items'} ({count} worker gone)"


@pytest.fixture
def env(sqlite_env: dict[str, str]) -> dict[str, str]:
    """SQLite: the faults here are the queue's; the database's own are covered on both backends."""
    return sqlite_env


def test_worker_killed_mid_item_then_restarted_does_every_item_once(env):
    enqueue(env, limit=2, max_tokens=4)
    enqueue(env, limit=4, max_tokens=2000)  # the first is the one killed: no machine ends it before
    first = start_worker(env, "--burst", "--batch", "1")
    wait_for(lambda: statuses(env).get("done", 0) == 2 and statuses(env).get("running", 0) == 1, 240,
             "two items done and one running")
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert statuses(env) == {"done": 2, "running": 1, "queued": 3}  # the killed worker's item, left behind

    shorten_unfinished(env, 4)
    output = worker_in_process(env, "--burst", "--batch", "1")
    assert requeued_after_a_kill(1) in output
    items = assert_each_item_done_once(env, 6)
    assert sorted(item.attempts for item in items) == [1, 1, 1, 1, 1, 2]


def test_redis_restarted_mid_batch_loses_nothing(redis_server, tmp_path):
    env = {"POLSPEC_DB_URL": sqlite_url(tmp_path), "POLSPEC_REDIS_URL": redis_server.url}
    enqueue(env, limit=6, max_tokens=16)
    worker = start_worker(env, "--burst", "--batch", "2")  # three batches: the restart comes after the first
    wait_for(lambda: statuses(env).get("done", 0) >= 2, 240, "two items done")
    left = statuses(env)
    redis_server.restart()
    assert left.get("queued", 0) + left.get("running", 0) > 0, left  # the restart came mid-work
    finish(worker)
    assert_each_item_done_once(env, 6)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_claim_the_database_fails_gives_its_job_back_and_stops_no_worker(env, batch, monkeypatch):
    """The database failing as an item is claimed (a restart, SQLite locked past its busy
    timeout; made to fail here for the second claim: a real lock cannot be timed between two
    rounds): its job goes back to RQ and the worker goes on. A batch's error used to end the
    batch in flight, whose items RQ's retry decoded again (attempts 2), and before that RQ's
    loop, and the worker with it; a lone job's was taken by RQ, which went on to the next job,
    failing each at once until their retries ran out. A lone job's worker waits for the
    database, as its next claim would meet the same failure."""
    enqueue(env, limit=3, max_tokens=6)
    claims = []

    def second_claim_fails(engine, item_id, *args):
        claims.append(item_id)
        if len(claims) == 2:
            raise DatabaseFailure("sqlite:///polspec.db", "database is locked (a test's)")
        return claim_item(engine, item_id, *args)

    monkeypatch.setattr(tasks, "claim_item", second_claim_fails)
    monkeypatch.setattr(batching, "claim_item", second_claim_fails)
    output = worker_in_process(env, "--burst", "--batch", str(batch))
    assert ("Waiting for the database" if batch == 1 else
            f"the database failed as item {claims[1]} joined the batch") in output
    assert [item.attempts for item in assert_each_item_done_once(env, 3)] == [1, 1, 1]
    assert len(claims) == 4


@pytest.mark.parametrize("batch", [1, 2])
def test_a_result_meeting_the_database_locked_past_its_busy_timeout_waits_and_is_stored(env, batch, monkeypatch):
    """A long writer (a large sweep's enqueue, a migration) holding SQLite's write lock past the
    busy timeout as an item finishes: its result waits in the worker, the batch with it, and is
    stored once the lock is free. It used to fail every item in flight, whose decoding RQ's
    retry then did again (attempts 2). Another connection takes the lock as the first result
    is stored, and lets it go a second later: a few tries meet it."""
    enqueue(env, limit=3, max_tokens=6)
    database = sqlite3.connect(sqlite_file(make_url(env["POLSPEC_DB_URL"])), isolation_level=None,
                               check_same_thread=False)
    store_result, release, locked = tasks.store_result, threading.Timer(1.0, database.rollback), []

    def the_first_meets_a_lock(ctx, item_id, result):
        if not locked:
            database.execute("BEGIN IMMEDIATE")
            release.start()
            locked.append(item_id)
        return store_result(ctx, item_id, result)

    monkeypatch.setattr(tasks, "store_result", the_first_meets_a_lock)
    monkeypatch.setattr(batching, "store_result", the_first_meets_a_lock)
    output = worker_in_process(env | {"POLSPEC_DB_BUSY_TIMEOUT_MS": "200"}, "--burst", "--batch", str(batch))
    release.join()
    database.close()
    assert f"the result of item {locked[0]} waits in this worker until it answers" in output
    assert f"the database answers again: the result of item {locked[0]} is recorded" in output
    assert [item.attempts for item in assert_each_item_done_once(env, 3)] == [1, 1, 1]


def test_two_batched_workers_on_one_queue_never_duplicate(any_db_env):
    env = any_db_env
    enqueue(env, limit=8, max_tokens=8)
    # Each takes half the cores by itself (polspec.cpu_share): with a thread per core each,
    # OpenBLAS's threads would spin against each other and slow both about eightfold.
    workers = [start_worker(env, "--burst", "--batch", "4") for _ in range(2)]
    for worker in workers:
        finish(worker)
    items = assert_each_item_done_once(env, 8)
    assert all(item.attempts == 1 for item in items)


def test_heartbeat_keeps_a_job_longer_than_the_registry_ttl_alive(env):
    # TTL 3 s (interval 1 + grace 1 + the second RQ's whole-second scores take). The job asks for
    # more tokens than any machine decodes in that time and is cancelled once it has outlived
    # the TTL twice; the test checks for expiry about three times a second meanwhile, from the
    # job's first progress on (the item is claimed before its model loads, which on a slow
    # machine took much of the window, and progress came after it).
    batch = enqueue(env, limit=1, max_tokens=8000)
    connection = redis.Redis.from_url(env["POLSPEC_REDIS_URL"])
    registry = StartedJobRegistry(queue_name(TARGET), connection=connection, serializer=JSONSerializer)
    worker = start_worker(env, "--burst", "--heartbeat-interval", "1", "--heartbeat-grace", "1")
    wait_for(lambda: statuses(env).get("running") == 1, 120, "the item to start")
    (job_id,) = registry.get_job_ids(cleanup=False) or [None]
    assert job_id is not None
    job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
    wait_for(lambda: job.get_meta().get("tokens", 0) > 0, 120, "the job's first progress")
    started = time.monotonic()
    progress = []
    while time.monotonic() - started < 2 * 3 + 1:
        assert statuses(env).get("running") == 1, f"the item ended after {time.monotonic() - started:.1f} s"
        registry.cleanup()  # what any RQ client or worker maintenance does: fails or retries expired jobs
        alive = job_id in registry.get_job_ids(cleanup=False)
        job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
        assert alive and job.get_status() == JobStatus.STARTED, f"declared abandoned after {time.monotonic() - started:.1f} s"
        progress.append(job.get_meta().get("tokens", 0))
        time.sleep(0.3)
    assert max(progress) > 0 and progress == sorted(progress)  # live progress in the job's meta
    assert CliRunner().invoke(main, ["cancel", str(batch)], env=env).exit_code == 0
    finish(worker)
    assert not Queue(queue_name(TARGET), connection=connection, serializer=JSONSerializer).failed_job_registry.count
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        assert [(item.status, item.attempts) for item in session.scalars(select(Item))] == [("cancelled", 1)]
    engine.dispose()


def test_first_sigterm_finishes_the_item_then_stops(env):
    enqueue(env, limit=3, max_tokens=24)
    worker = start_worker(env, "--burst", "--batch", "1")
    wait_for(lambda: statuses(env).get("running") == 1, 120, "an item to start")
    worker.send_signal(signal.SIGTERM)
    finish(worker, timeout=120)
    after = statuses(env)
    assert after.get("done") == 1 and after.get("queued") == 2 and "running" not in after
    shorten_unfinished(env, 4)
    worker_in_process(env, "--burst")
    assert_each_item_done_once(env, 3)


def test_a_sigterm_as_a_dequeued_job_is_read_stops_a_burst_worker(env, monkeypatch):
    """SIGTERM after RQ dequeued a job and before it ran (as the worker reads the job's item): RQ
    ends its loop there without the stop it records while a job runs, and a burst worker found
    the dequeued job lost, queued it again and went on serving all: the stop was ignored. Now it
    stops; the next worker finds the job and runs it."""
    enqueue(env, limit=3, max_tokens=4)
    batching, signals = PolspecWorker._batching, []

    def interrupted(self, job):
        if signals:  # it went on serving after the stop: a cold stop ends it (and fails the test)
            raise SystemExit("served a job after SIGTERM")
        signals.append(signal.SIGTERM)  # first: the handler raises as soon as the signal is sent
        os.kill(os.getpid(), signal.SIGTERM)  # one SIGTERM, as a user sends it
        return batching(self, job)

    monkeypatch.setattr(PolspecWorker, "_batching", interrupted)
    worker_in_process(env, "--burst")
    assert statuses(env) == {"queued": 3}
    monkeypatch.undo()
    assert requeued_after_a_kill(1).replace("worker gone", "job not in its queue") in worker_in_process(env, "--burst")
    assert_each_item_done_once(env, 3)


def test_cancel_stops_a_running_item_between_rounds(env):
    batch = enqueue(env, limit=2, max_tokens=200)
    worker = start_worker(env, "--burst", "--batch", "1")
    wait_for(lambda: statuses(env).get("running") == 1, 120, "an item to start")
    result = CliRunner().invoke(main, ["cancel", str(batch)], env=env)
    assert result.exit_code == 0 and "1 queued item dropped" in result.output
    finish(worker, timeout=120)
    assert statuses(env) == {"cancelled": 2}  # stopped mid-item (200 tokens), no result written
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        assert session.scalar(select(func.count()).select_from(Result)) == 0
    engine.dispose()


# --- the same faults while items decode together (worker --batch) ------------------------------

def test_batched_worker_killed_mid_batch_then_restarted_does_every_item_once(env):
    enqueue(env, limit=2, max_tokens=4)
    enqueue(env, limit=6, max_tokens=2000)  # no machine ends these before the kill, which takes four
    first = start_worker(env, "--burst", "--batch", "4")
    wait_for(lambda: statuses(env).get("done", 0) == 2 and statuses(env).get("running", 0) == 4, 240,
             "two items done and their slots refilled")
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert statuses(env) == {"done": 2, "running": 4, "queued": 2}  # the killed batch's items, left behind

    shorten_unfinished(env, 4)
    output = worker_in_process(env, "--burst", "--batch", "4")
    assert requeued_after_a_kill(4) in output
    items = assert_each_item_done_once(env, 8)
    assert sorted(item.attempts for item in items) == [1] * 4 + [2] * 4


def test_redis_flushed_mid_batch_loses_nothing(env):
    enqueue(env, limit=8, max_tokens=24)
    worker = start_worker(env, "--burst", "--batch", "4")
    wait_for(lambda: statuses(env).get("running", 0) == 4, 240, "a batch of four items decoding")
    redis.Redis.from_url(env["POLSPEC_REDIS_URL"]).flushall()  # the queued jobs and the batch's own are gone
    finish(worker)  # a burst worker recovers the lost queue from the database before it stops
    items = assert_each_item_done_once(env, 8)
    assert all(item.attempts == 1 for item in items)  # the batch in flight finished; nothing ran twice


def test_cancel_stops_one_of_two_batches_decoding_together(env):
    cancelled, kept = enqueue(env, limit=3, max_tokens=200), enqueue(env, limit=3, max_tokens=12)
    worker = start_worker(env, "--burst", "--batch", "8")
    engine = make_engine(env["POLSPEC_DB_URL"])

    def running_in(batch: int) -> int:
        with session_scope(engine) as session:
            return session.scalar(select(func.count()).where(Item.batch_id == batch, Item.status == "running"))

    wait_for(lambda: running_in(cancelled) == 3 and running_in(kept) == 3, 240, "both batches decoding together")
    result = CliRunner().invoke(main, ["cancel", str(cancelled)], env=env)
    assert result.exit_code == 0
    finish(worker, timeout=120)
    with session_scope(engine) as session:
        rows = session.execute(select(Item.batch_id, Item.status, Result.id).outerjoin(Result)).all()
    engine.dispose()
    assert sorted((batch, status, result is not None) for batch, status, result in rows) == \
        [(cancelled, "cancelled", False)] * 3 + [(kept, "done", True)] * 3


def test_first_sigterm_finishes_the_batch_in_flight_then_stops(env):
    enqueue(env, limit=6, max_tokens=24)
    worker = start_worker(env, "--burst", "--batch", "2")
    wait_for(lambda: statuses(env).get("running", 0) == 2, 240, "a batch of two items decoding")
    worker.send_signal(signal.SIGTERM)
    finish(worker, timeout=120)
    after = statuses(env)
    assert after.get("done", 0) >= 2 and after.get("queued", 0) >= 1 and "running" not in after
    shorten_unfinished(env, 4)
    worker_in_process(env, "--burst")
    assert_each_item_done_once(env, 6)


@pytest.mark.parametrize(("batch", "limit", "left"), [(4, 4, {"running": 4}), (1, 2, {"running": 1, "queued": 1})])
def test_second_sigterm_stops_at_once_without_a_traceback_and_the_items_run_again(env, batch, limit, left):
    enqueue(env, limit=limit, max_tokens=2000)  # more than any machine decodes before the stop
    worker = start_worker(env, "--burst", "--batch", str(batch))
    wait_for(lambda: statuses(env).get("running", 0) == batch, 240, f"{batch} items decoding")
    worker.send_signal(signal.SIGTERM)
    # The handler runs when the main thread leaves MLX: wait until the first one took. The
    # second may follow at once (RQ's own worker would take it for a duplicate within a second).
    assert f"finishing the {batch} in flight" in wait_for_line(worker, "stopping: no new items")
    worker.send_signal(signal.SIGTERM)
    output = worker.communicate(timeout=60)[0]
    assert "stopping now" in output and "Traceback" not in output, output
    assert statuses(env) == left  # stopped mid-item, left for the next worker
    shorten_unfinished(env, 4)
    output = worker_in_process(env, "--burst", "--batch", "4")  # the rerun need not take them one at a time
    assert requeued_after_a_kill(batch) in output
    attempts = sorted(item.attempts for item in assert_each_item_done_once(env, limit))
    assert attempts == [1] * (limit - batch) + [2] * batch


def test_a_batch_whose_round_fails_gives_its_items_their_tries_back_and_halves_the_batch(env, monkeypatch):
    """A round that raises in a batch of more than two, as running out of memory would (the
    decoder is made to, over two sequences): every item in flight failed and spent one of its
    three tries, and the next batch of the same size failed alike, so a whole queue could fail
    after three batches. Now the items go back with their tries and the worker decodes two at a
    time: every item is done once, on its second attempt at most, never beside more than one."""
    enqueue(env, limit=6, max_tokens=6)
    step, widths = BatchDecoder.step, []

    def short_of_memory(self):
        width = len(self.rows) + len(self.waiting)
        widths.append(width)
        if width > 2:
            raise MemoryError("a test's memory for two sequences")
        return step(self)

    monkeypatch.setattr(BatchDecoder, "step", short_of_memory)
    output = worker_in_process(env, "--burst", "--batch", "4")
    assert ("a batch of 4 failed (MemoryError: a test's memory for two sequences): its items go back to the queue, "
            "and for 60 minutes this worker decodes them at most 2 at a time") in output
    items = assert_each_item_done_once(env, 6)
    assert sorted(item.attempts for item in items) == [1, 1, 2, 2, 2, 2] and widths[0] == 4 and max(widths[1:]) == 2
    connection = redis.Redis.from_url(env["POLSPEC_REDIS_URL"])
    finished = Queue(queue_name(TARGET), connection=connection, serializer=JSONSerializer).finished_job_registry
    jobs = [Job.fetch(job, connection=connection, serializer=JSONSerializer) for job in finished.get_job_ids()]
    assert len(jobs) == 6 and {job.retries_left for job in jobs} == {RETRIES}  # none spent on the failed batch


def test_a_batch_cap_after_a_failure_that_passed_runs_out_and_the_batch_widens_again(env, monkeypatch):
    """Memory another program held for a while made one batch of four fail: the worker decoded
    that pairing two at a time for the rest of its life (a night's sweep at half its batch).
    The cap now runs out (after CAP_HOLD_S, half a second here), and the batch in flight takes
    four again. The batching clock moves 0.1 s a round and stands still between them: on real
    time, a slow machine's work between the failed batch and the next (failing four items,
    claiming two) could outlast the cap before the capped batch's first round."""
    enqueue(env, limit=12, max_tokens=12)
    step, widths, clock = BatchDecoder.step, [], [0.0]

    def short_of_memory_once(self):
        clock[0] += 0.1
        width = len(self.rows) + len(self.waiting)
        widths.append(width)
        if width > 2 and len(widths) == 1:
            raise MemoryError("a test's memory, short once")
        return step(self)

    monkeypatch.setattr(BatchDecoder, "step", short_of_memory_once)
    monkeypatch.setattr(batching, "CAP_HOLD_S", 0.5)
    monkeypatch.setattr(batching, "time", SimpleNamespace(monotonic=lambda: clock[0], perf_counter=time.perf_counter))
    worker_in_process(env, "--burst", "--batch", "4")
    assert_each_item_done_once(env, 12)
    capped = widths.index(4, 1) if 4 in widths[1:] else len(widths)
    assert widths[0] == 4 and capped > 1 and max(widths[1:capped]) == 2 and capped < len(widths), widths


def test_an_item_past_its_job_timeout_in_a_batch_fails_like_a_timed_out_job_and_is_retried(env):
    enqueue(env, limit=1, max_tokens=2000)  # this one cannot finish within its 1 s, at any speed
    enqueue(env, limit=1, max_tokens=100)  # enough to be decoding beside the other as it times out
    connection = redis.Redis.from_url(env["POLSPEC_REDIS_URL"])
    queue = Queue(queue_name(TARGET), connection=connection, serializer=JSONSerializer)
    jobs = queue.get_jobs()
    jobs[0].timeout = 1  # the other job keeps its own timeout, and finishes
    jobs[0].save()
    worker_in_process(env, "--burst", "--batch", "2")
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        items = {item.id: item for item in session.scalars(select(Item))}
        results = set(session.scalars(select(Result.item_id)))
    engine.dispose()
    timed_out, other = items[jobs[0].args[1]], items[jobs[1].args[1]]
    # RQ's two retries, then failed with the timeout as its reason; the batch-mate is unharmed.
    assert (timed_out.status, timed_out.attempts, timed_out.id in results) == ("failed", 3, False)
    assert "JobTimeoutException" in timed_out.last_error and "(1 seconds)" in timed_out.last_error
    assert (other.status, other.attempts, other.id in results) == ("done", 1, True)
    failed = Job.fetch(jobs[0].id, connection=connection, serializer=JSONSerializer)
    assert failed.get_status() == JobStatus.FAILED and failed.id in queue.failed_job_registry.get_job_ids()
