"""What taking many queued jobs out of Redis costs: ``polspec cancel``, ``retry``, ``recover`` and
an enqueue that replaces jobs all go through ``delete_jobs``.

    .venv/bin/python bench/delete_jobs.py --jobs 10000,40000 --markdown    # about 2 minutes

For each size, on a private redis-server started as the queue runs it (AOF on): a queue holds
``jobs`` queued jobs of another batch, then ``jobs`` of this one (a sweep enqueued behind another
on the same target), and this batch's jobs are deleted, once by ``delete_jobs`` and once the way
RQ deletes a job (``Job.delete`` per job, as polspec did before), each on a fresh copy of the
queue. The other batch's jobs must stay, in order.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import time
from pathlib import Path

import redis
from rq.job import Job

from polspec.jobs.local_redis import redis_available
from polspec.jobs.queue import delete_jobs, enqueue_items, fetch_jobs, job_id, make_queue

QUEUE = "polspec-bench"


def delete_one_by_one(connection: redis.Redis, ids: list[str]) -> None:
    """RQ's way: each job fetched, then deleted with its own round trips and its own LREM."""
    for job in fetch_jobs(connection, ids).values():
        if job is not None:
            job.delete()


def timed(connection: redis.Redis, jobs: int, delete) -> float:
    connection.flushall()
    enqueue_items(connection, QUEUE, "other", [(item, 16) for item in range(jobs)])
    enqueue_items(connection, QUEUE, "this", [(item, 16) for item in range(jobs)])
    ids = [job_id("this", item) for item in range(jobs)]
    started = time.perf_counter()
    delete(connection, ids)
    seconds = time.perf_counter() - started
    assert make_queue(connection, QUEUE).job_ids == [job_id("other", item) for item in range(jobs)]
    assert not any(connection.exists(Job.key_for(id_)) for id_ in ids[:: max(1, jobs // 100)])
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="10000,40000", help="comma-separated numbers of jobs to delete")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    sizes = [int(size) for size in args.jobs.split(",")]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{probe.getsockname()[1]}/0"
    with tempfile.TemporaryDirectory() as scratch, redis_available(url, data=Path(scratch)):
        connection = redis.Redis.from_url(url)
        rows = [(jobs, timed(connection, jobs, delete_jobs), timed(connection, jobs, delete_one_by_one))
                for jobs in sizes]
    if args.markdown:
        print("| jobs deleted (behind as many others) | delete_jobs | Job.delete per job | ratio |")
        print("|---|---|---|---|")
    for jobs, bulk, one_by_one in rows:
        if args.markdown:
            print(f"| {jobs:,} | {bulk:.2f} s | {one_by_one:.1f} s | {one_by_one / bulk:.0f}x |")
        else:
            print(f"{jobs} jobs: delete_jobs {bulk:.2f} s, Job.delete per job {one_by_one:.1f} s")


if __name__ == "__main__":
    main()
