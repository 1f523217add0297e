"""``polspec recover``, ``polspec cancel`` and ``polspec retry``: steer batches from the database."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import click

from polspec.cli.options import ROW_ID

if TYPE_CHECKING:
    from redis import Redis
    from sqlalchemy import Engine


@contextmanager
def _connections(if_redis_fails: str = "the database holds the change: polspec recover brings the queue in line "
                                       "once Redis takes writes") -> Iterator[tuple[Engine, Redis]]:
    """The upgraded results database and a checked Redis connection (Redis first: nothing is
    touched when it is unreachable). The batches these commands act on must exist, so a database
    file that does not is an error, not a new one.

    Redis may answer a ping and still refuse writes (out of memory, a read-only replica); that
    shows only after the database has changed, so the error says what the database now holds
    (``if_redis_fails``) and how the queue catches up."""
    import redis

    from polspec.errors import PolspecError
    from polspec.jobs.queue import connect
    from polspec.store.migrate import upgraded_database

    connection = connect()
    with upgraded_database(create=False) as engine:
        try:
            yield engine, connection
        except redis.RedisError as error:
            raise PolspecError(f"Redis failed part-way ({error}); {if_redis_fails}") from None


@click.command()
@click.option("--batch", "batch_id", type=ROW_ID, help="Only this batch.")
def recover(batch_id: int | None) -> None:
    """Re-enqueue unfinished items that no queued job will finish (after Redis lost its data,
    or a worker died). Safe to run at any time: items never run twice. Workers run it at start.

    \b
    Examples:
      polspec recover
      polspec recover --batch 3
    """
    from polspec.jobs.control import recover as recover_items
    from polspec.store.queries import require_batch

    with _connections("the items recovered so far are queued in the database: run polspec recover again once "
                      "Redis takes writes (a worker also recovers as it starts)") as (engine, connection):
        if batch_id is not None:
            require_batch(engine, batch_id)  # an unknown batch is an error, not "nothing to recover"
        report = recover_items(engine, connection, batch_id)
    if not report.changed:
        click.echo("nothing to recover: every unfinished item has a job")
        return
    click.echo(report.describe() + ("; run polspec worker to finish them" if report.total else ""))


@click.command()
@click.argument("batch_id", type=ROW_ID)
def cancel(batch_id: int) -> None:
    """Cancel a batch: queued items are dropped, running ones stop after their current round.

    Finished results are kept; `polspec retry BATCH --cancelled` queues the cancelled items again.

    \b
    Example:
      polspec cancel 3
    """
    from polspec.jobs.control import cancel as cancel_batch
    from polspec.jobs.control import counted

    with _connections() as (engine, connection):
        count, already = cancel_batch(engine, connection, batch_id)
    if already and not count:
        click.echo(f"batch {batch_id} was cancelled already; polspec retry {batch_id} --cancelled resumes it")
        return
    click.echo(f"batch {batch_id} cancelled ({counted(count, 'queued item')} dropped)")


@click.command()
@click.argument("batch_id", type=ROW_ID)
@click.option("--failed", is_flag=True, help="Queue the batch's failed items again.")
@click.option("--cancelled", is_flag=True, help="Queue the batch's cancelled items again: resume a cancelled batch.")
def retry(batch_id: int, failed: bool, cancelled: bool) -> None:
    """Queue a batch's failed or cancelled items again; say which with --failed, --cancelled or both.

    `polspec results list --batch BATCH --status failed` shows why items failed. Finished results
    are kept.

    \b
    Examples:
      polspec retry 3 --failed
      polspec retry 3 --cancelled          resume a batch stopped with polspec cancel 3
    """
    from polspec.jobs.control import counted
    from polspec.jobs.control import retry as retry_items
    from polspec.store.schema import Status

    statuses = (Status.FAILED,) * failed + (Status.CANCELLED,) * cancelled
    if not statuses:
        raise click.UsageError("say which items to queue again: --failed, --cancelled or both")
    which = " or ".join(status.value for status in statuses)
    if_redis_fails = (f"the {which} items of batch {batch_id} are queued again in the database: polspec recover "
                      "(or a worker, as it starts) gives them their jobs once Redis takes writes")
    with _connections(if_redis_fails) as (engine, connection):
        count = retry_items(engine, connection, batch_id, statuses)
    click.echo(f"batch {batch_id}: {counted(count, which + ' item')} queued again" if count
               else f"batch {batch_id} has no {which} items")
