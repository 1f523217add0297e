"""``polspec enqueue``: put a batch of prompts on the queue for ``polspec worker``."""

from __future__ import annotations

import json
import sys
from collections import Counter
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import click

from polspec.cli.options import (
    a_path,
    decoding_options,
    decoding_params,
    note_if_the_draft_is_the_target,
    note_options_without_effect,
    why_nothing_translates,
)
from polspec.errors import PolspecError
from polspec.jobs.datasets import DATASETS, load_dataset
from polspec.jobs.spec import has_control_characters

if TYPE_CHECKING:
    from polspec.jobs.sweep import SweepPlan


def _batch_name(name: str | None) -> str | None:
    # A blank name could never be found again to resume the batch (a name is how it is found).
    if name is not None and not name.strip():
        raise PolspecError("--name needs some text in it (or leave it out)")
    if name is not None and has_control_characters(name):  # a line break or a tab would break the status table
        raise PolspecError(f"--name may not hold a line break or other control character, got {name!r}")
    return name


@click.group()
def enqueue() -> None:
    """Queue work for `polspec worker`; results land in the database (polspec status, results).

    \b
    Examples:
      polspec enqueue generate --dataset pl-wiki --target qwen2.5-coder-1.5b --draft smollm2-135m
      polspec enqueue sweep --config sweep.toml
    """


@enqueue.command("generate")
@click.option("--input", "input_path", metavar="FILE.jsonl|-", callback=a_path,
              help='Prompts, one JSON object per line: {"id": ..., "prompt": ...} or {"id": ..., "messages": [...]}; '
                   "- reads standard input.")
@click.option("--dataset", help="A built-in Polish set instead: " + ", ".join(DATASETS) + "; a .jsonl path; or hf:OWNER/NAME[:SPLIT].")
@click.option("--limit", type=int, help="Take only the first N prompts (default: all).")
@click.option("--name", callback=lambda ctx, param, value: _batch_name(value),
              help="Name the batch; enqueueing again under the same name adds only new ids "
                   "(not to a cancelled batch: resume it with polspec retry BATCH --cancelled).")
@decoding_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: batch, name, queue, added, existing.")
@click.pass_context
def generate(ctx: click.Context, input_path: str | None, dataset: str | None, limit: int | None, name: str | None,
             target: str, draft: str, raw: bool, as_json: bool, **options) -> None:
    """Queue one generation per prompt, decoded with the options given, on the target's queue
    (polspec-TARGET, which `polspec worker` serves; `--queue TARGET` for that one alone). Give
    --input or --dataset.

    Every line is checked before anything is written: a bad line is reported with its file and
    line number and nothing is queued. A line may set its own max_tokens, k, strategy, prefix,
    partial_word, temperature, top_p, top_k, seed, draft_vocab or verify.

    \b
    Examples:
      polspec enqueue generate --dataset pl-short --limit 12 --draft smollm2-135m
      polspec enqueue generate --input prompts.jsonl --target qwen2.5-coder-1.5b --draft smollm2-135m --name run1
      cat prompts.jsonl | polspec enqueue generate --input - --target qwen2.5-coder-1.5b --json
    """
    from polspec.jobs.control import counted
    from polspec.jobs.enqueue import enqueue_generate
    from polspec.jobs.spec import GenerateSpec, parse_jsonl

    if (input_path is None) == (dataset is None):
        raise PolspecError("give exactly one of --input FILE.jsonl (or - for standard input) and --dataset NAME")
    if limit is not None and limit < 1:
        raise PolspecError(f"--limit must be at least 1, got {limit}")
    params = decoding_params(options)
    if dataset is not None:
        items, source = load_dataset(dataset, params, limit), f"dataset:{dataset}"
    else:
        source = "stdin" if input_path == "-" else input_path
        items = parse_jsonl(_read_lines(input_path), source, params)[:limit]
    spec = GenerateSpec(target, None if draft == "none" else draft, params, False if raw else None, source)
    done = enqueue_generate(spec, items, name)
    note_if_the_draft_is_the_target(target, draft)
    runs = [item.params(params) for item in items]
    note_options_without_effect(ctx, draft, sampling=any(run.temperature > 0 for run in runs),
                                strategies={run.strategy for run in runs},
                                untranslated=why_nothing_translates(target, draft, runs))
    if as_json:
        click.echo(json.dumps({"batch": done.batch_id, "name": done.name, "queue": done.queue,
                               "added": done.added, "existing": done.existing}))
        return
    label = f"batch {done.batch_id}" + (f" ({done.name})" if done.name else "")
    already = f", {done.existing} already there" if done.existing else ""
    click.echo(f"{label}: {counted(done.added)} queued on {done.queue}{already}")
    click.echo(f"run them with: polspec worker --burst    follow with: polspec status {done.batch_id} --watch")


def _read_lines(path: str) -> list[bytes]:
    if path == "-":
        if sys.stdin is None:  # started with standard input closed (<&-)
            raise PolspecError("standard input is closed: give --input a file, or pipe the lines in")
        try:
            return sys.stdin.buffer.read().splitlines()
        except OSError as error:
            raise PolspecError(f"standard input: {error.strerror}") from None
    try:
        with open(path, "rb") as handle:
            return handle.read().splitlines()
    except OSError as error:
        raise PolspecError(f"{path}: {error.strerror}") from None


