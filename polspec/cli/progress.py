"""Rich progress bars: one that library code reports to through a ``ProgressFn`` callback, and
one over the batches in the database that the worker redraws after each job."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from polspec.errors import DatabaseFailure
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

    The bar covers the batches unfinished when it started and those enqueued since (a waiting
    worker is often started first); its speed is the tokens their results gained since it
    started over the time since, whichever workers decoded them. A worker calls it after every
    item, inside a batch's decoding loop, so it redraws at most once a second and at most a
    twentieth of the time; the last state is drawn as the run ends. Off a terminal nothing is
    drawn.
    """
    from polspec.store.engine import make_engine
    from polspec.store.queries import work_progress

    console = Console(stderr=True)
    if not console.is_terminal:
        yield lambda: None
        return
    engine = make_engine()
    began = time.monotonic()
    seen = work_progress(engine, set())
    tokens_before = dict(seen.tokens)  # a batch first seen later started from what it held then
    columns = (TextColumn("[bold]items[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("", total=None)
        due = 0.0

        def draw() -> None:
            nonlocal seen, due
            clock = time.monotonic()
            seen = work_progress(engine, seen.batches)
            for batch in seen.batches:
                tokens_before.setdefault(batch, seen.tokens.get(batch, 0))
            counts = seen.counts
            failed, cancelled = counts.get("failed", 0), counts.get("cancelled", 0)
            gained = sum(seen.tokens.values()) - sum(tokens_before[batch] for batch in seen.tokens)
            elapsed = time.monotonic() - began
            description = (f"{failed} failed " if failed else "") + (f"{cancelled} cancelled " if cancelled else "") \
                + (f"{gained / elapsed:.1f} tok/s" if gained > 0 else "")
            # Cancelled items leave the bar's total: it shows the items that will run.
            progress.update(task, total=sum(counts.values()) - cancelled,
                            completed=counts.get("done", 0) + failed, description=description)
            due = time.monotonic() + max(1.0, 20 * (time.monotonic() - clock))

        def redraw() -> None:
            if time.monotonic() >= due:
                draw()

        draw()
        yield redraw
        with suppress(DatabaseFailure):  # the run is over: a bar that cannot redraw is no error
            draw()
    engine.dispose()
