"""``polspec report``: the tables and plots of an evaluation sweep."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("sweep_id", type=int)
@click.option("--format", "fmt", type=click.Choice(["md", "csv", "json"]), default="md", show_default=True)
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), help="Write the report here.")
@click.option("--plots", type=click.Path(file_okay=False, path_type=Path), help="Write PNG plots into this directory.")
def report(sweep_id: int, fmt: str, output: Path | None, plots: Path | None) -> None:
    """Per dataset, draft, strategy and k (and temperature and verify where the sweep varies
    them): acceptance per candidate and per draft token, tokens per round, tokens/s, speedup over
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

    with upgraded_database() as engine:
        summary = sweep_report(engine, sweep_id)
    text = {"md": markdown, "csv": csv_text, "json": json_text}[fmt](summary)
    if output is None:
        click.echo(text)
    else:
        output.write_text(text + ("" if text.endswith("\n") else "\n"), encoding="utf-8")
        click.echo(f"wrote {output}", err=True)
    if plots is not None:
        from polspec.report.plots import write_plots

        for path in write_plots(summary, plots):
            click.echo(f"wrote {path}", err=True)
