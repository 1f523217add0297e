"""``polspec results``: list, show, export and query what the workers stored."""

from __future__ import annotations

import csv
import json
import math
from datetime import date, datetime, time
from decimal import Decimal
from pathlib import Path

import click
from rich.table import Table

from polspec.cli.console import json_lines, output_console, utf8_stdout
from polspec.cli.options import ROW_ID, an_output_file, output_format
from polspec.errors import PolspecError
from polspec.files import write_file_atomically
from polspec.store.schema import Status


# Characters of a prompt `results show` prints: the text it led to is the point, and a long
# document given as a prompt would bury it.
SHOWN_PROMPT = 400


@click.group()
def results() -> None:
    """Look at the stored results: every item of every batch, with its metrics (POLSPEC_DB_URL).

    \b
    Examples:
      polspec results list --batch 3
      polspec results show 3 q1
      polspec results export 3 --output wyniki.csv
      polspec results sql "SELECT status, count(*) FROM items GROUP BY status"
    """


@results.command("list")
@click.option("--batch", "batch_id", type=ROW_ID, help="Only this batch.")
@click.option("--status", type=click.Choice([status.value for status in Status], case_sensitive=False),
              help="Only items in this state.")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(min=0, max=10**9),
              help="Show at most N items (0: all).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per item and line.")
def list_command(batch_id: int | None, status: str | None, limit: int, as_json: bool) -> None:
    """Items with their status, the start of their text, speed and acceptance.

    \b
    Examples:
      polspec results list --batch 3
      polspec results list --status failed
    """
    from polspec.store.migrate import upgraded_database
    from polspec.store.queries import item_rows, require_batch

    with upgraded_database(readonly=True, create=False) as engine:
        if batch_id is not None:
            require_batch(engine, batch_id)  # an unknown batch is an error, not "no items match"
        rows = list(item_rows(engine, batch_id, status, limit + 1 if limit else None))
    if limit and len(rows) > limit:
        rows = rows[:limit]
        newest = "" if batch_id is not None else ", the newest batch first"
        click.echo(f"the first {limit} items{newest}; --limit 0 shows all", err=True)
    if as_json:
        json_lines(rows)
        return
    if not rows:
        click.echo("no items match")
        return
    table = Table()
    for heading in ("batch", "id", "status", "text", "tokens", "tok/s", "B", "accept"):
        table.add_column(heading, overflow="fold" if heading == "text" else "ellipsis")
    for row in rows:
        text = row["text"] if row["text"] is not None else (row["error"] or "")
        table.add_row(str(row["batch"]), row["id"], row["status"], " ".join(text.split())[:80],
                      _number(row["generated_tokens"], "{}"), _number(row["decode_tokens_per_s"], "{:.1f}"),
                      _number(row["batch_size"], "{:.1f}"), _number(row["acceptance_rate"], "{:.0%}"))
    output_console().print(table)


@results.command("show")
@click.argument("batch_id", type=ROW_ID)
@click.argument("item_id")
@click.option("--json", "as_json", is_flag=True, help="Everything stored, as one JSON object.")
def show_command(batch_id: int, item_id: str, as_json: bool) -> None:
    """One item of batch BATCH_ID by ITEM_ID, the id it was enqueued with (the prompt file's "id";
    in a sweep, its cell's key before it and its repeat after, e.g.
    pl-wiki/baseline/s0/wiki-001/r0; `polspec results list --batch BATCH_ID` lists them): prompt,
    text, metrics, provenance.

    \b
    Examples:
      polspec results show 3 q1
      polspec results show 3 q1 --json | jq .metrics
    """
    from polspec.store.migrate import upgraded_database
    from polspec.store.queries import item_detail

    with upgraded_database(readonly=True, create=False) as engine:
        detail = item_detail(engine, batch_id, item_id)
    if as_json:
        json_lines([detail])
        return
    click.echo(f"batch {batch_id} item {detail['id']}: {detail['status']} after {detail['attempts']} attempt(s)")
    prompt = detail["prompt"] if detail["prompt"] is not None else json.dumps(detail["messages"], ensure_ascii=False)
    if len(prompt) > SHOWN_PROMPT:
        prompt = f"{prompt[:SHOWN_PROMPT]}... ({len(prompt):,} characters; --json gives it whole)"
    click.echo(f"prompt: {prompt}")
    settings = ", ".join(f"{key}={value}" for key, value in detail["settings"].items() if value is not None)
    click.echo(f"decoded by: {detail['target']}" + (f" with {detail['draft']}" if detail["draft"] else "")
               + f" ({settings})")
    if detail.get("error"):
        click.echo(f"error: {detail['error']}")
    if "text" in detail:
        click.echo(f"text: {detail['text']}")
        metrics = detail["metrics"]
        shown = {key: metrics.get(key) for key in ("generated_tokens", "decode_tokens_per_s", "acceptance_per_candidate",
                                                    "tokens_per_round", "rounds", "batch_size", "prefill_s", "decode_s",
                                                    "seed")}
        click.echo("metrics: " + ", ".join(f"{key}={_three_digits(value) if isinstance(value, float) else value}"
                                            for key, value in shown.items() if value is not None))
        energy = (f"{detail['energy_joules']:.3g} J ({detail['energy_source']})" if detail["energy_joules"] is not None
                  else f"unavailable: {detail['energy_unavailable_reason']}")
        click.echo(f"energy: {energy}")
        if detail["batch_energy"] is not None:
            click.echo(f"energy of its batch: {_window_line(detail['batch_energy'])}")
        click.echo(f"ran on: {detail['backend']}/{detail['device']}, {detail['worker_host']}")


