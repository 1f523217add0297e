"""Rich progress bars: one that library code reports to through a ``ProgressFn`` callback, and
one over the batches in the database that the worker redraws after each job."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from polspec.models.fetch import ProgressFn, progress_lines

# Off a terminal, the longest a step goes without a line saying how far it is.
LINE_EVERY_S = 30.0


@contextmanager
def progress_bar(title: str) -> Iterator[ProgressFn]:
    """Yield a callback that drives one bar on stderr; the bar disappears when done.

    Off a terminal (logs, pipes, CI) it writes ``title: step`` lines instead, at each new kind
    of step and every :data:`LINE_EVERY_S` seconds within one.
    """
    console = Console(stderr=True)
    if not console.is_terminal:
        yield progress_lines(lambda line: click.echo(f"{title}: {line}", err=True), LINE_EVERY_S)
        return
    columns = (TextColumn(title, style="bold", markup=False), TextColumn("{task.description}", markup=False),
               BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("", total=None)

        def report(description: str, done: int, total: int | None) -> None:
            progress.update(task, description=description, completed=done, total=total)

        yield report


@contextmanager
def batch_bar() -> Iterator[Callable[[], None]]:
    """Yield a callback that redraws one bar over the unfinished batches, from the database.

    The bar covers the batches that were queued or running when it started. Off a terminal
    nothing is drawn.
    """
    from polspec.store.engine import make_engine
    from polspec.store.items import UNFINISHED
    from polspec.store.queries import batch_progress

    console = Console(stderr=True)
    if not console.is_terminal:
        yield lambda: None
        return
    engine = make_engine()
    watched = [batch.id for batch in batch_progress(engine) if batch.status in UNFINISHED]
    columns = (TextColumn("[bold]items[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("", total=None)

        def redraw() -> None:
            batches = [batch for batch in batch_progress(engine) if batch.id in watched]
            failed = sum(batch.counts.get("failed", 0) for batch in batches)
            cancelled = sum(batch.counts.get("cancelled", 0) for batch in batches)
            speed = [batch.tokens_per_s for batch in batches if batch.tokens_per_s]
            description = (f"{failed} failed " if failed else "") + (f"{cancelled} cancelled " if cancelled else "") \
                + (f"{speed[0]:.1f} tok/s" if speed else "")
            # Cancelled items leave the bar's total: it shows the items that will run.
            progress.update(task, total=sum(b.total for b in batches) - cancelled,
                            completed=sum(b.completed for b in batches), description=description)

        redraw()
        yield redraw
    engine.dispose()
