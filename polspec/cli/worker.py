"""``polspec worker``: serve queued items with models kept resident."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import click

from polspec.worker import HEARTBEAT_GRACE_S, HEARTBEAT_INTERVAL_S


class BatchSize(click.ParamType):
    """A batch size: a whole number of at least 1, or ``auto``."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if value is None or str(value).lower() == "auto":
            return None
        try:
            size = int(value)
        except (TypeError, ValueError):
            size = 0
        if size < 1:
            self.fail(f"{value!r} is neither a whole number of at least 1 nor 'auto'", param, ctx)
        return size


@click.command()
@click.option("--batch", default="auto", show_default=True, type=BatchSize(),
              help="Items decoded together. auto: as many as pay on this machine (the pair's probe, else 32), "
                   "capped by free memory; 1: one at a time, for per-item latency. A sweep's own 'batch' wins.")
@click.option("--burst", is_flag=True, help="Stop when the queues are empty instead of waiting for more work.")
@click.option("--queue", "queues", multiple=True, metavar="MODEL|QUEUE",
              help="Serve only this target model's queue (repeatable). Default: the queue of every known model.")
@click.option("--log-level", default="WARNING", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="The worker's log output (its own and RQ's): INFO adds each job and each step "
                   "of a first model fetch.")
@click.option("--heartbeat-interval", default=HEARTBEAT_INTERVAL_S, hidden=True, type=click.IntRange(1),
              help="Seconds between heartbeats while a job runs.")
@click.option("--heartbeat-grace", default=HEARTBEAT_GRACE_S, hidden=True, type=click.IntRange(1),
              help="Seconds a missed heartbeat is forgiven before a job counts as abandoned.")
def worker(batch: int | None, burst: bool, queues: tuple[str, ...], log_level: str, heartbeat_interval: int, heartbeat_grace: int) -> None:
    """Run queued generations, writing each result to the database the moment it is done.

    Items with the same target and draft decode together in one continuous batch (one
    forward for all of them; a finished item's slot goes to the next queued one), which
    multiplies throughput on a bandwidth-bound machine. Models stay loaded between jobs. At
    start the worker re-enqueues items whose worker died, and, as polspec recover does, items
    that lost their job (Redis restarted empty, an outage): again after an outage and every
    10-15 minutes while it has nothing to do. Ctrl+C (or SIGTERM) takes no new items, finishes
    the ones in flight and stops; a second one stops at once (those items then run again on
    the next worker; an item whose worker stopped while running it three times fails).

    \b
    Examples:
      polspec worker --burst                 run everything queued, then stop
      polspec worker --batch 1 --burst       one item at a time (latency runs)
      polspec worker --queue gemma3-270m     serve one target model, wait for more
    """
    from polspec.cli.progress import batch_bar
    from polspec.store.migrate import require_current_schema
    from polspec.jobs.control import Requeued
    from polspec.worker.run import WorkerOptions, run_worker

    def started(requeued: Requeued, names: list[str]) -> None:
        if requeued.changed:
            click.echo(requeued.describe(), err=True)
        shown = names if len(names) <= 4 else [*names[:3], f"and {len(names) - 3} more"]
        click.echo(f"serving {', '.join(shown)}" + (" until empty" if burst else ""), err=True)

    require_current_schema()  # before the progress bar reads the database
    with batch_bar() as redraw, _logs_on_stderr(log_level):
        options = WorkerOptions(queues=queues, burst=burst, batch=batch, log_level=log_level,
                                heartbeat_interval=heartbeat_interval, heartbeat_grace=heartbeat_grace)
        run_worker(options, on_start=started, on_job_end=redraw)


@contextmanager
def _logs_on_stderr(level: str) -> Iterator[None]:
    """polspec's own log records (``polspec.*``) on stderr at ``level`` while the block runs, as
    RQ shows its own. Without a handler Python prints only warnings, bare, and drops the INFO
    steps (a first fetch's progress) that ``--log-level INFO`` asks for. Not RQ's
    ``setup_loghandlers``: it sends all but errors to stdout, stops propagation (a test's log
    capture sees nothing) and stays installed on a stream that may be closed after the run."""
    logger = logging.getLogger("polspec")
    handler = logging.StreamHandler()  # sys.stderr as it is now (a test runner swaps it)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    before = logger.level
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)
