"""``polspec db``: show and upgrade the results database schema."""

from __future__ import annotations

import json

import click

from polspec.store.engine import display_url
from polspec.store.migrate import (
    current_revision,
    head_revision,
    is_newer_than_polspec,
    newer_schema,
    require_named_database,
    upgrade,
)


@click.group()
def db() -> None:
    """Show and upgrade the results database schema (POLSPEC_DB_URL).

    Other commands upgrade the database automatically; the worker refuses to start on an
    out-of-date schema, so run `polspec db upgrade` after upgrading polspec.

    \b
    Examples:
      polspec db current
      POLSPEC_DB_URL=postgresql+psycopg://user@host/polspec polspec db upgrade
    """


@db.command("upgrade")
def upgrade_command() -> None:
    """Upgrade the database to the schema this polspec needs (creating it, and a SQLite file's
    directory, where missing). One process migrates at a time, in one transaction: the upgrade
    applies whole or not at all.

    \b
    Examples:
      polspec db upgrade
      POLSPEC_DB_URL=sqlite:////data/polspec.db polspec db upgrade
    """
    before = upgrade()
    after = current_revision()
    if before == after:
        click.echo(f"{display_url()}: already at revision {after}")
    else:
        click.echo(f"{display_url()}: upgraded from revision {before or 'none (empty)'} to {after}")


@db.command("current")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: url, current, head, up_to_date.")
def current_command(as_json: bool) -> None:
    """Show the database's schema revision and the one this polspec needs.

    \b
    Examples:
      polspec db current
      polspec db current --json | jq .up_to_date
    """
    require_named_database()
    current, head = current_revision(), head_revision()
    if as_json:
        row = {"url": display_url(), "current": current, "head": head, "up_to_date": current == head}
        click.echo(json.dumps(row))
    elif current == head:
        click.echo(f"{display_url()}: revision {current} (up to date)")
    elif is_newer_than_polspec(current):
        click.echo(f"{display_url()}: {newer_schema(current)}")
    else:
        shown = current or "none (empty)"
        click.echo(f"{display_url()}: revision {shown}, polspec needs {head}: run polspec db upgrade")
