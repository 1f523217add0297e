"""``polspec report``: the tables and plots of an evaluation sweep."""

from __future__ import annotations

from pathlib import Path

import click

from polspec.cli.files import write_file_atomically
from polspec.errors import PolspecError


@click.command()
@click.argument("sweep_id", type=int)
@click.option("--format", "fmt", type=click.Choice(["md", "csv", "json"]), default="md", show_default=True,
              help="Markdown tables, or one row per cell as CSV or JSON.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the report to this file (whole or not at all) instead of standard output.")
@click.option("--plots", type=click.Path(file_okay=False, path_type=Path),
              help="Write PNG plots into this directory (created if missing).")
def report(sweep_id: int, fmt: str, output: Path | None, plots: Path | None) -> None:
    """The report of sweep SWEEP_ID (the batch id `polspec enqueue sweep` printed; `polspec
    status` lists them). Per dataset, draft, strategy and k (and temperature and verify where the
    sweep varies them): acceptance per candidate and per draft token, tokens per round, tokens/s, speedup over
    the paired target-only baseline at the same temperature (95% interval over prompts), J/token,
    translation overhead, and the cost model's predicted speedup and break-even acceptance.

    \b
    Examples:
      polspec report 4
      polspec report 4 --format csv --output sweep.csv --plots plots/
    """
    from polspec.report.render import csv_text, json_text, markdown
    from polspec.report.summary import sweep_report
    from polspec.store.migrate import upgraded_database

    with upgraded_database(create=False) as engine:
        summary = sweep_report(engine, sweep_id)
    text = {"md": markdown, "csv": csv_text, "json": json_text}[fmt](summary)
    if plots is not None:  # before the report is written: a bad plots directory leaves nothing behind
        try:
            plots.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise PolspecError(f"{plots}: cannot make the plots directory: {error.strerror}") from None
    if output is None:
        click.echo(text)
    else:
        write_file_atomically(output, lambda handle: handle.write(text + ("" if text.endswith("\n") else "\n")))
        click.echo(f"wrote {output}", err=True)
    if plots is not None:
        from polspec.report.plots import write_plots

        try:
            written = write_plots(summary, plots)
        except OSError as error:
            raise PolspecError(f"{plots}: cannot write the plots: {error.strerror}") from None
        for path in written:
            click.echo(f"wrote {path}", err=True)
