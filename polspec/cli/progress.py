"""A rich progress bar that library code reports to through a ``ProgressFn`` callback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from polspec.models.fetch import ProgressFn, no_progress


@contextmanager
def progress_bar(title: str) -> Iterator[ProgressFn]:
    """Yield a callback that drives one bar on stderr; the bar disappears when done.

    Off a terminal (logs, pipes, CI) nothing is drawn.
    """
    console = Console(stderr=True)
    if not console.is_terminal:
        yield no_progress
        return
    columns = (TextColumn(f"[bold]{title}[/] {{task.description}}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("", total=None)

        def report(description: str, done: int, total: int | None) -> None:
            progress.update(task, description=description, completed=done, total=total)

        yield report
