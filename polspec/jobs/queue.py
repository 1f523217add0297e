"""Redis and RQ as polspec uses them: the connection, queue names, job ids, enqueueing.

Redis only delivers work; the database is the record (see :mod:`polspec.jobs.control`).
Choices, with the reason:

- one queue per target model (``polspec-<alias>``), so a worker keeps one target loaded;
- one job per item with a deterministic id ``polspec-<database id>-<item id>``: enqueueing an
  item twice replaces its job instead of adding a second one, and a worker can tell that a job
  was enqueued against another database sharing the same Redis;
- RQ's JSON serializer, never pickle: a writable Redis must not be a way to run code;
- a finite ``job_timeout`` sized from ``max_tokens`` (RQ's 180 s default is wrong both ways);
- ``Retry(max=RETRIES)`` without an interval, which needs no scheduler process.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import redis
from rq import Queue, Retry
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from polspec.errors import PolspecError
from polspec.settings import redis_url

# The worker runs only this function. Jobs enqueued before it moved into polspec.worker name
# the old path; recover (which every worker runs first) gives them a job under this one.
JOB_FUNCTION = "polspec.worker.tasks.run_item"
RETRIES = 2
# Model loading (first job of a model) plus decoding at a pessimistic 2 s per token.
JOB_TIMEOUT_BASE_S = 600
JOB_TIMEOUT_PER_TOKEN_S = 2
RESULT_TTL_S = 24 * 3600
FAILURE_TTL_S = 7 * 24 * 3600
_ENQUEUE_CHUNK = 1000
# Jobs read per pipeline by job_states: its replies are held in memory until it returns.
_READ_CHUNK = 10_000
# Removes the ids ARGV from the list KEYS[1] in one atomic pass (a worker's pop waits for it),
# keeping the others in order; returns the ids it removed. unpack() is fed slices: Lua's stack
# takes a few thousand values at a time.
_REMOVE_FROM_LIST = """
local removing = {}
for _, id in ipairs(ARGV) do removing[id] = true end
local kept, removed = {}, {}
for _, id in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  if removing[id] then removed[#removed + 1] = id else kept[#kept + 1] = id end
end
if #removed > 0 then
  redis.call('DEL', KEYS[1])
  for first = 1, #kept, 4000 do
    redis.call('RPUSH', KEYS[1], unpack(kept, first, math.min(first + 3999, #kept)))
  end
end
return removed
"""


def display_redis_url(url: str) -> str:
    """The URL without its password, for messages."""
    try:
        parts = urlsplit(url)
    except ValueError:  # unparsable: hide whatever precedes the host
        return url if "@" not in url else "***@" + url.rsplit("@", 1)[1]
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def check_redis_url(url: str) -> None:
    """Refuse a URL redis-py would misread: it takes a database part that is no number for
    database 0, where another database's queues may be."""
    try:
        parts = urlsplit(url)
    except ValueError as error:
        raise PolspecError(f"not a Redis URL: {display_redis_url(url)} ({error})") from None
    database = parts.path.strip("/")
    if parts.scheme in ("redis", "rediss") and database and not (database.isascii() and database.isdigit()):
        raise PolspecError(f"not a Redis URL: {display_redis_url(url)} (after the port comes a database "
                           f"number, not {database!r})")


def connect(url: str | None = None) -> redis.Redis:
    """A checked connection to ``url`` (default ``POLSPEC_REDIS_URL``); unreachable is a one-line error."""
    url = url or redis_url()
    check_redis_url(url)
    try:
        connection = redis.Redis.from_url(url, socket_connect_timeout=5, health_check_interval=30)
        connection.ping()
    except ValueError as error:
        raise PolspecError(f"not a Redis URL: {display_redis_url(url)} ({error})") from None
    except redis.ResponseError as error:  # the server answered: the URL's database or credentials are wrong
        raise PolspecError(f"Redis at {display_redis_url(url)} refused the connection: {error} "
                           "(check the database number and password in POLSPEC_REDIS_URL)") from None
    except redis.RedisError as error:
        raise PolspecError(f"Redis at {display_redis_url(url)} is not reachable: {error} "
                           "(start redis-server, or set POLSPEC_REDIS_URL)") from None
    return connection


def queue_name(target: str) -> str:
    return f"polspec-{target}"


def job_id(database_id: str, item_id: int) -> str:
    return f"polspec-{database_id}-{item_id}"


def job_timeout(max_tokens: int) -> int:
    return JOB_TIMEOUT_BASE_S + JOB_TIMEOUT_PER_TOKEN_S * max_tokens


def make_queue(connection: redis.Redis, name: str) -> Queue:
    return Queue(name, connection=connection, serializer=JSONSerializer)


def enqueue_items(connection: redis.Redis, name: str, database_id: str, items: Sequence[tuple[int, int]]) -> None:
    """Enqueue one job per ``(item id, max_tokens)``, replacing any earlier job of the same item.

    Runs as pipelines of ``_ENQUEUE_CHUNK`` jobs: one round trip per chunk instead of per item.
    """
    queue = make_queue(connection, name)
    for start in range(0, len(items), _ENQUEUE_CHUNK):
        chunk = items[start:start + _ENQUEUE_CHUNK]
        delete_jobs(connection, [job_id(database_id, item_id) for item_id, _ in chunk])
        jobs = [
            Queue.prepare_data(
                JOB_FUNCTION, args=(database_id, item_id), job_id=job_id(database_id, item_id),
                timeout=job_timeout(max_tokens), result_ttl=RESULT_TTL_S, failure_ttl=FAILURE_TTL_S,
                retry=Retry(max=RETRIES), description=f"item {item_id}",
            )
            for item_id, max_tokens in chunk
        ]
        with connection.pipeline() as pipeline:
            queue.enqueue_many(jobs, pipeline=pipeline)
            pipeline.execute()


def fetch_jobs(connection: redis.Redis, ids: Iterable[str]) -> dict[str, Job | None]:
    ids = list(ids)
    return dict(zip(ids, Job.fetch_many(ids, connection=connection, serializer=JSONSerializer), strict=True))


@dataclass(frozen=True)
class JobState:
    """What recovery asks of a job: its RQ status (None if it has none), the function it
    runs (None if its data cannot be read), the worker that started it (None if none has) and
    the queue it was enqueued on."""

    status: JobStatus | None
    func_name: str | None
    worker_name: str | None = None
    origin: str | None = None


def job_states(connection: redis.Redis, ids: Sequence[str]) -> dict[str, JobState | None]:
    """The state of each job, None where there is no job, read as three fields of its hash.

    Not ``Job.fetch_many``: that parses every field (dates, result, metadata) into a Job, which
    for the 345,000 jobs of a large sweep was most of a resume's time and gigabytes of memory.
    A hash without ``data`` counts as no job. The fields are RQ's job hash as ``Job.restore``
    reads it.
    """
    states: dict[str, JobState | None] = {}
    for start in range(0, len(ids), _READ_CHUNK):
        chunk = ids[start:start + _READ_CHUNK]
        with connection.pipeline(transaction=False) as pipeline:
            for id_ in chunk:
                pipeline.hmget(Job.key_for(id_), "status", "data", "worker_name", "origin")
            replies = pipeline.execute()
        for id_, (status, data, worker, origin) in zip(chunk, replies, strict=True):
            states[id_] = None if data is None else JobState(_job_status(status), _func_name(data),
                                                             worker.decode() if worker else None,
                                                             origin.decode() if origin else None)
    return states


def _job_status(raw: bytes | None) -> JobStatus | None:
    try:
        return JobStatus(raw.decode()) if raw else None
    except ValueError:  # a status a newer RQ wrote
        return None


def _func_name(data: bytes) -> str | None:
    try:
        data = zlib.decompress(data)
    except zlib.error:  # RQ reads uncompressed data too
        pass
    try:
        func_name = JSONSerializer.loads(data)[0]
    except (ValueError, TypeError, IndexError, KeyError):  # not a job polspec's serializer wrote
        return None
    return func_name if isinstance(func_name, str) else None


def delete_jobs(connection: redis.Redis, ids: Iterable[str]) -> None:
    """Remove jobs from their queue and registries; ids that do not exist are ignored.

    A queued job, as nearly every job of a batch cancelled or queued again is, is taken apart as
    RQ's delete takes one (out of its queue, its keys deleted) but in bulk: out of each queue in
    one pass (:data:`_REMOVE_FROM_LIST`; RQ's LREM scans the queue once per job) and its keys in
    pipelines (RQ makes several round trips per job): cancelling a sweep of 345,000 queued jobs
    held Redis, and every worker waiting on it, for minutes. Only a job the pass took out of its
    queue is surely no worker's; the others (a few: jobs in other states, or popped since they
    were read) go through RQ's delete, which reads their state again.
    """
    ids = list(ids)
    with connection.pipeline(transaction=False) as pipeline:  # most often none exists: ask before reading them
        for id_ in ids:
            pipeline.exists(Job.key_for(id_))
        present = [id_ for id_, found in zip(ids, pipeline.execute(), strict=True) if found]
    states = {id_: state for id_, state in job_states(connection, present).items() if state is not None}
    queued: dict[str, list[str]] = defaultdict(list)
    for id_, state in states.items():
        if state.status == JobStatus.QUEUED and state.origin:
            queued[state.origin].append(id_)
    remove_from_list = connection.register_script(_REMOVE_FROM_LIST)
    taken_apart: set[str] = set()
    for origin, origin_ids in queued.items():
        for start in range(0, len(origin_ids), _READ_CHUNK):
            removed = [id_.decode() for id_ in remove_from_list(keys=[make_queue(connection, origin).key],
                                                                 args=origin_ids[start:start + _READ_CHUNK])]
            with connection.pipeline(transaction=False) as pipeline:
                for job in (Job(id_, connection=connection) for id_ in removed):
                    pipeline.delete(job.key, job.dependents_key, job.dependencies_key, Result.get_key(job.id))
                pipeline.execute()
            taken_apart.update(removed)
    for job in fetch_jobs(connection, [id_ for id_ in states if id_ not in taken_apart]).values():
        if job is None:
            continue
        try:
            job.delete()
        except NoSuchJobError:
            continue
