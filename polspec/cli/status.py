"""``polspec status``: progress of the batches, read from the database (not from Redis)."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator

import click
from click.core import ParameterSource
from rich.live import Live
from rich.table import Table

from polspec.cli.console import json_lines, output_console
from polspec.cli.options import ROW_ID
from polspec.store.queries import BatchProgress


def _not_nan(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if math.isnan(value):  # FloatRange lets nan through: no comparison with it is true
        raise click.BadParameter("nan is not a number of seconds", param=param)
    return value


@click.command()
@click.argument("batch_id", type=ROW_ID, required=False)
@click.option("--watch", is_flag=True, help="Keep refreshing until every shown batch has finished (Ctrl+C stops).")
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(min=0.1, max=86400),
              callback=_not_nan,
              help="Seconds between refreshes with --watch.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per batch and line (with --watch: all of them again on every change).")
def status(batch_id: int | None, watch: bool, interval: float, as_json: bool) -> None:
    """Show every batch and sweep (newest first), or one: items done, failed, cancelled, running,
    queued, speed, time left.

    "tok/s" is the throughput of the whole run (every token over the wall time workers decoded
    its items, prompt prefill included and model loading not, so items decoded together add up),
    "seq tok/s" the decode speed of one sequence; the time left is at the run's pace so far.

    \b
    Examples:
      polspec status
      polspec status 3 --watch
      polspec status --json | jq .done
    """
    from polspec.store.migrate import upgraded_database
    from polspec.store.queries import batch_progress

    if not watch and click.get_current_context().get_parameter_source("interval") is ParameterSource.COMMANDLINE:
        click.echo("note: --interval has no effect without --watch", err=True)
    with upgraded_database(readonly=True, create=False) as engine:
        batches = batch_progress(engine, batch_id)
        if as_json:
            for batches in _changes(engine, batch_id, batches, interval) if watch else [batches]:
                json_lines(batch.as_dict() for batch in batches)
            return
        console = output_console()
        if not watch:
            console.print(_table(batches))
            return
        if console.is_terminal:
            with Live(_table(batches), console=console, auto_refresh=False) as live:
                for batches in _refreshes(engine, batch_id, batches, interval):
                    live.update(_table(batches), refresh=True)
            return
        # A pipe or a log (`| tee`, nohup): a table whenever something changed, out at once.
        for batches in _changes(engine, batch_id, batches, interval):
            console.print(_table(batches))
            console.file.flush()


def _changes(engine, batch_id: int | None, batches: list[BatchProgress],
             interval: float) -> Iterator[list[BatchProgress]]:
    """``batches``, then the batches again whenever their statuses or counts changed, until
    none of them is unfinished."""
    shown = None
    for batches in itertools.chain([batches], _refreshes(engine, batch_id, batches, interval)):
        seen = [(batch.id, batch.status, batch.counts) for batch in batches]
        if seen != shown:
            yield batches
            shown = seen


def _refreshes(engine, batch_id: int | None, batches: list[BatchProgress],
               interval: float) -> Iterator[list[BatchProgress]]:
    """The batches read again every ``interval`` seconds until none of them is unfinished."""
    from polspec.store.items import UNFINISHED
    from polspec.store.queries import batch_progress

    while any(batch.status in UNFINISHED for batch in batches):
        time.sleep(interval)
        batches = batch_progress(engine, batch_id, before=batches)
        yield batches


def _table(batches: list[BatchProgress]) -> Table | str:
    if not batches:
        return "no batches yet: polspec enqueue generate --help shows how to add one"
    table = Table(title="polspec batches")
    counted = ("done", "failed", "cancelled", "running", "queued")
    for heading in ("batch", "kind", "name", "status", "models", "progress", *counted, "tok/s", "seq tok/s", "ETA"):
        table.add_column(heading, justify="right" if heading in ("batch", *counted, "tok/s", "seq tok/s") else "left")
    for batch in batches:
        share = batch.completed / batch.total if batch.total else 0.0
        bar = "█" * round(share * 12) + "░" * (12 - round(share * 12))
        models = batch.target + (" + " + ", ".join(batch.drafts) if batch.drafts else "")
        table.add_row(str(batch.id), batch.kind, batch.name or "", batch.status, models, f"{bar} {share:4.0%}",
                      *(str(batch.counts.get(s, 0)) for s in counted),
                      _rate(batch.aggregate_tokens_per_s), _rate(batch.tokens_per_s), _duration(batch.eta_s))
    return table


def _rate(tokens_per_s: float | None) -> str:
    return f"{tokens_per_s:.1f}" if tokens_per_s else "-"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