def _three_digits(value: float) -> str:
    """Three significant digits, and a thousand or more as a whole number: 1234 tok/s, not 1.23e+03."""
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _window_line(window: dict) -> str:
    """An energy window in one line: what it measured, over what, or why it has no joules."""
    where = f"window {window['id']}"
    if not window["ended"]:
        return f"{where} is open: its batch is still decoding, or its end was never recorded (a killed worker)"
    if window["energy_joules"] is None:
        return f"{where}, unavailable: {window['energy_unavailable_reason']}"
    return (f"{where}, {window['energy_joules']:.3g} J ({window['energy_source']}) over "
            f"{window['generated_tokens']} tokens of {window['sequences']} sequences")


@results.command("export")
@click.argument("batch_id", type=ROW_ID)
@click.option("--format", "fmt", type=click.Choice(["csv", "jsonl"], case_sensitive=False), default="jsonl",
              show_default=True, help="Left out, --output's extension chooses (.csv, .jsonl).")
@click.option("--output", type=click.Path(dir_okay=False, allow_dash=True), callback=an_output_file,
              help="Write to this file (whole or not at all); without it, or with -, to standard output.")
@click.pass_context
def export_command(ctx: click.Context, batch_id: int, fmt: str, output: str | None) -> None:
    """Every item of a batch with its text and metrics, as CSV or JSONL (UTF-8), enough to analyse
    and rerun each on its own: the target and draft with the sha256 of their weights, the decoding
    settings (k, strategy, verify, prefix, partial_word, draft_vocab, confidence, k_max,
    temperature, top_p, top_k, seed, max_tokens, chat), a sweep item's dataset, prompt, repeat,
    cell batch size and whether it is the baseline, the
    prompt, the text and why it ended, speed, acceptance and what the rounds did, and energy: its
    own, or the batch's it decoded in (window_*), never 0 for none.

    A CSV file (--output) starts with a byte-order mark so that spreadsheets show Polish letters correctly;
    messages are a JSON string in their column. A file is written whole or not at all. Items
    without a result yet (a running batch) are rows without text, and a note on standard error
    counts them.

    \b
    Examples:
      polspec results export 3 --output wyniki.csv
      polspec results export 3 > wyniki.jsonl
    """
    from polspec.store.migrate import upgraded_database
    from polspec.store.queries import EXPORT_COLUMNS, item_rows, require_batch

    fmt = output_format(ctx, fmt, output)
    counts = {"items": 0, "unfinished": 0}

    def counted(rows):
        for row in rows:
            counts["items"] += 1
            counts["unfinished"] += row["status"] in (Status.QUEUED.value, Status.RUNNING.value)
            yield row

    with upgraded_database(readonly=True, create=False) as engine:
        require_batch(engine, batch_id)  # an unknown batch is an error, not an empty file
        rows = counted(item_rows(engine, batch_id))
        if output in (None, "-"):
            with utf8_stdout() as stdout:
                _write(stdout, rows, fmt, EXPORT_COLUMNS, bom=False)
        else:
            write_file_atomically(Path(output),
                                  lambda handle: _write(handle, rows, fmt, EXPORT_COLUMNS, bom=fmt == "csv"))
            click.echo(f"wrote {output}", err=True)
    if not counts["items"]:
        click.echo(f"note: batch {batch_id} has no items", err=True)
    elif counts["unfinished"]:
        click.echo(f"note: batch {batch_id} is not finished: {counts['unfinished']} of {counts['items']} items "
                   "have no result yet", err=True)


def _write(handle, rows, fmt: str, columns: tuple[str, ...], bom: bool) -> None:
    if fmt == "jsonl":
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        return
    if bom:
        handle.write("\ufeff")
    writer = csv.DictWriter(handle, fieldnames=columns)
    writer.writeheader()
    for row in rows:
        writer.writerow({name: json.dumps(value) if isinstance(value, bool) else value for name, value in row.items()}
                        | {"messages": json.dumps(row["messages"], ensure_ascii=False) if row["messages"] else ""})


@results.command("sql")
@click.argument("query")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per row and line.")
def sql_command(query: str, as_json: bool) -> None:
    """Run one SQL query on a read-only connection (tables: batches, items, results, cells
    for sweeps, and energy_windows for the energy of items a worker decoded together).

    \b
    Examples:
      polspec results sql "SELECT status, count(*) FROM items GROUP BY status"
      polspec results sql "SELECT avg(acceptance_rate) FROM results" --json
    """
    from polspec.store.migrate import upgraded_database
    from polspec.store.queries import run_sql

    with upgraded_database(readonly=True, create=False) as engine:
        columns, rows = run_sql(engine, query)
    if as_json:
        twice = next((column for index, column in enumerate(columns) if column in columns[:index]), None)
        if twice is not None:  # an object keeps one value a key: the other column would vanish
            raise PolspecError(f"the query returns two columns named {twice!r}; for --json, name them apart "
                               "with AS")
        json_lines(dict(zip(columns, map(_json_value, row), strict=True)) for row in rows)
        return
    table = Table()
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*("" if value is None else str(value) for value in row))
    output_console().print(table)


def _json_value(value):
    """A value of a query's row as JSON gives it on either database: PostgreSQL's numeric (an
    average, a rounding) as a number, as SQLite's, not as a string; a time in ISO 8601. JSON has
    no infinities or NaN (SQLite has): they go out as text, as the table shows them."""
    if isinstance(value, Decimal):
        value = int(value) if value.is_finite() and value == value.to_integral_value() else float(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value.isoformat() if isinstance(value, datetime | date | time) else value


def _number(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)