def _print_example(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        click.echo(resources.files("polspec.data").joinpath("sweep-offline.toml").read_text(encoding="utf-8"), nl=False)
        ctx.exit()


@enqueue.command("sweep")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              callback=a_path,
              help="The sweep file (TOML); polspec enqueue sweep --example prints one to start from.")
@click.option("--example", is_flag=True, is_eager=True, expose_value=False, callback=_print_example,
              help="Print a sweep file that runs on any machine (the offline models), and exit.")
@click.option("--dry-run", is_flag=True,
              help="Check the file and print what it would queue (cells and items per dataset); write nothing.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object: batch, name, queue, cells, items, enqueued, done, resumed, "
                   "was_cancelled, reopened (a resume's failed and cancelled items queued again) "
                   "(with --dry-run: name, queue, cells, items, datasets).")
def sweep(config_path: Path, dry_run: bool, as_json: bool) -> None:
    """Queue an evaluation sweep: every draft, strategy, k and prefix on every dataset, plus a
    target-only baseline per dataset (and seed, temperature and batch size), interleaved prompt by
    prompt so machine drift hits all alike. Settings that would decode alike get one cell: greedy
    cells take the first seed, speculative sampling (tli) the first strategy and prefix, and
    strategies that read no prefix (naive, none) the first prefix. Notes say which.

    The file (TOML) names a target, its drafts and its datasets, and may set: name, strategies,
    k, prefix, limit, max_tokens, temperature or temperatures, verify, top_p, top_k, partial_word,
    draft_vocab, seeds, repeats, batch and raw; README.md ("Evaluation sweeps") says what each
    means.

    Running the same file again resumes the sweep: finished items are kept (a dataset that has
    gained prompts or changed texts since is refused: give the sweep another name).
    Report it with `polspec report SWEEP_ID` when the worker is done.

    \b
    Example:
      polspec enqueue sweep --example > sweep.toml
      polspec enqueue sweep --config sweep.toml --dry-run
      polspec enqueue sweep --config sweep.toml
    """
    from polspec.jobs.enqueue import enqueue_sweep
    from polspec.jobs.sweep import load_sweep

    plan = load_sweep(config_path)
    for note in plan.notes:
        click.echo(f"note: {config_path}: {note}", err=True)
    if dry_run:
        _print_plan(plan, as_json)
        return
    done = enqueue_sweep(plan)
    for earlier in done.earlier:  # an unnamed sweep's file edited: a new sweep, the old one still queued
        click.echo(f"note: sweep {earlier}, from an earlier version of {config_path}, is unfinished and still "
                   f"queued; polspec cancel {earlier} drops it", err=True)
    if as_json:
        click.echo(json.dumps({"batch": done.batch_id, "name": done.name, "queue": done.queue, "cells": done.cells,
                               "items": done.items, "enqueued": done.enqueued, "done": done.done,
                               "resumed": done.resumed, "was_cancelled": done.was_cancelled,
                               "reopened": done.reopened}))
        return
    if done.reopened:  # resuming queues failed and cancelled items again, a cancelled sweep's too
        counts = " and ".join(f"{count} {status}" for status, count in sorted(done.reopened.items()))
        whose = f"sweep {done.batch_id} was cancelled; its" if done.was_cancelled else f"sweep {done.batch_id}'s"
        items = "item is" if sum(done.reopened.values()) == 1 else "items are"
        click.echo(f"note: {whose} {counts} {items} queued again (polspec cancel {done.batch_id} stops them)",
                   err=True)
    verb = "resumed" if done.resumed else "queued"
    waiting = done.items - done.done - done.enqueued  # unfinished items that kept their job
    click.echo(f"sweep {done.batch_id} ({done.name}) {verb}: {done.cells} cells, {done.items} items, "
               f"{done.enqueued} enqueued on {done.queue}" + (f", {waiting} still queued or running" if waiting else "")
               + f", {done.done} already done")
    if done.done == done.items:
        click.echo(f"nothing left to run: polspec report {done.batch_id}")
    else:
        click.echo(f"run them with: polspec worker --burst    then: polspec report {done.batch_id}")


def _print_plan(plan: SweepPlan, as_json: bool) -> None:
    """What a sweep file would queue, per dataset."""
    from polspec.jobs.queue import queue_name

    dataset_of = {cell.key: cell.config["dataset"] for cell in plan.cells}
    cells = Counter(dataset_of.values())
    items = Counter(dataset_of[item.cell] for item in plan.items)
    queue = queue_name(plan.spec.target)
    if as_json:
        click.echo(json.dumps({"name": plan.name, "queue": queue, "cells": len(plan.cells), "items": len(plan.items),
                               "datasets": {name: {"cells": cells[name], "items": items[name]} for name in cells}}))
        return
    click.echo(f"sweep {plan.name} would queue {len(plan.cells)} cells, {len(plan.items)} items on {queue} "
               "(nothing written):")
    for name in cells:
        click.echo(f"  {name}: {cells[name]} cells, {items[name]} items")
