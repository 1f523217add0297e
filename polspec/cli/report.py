"""``polspec report``: the tables and plots of an evaluation sweep."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import click

from polspec.cli.options import ROW_ID, a_folder, an_output_file, output_format
from polspec.errors import PolspecError
from polspec.files import write_file_atomically

if TYPE_CHECKING:
    from polspec.report.summary import SweepReport


@click.command()
@click.argument("sweep_id", type=ROW_ID)
@click.option("--format", "fmt", type=click.Choice(["md", "csv", "json"], case_sensitive=False), default="md",
              show_default=True,
              help="Markdown tables, or one row per cell as CSV or JSON; left out, --output's extension chooses "
                   "(.md, .csv, .json).")
@click.option("--output", type=click.Path(dir_okay=False, allow_dash=True), callback=an_output_file,
              help="Write the report to this file (whole or not at all); without it, or with -, to standard output.")
@click.option("--plots", type=click.Path(file_okay=False), callback=a_folder,
              help="Write PNG plots into this directory (created if missing).")
@click.pass_context
def report(ctx: click.Context, sweep_id: int, fmt: str, output: str | None, plots: Path | None) -> None:
    """The report of sweep SWEEP_ID (the batch id `polspec enqueue sweep` printed; `polspec
    status` lists them). Per dataset, draft, strategy and k (and temperature and verify where the
    sweep varies them): acceptance per candidate and per draft token, tokens per round, tokens/s, speedup over
    the paired target-only baseline at the same temperature (95% interval over prompts), J/token,
    translation overhead, and the cost model's predicted speedup and break-even acceptance.

    \b
    Examples:
      polspec report 4
      polspec report 4 --output sweep.csv --plots plots/
    """
    from polspec.report.render import csv_text, json_text, markdown
    from polspec.report.summary import sweep_report
    from polspec.store.migrate import upgraded_database

    with upgraded_database(readonly=True, create=False) as engine:
        summary = sweep_report(engine, sweep_id)
    destination = None if output in (None, "-") else Path(output)
    fmt = output_format(ctx, fmt, output)
    text = {"md": markdown, "csv": csv_text, "json": json_text}[fmt](summary)
    # Plots first and the report last; on any failure the plots this run added are removed
    # again (with the folders it made for them). Plots it overwrote stay overwritten.
    before = set(plots.iterdir()) if plots is not None and plots.is_dir() else None
    made = _first_missing(plots) if plots is not None else None
    try:
        written = _write_plots(summary, plots) if plots is not None else []
        if destination is None:
            click.echo(text, nl=not text.endswith("\n"))  # CSV ends its last row itself
        else:
            write_file_atomically(destination,
                                  lambda handle: handle.write(text + ("" if text.endswith("\n") else "\n")))
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        elif before is not None and plots.is_dir():
            for path in set(plots.iterdir()) - before:
                path.unlink(missing_ok=True)
        raise
    for path in [*written, *([destination] if destination is not None else [])]:
        click.echo(f"wrote {path}", err=True)
    if not summary.rows:
        click.echo(f"sweep {sweep_id} has no speculative results yet ({summary.done} of {summary.total} generations "
                   "done), so its tables are empty", err=True)


def _write_plots(summary: SweepReport, plots: Path) -> list[Path]:
    from polspec.report.plots import write_plots

    try:
        plots.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise PolspecError(f"{plots}: cannot make the plots directory: {error.strerror}") from None
    try:
        return write_plots(summary, plots)
    except OSError as error:
        raise PolspecError(f"{error.filename or plots}: cannot write the plot: {error.strerror}") from None


def _first_missing(folder: Path) -> Path | None:
    """The outermost of ``folder`` and its parents that does not exist (None if it exists): what
    making ``folder`` creates."""
    missing = None
    for path in (folder, *folder.parents):
        if path.exists():
            break
        missing = path
    return missing
