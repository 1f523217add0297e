"""Options shared by the commands that decode: models, draft length, translation, sampling."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from pathlib import Path

import click
from click.core import ParameterSource

from polspec.decoding.params import (DRAFT_VOCAB, K_POLICIES, MAX_K, PARTIAL_WORD, STRATEGIES, STRATEGY_OPTIONS, VERIFY,
                                     DecodingParams, options_unread_by)
from polspec.errors import PolspecError

DEFAULT_TARGET = "gemma3-270m"


class RowId(click.ParamType):
    """A batch's or sweep's id: a key of the database's 64-bit integer column, so a larger
    number is refused here, in words, before the driver overflows on it."""

    name = "id"
    LARGEST = 2**63 - 1

    def convert(self, value, param, ctx):
        try:
            number = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not an id (a whole number)", param, ctx)
        if not 1 <= number <= self.LARGEST:
            self.fail(f"{number} is no id: ids are whole numbers from 1 to {self.LARGEST}", param, ctx)
        return number


ROW_ID = RowId()


def a_path(ctx: click.Context, param: click.Parameter, value):
    """A path option's value, refused when empty (an unset shell variable, ``--output ""``): the
    error would otherwise name no file, or the working directory."""
    if value is not None and str(value) in ("", "."):  # a Path type reads "" as "."
        raise click.BadParameter("needs a file path, got an empty one (or '.')")
    return value


def an_output_file(ctx: click.Context, param: click.Parameter, value):
    """An output file option's value (as :func:`a_path`), refused where it is polspec's own
    SQLite database or one of its companion files: an export or a report written there would
    replace every result."""
    from polspec.store.engine import parse_url, sqlite_file

    value = a_path(ctx, param, value)
    database = sqlite_file(parse_url()) if value not in (None, "-") else None
    if database is not None:
        path = Path(value)
        for own in (database, *(database.with_name(database.name + end) for end in ("-wal", "-shm", "-journal"))):
            if path.resolve() == own.resolve():  # a symbolic link is written through; a hard link is replaced
                raise click.BadParameter(f"{value} is a file of polspec's database {database}; write to another file")
    return value


def output_format(ctx: click.Context, fmt: str, output: str | None) -> str:
    """The ``--format`` typed; left out, the one ``--output``'s extension names (``wyniki.csv``
    is CSV) where it is one of the option's choices, else the option's default, with a note
    where the extension names another (``wyniki.tsv`` is not written as tab-separated)."""
    if ctx.get_parameter_source("fmt") is ParameterSource.COMMANDLINE or output in (None, "-"):
        return fmt
    choices = next(param for param in ctx.command.params if param.name == "fmt").type.choices
    named = Path(output).suffix.lower().removeprefix(".")
    if named in choices:
        return named
    if named:
        click.echo(f"note: {output}: .{named} names none of the formats ({', '.join(choices)}): writing {fmt}; "
                   "--format chooses", err=True)
    return fmt


def a_folder(ctx: click.Context, param: click.Parameter, value: str | None) -> Path | None:
    """A folder option's value as a path, refused when empty (``.`` is the working directory)."""
    if value == "":
        raise click.BadParameter("needs a folder, got an empty path (. is the working directory)")
    return None if value is None else Path(value)


class NumberOrName(click.ParamType):
    """A whole number, or one of ``names`` (a policy or setting); ``number`` says which numbers."""

    def __init__(self, names: tuple[str, ...], number: str):
        self.names, self.number = names, number
        self.name = "N|" + "|".join(names)

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        if value.lower() in self.names:
            return value.lower()
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither {self.number} nor one of {', '.join(self.names)}", param, ctx)


_OPTIONS = [
    click.option("--target", default=DEFAULT_TARGET, show_default=True, help="Model alias whose output you get."),
    click.option("--draft", default="none", show_default=True,
                 callback=lambda ctx, param, value: "none" if value.lower() == "none" else value,
                 help="Draft model alias, or none for target-only decoding."),
    click.option("--k", "k", default="2", show_default=True,
                 type=NumberOrName(K_POLICIES, f"a number from 1 to {MAX_K}"),
                 help="Draft tokens per round, or a policy: heuristic (adapts to acceptance), "
                      "confidence (stops when the draft is unsure), auto (from this machine's cost model, "
                      "see polspec models probe; plain decoding when speculation cannot pay; longer "
                      "while the draft is sure of its tokens)."),
    click.option("--strategy", default="aligned", show_default=True,
                 type=click.Choice(STRATEGIES, case_sensitive=False),
                 help="How draft tokens become target tokens when the tokenizers differ, under exact "
                      "verification (greedy, or --verify exact when sampling; tli translates nothing)."),
    click.option("--prefix", default=5, show_default=True, type=int, help="Committed target tokens of context for translation."),
    click.option("--partial-word", default="verify", show_default=True,
                 type=click.Choice(PARTIAL_WORD, case_sensitive=False),
                 help="aligned only: verify the tokens of a word (or trailing whitespace) the draft stopped inside "
                      "(one more position in the same forward), or hold them for the next round (fewer rejected "
                      "candidates)."),
    click.option("--draft-vocab", default="auto", show_default=True,
                 type=NumberOrName(DRAFT_VOCAB, "a number of tokens"),
                 help="Tokens the draft may propose: its N most frequent on Polish text, 1024 to 65536 (a cheaper "
                      "draft step, still lossless), full, or auto (16384 where the draft has 32768 or more)."),
    click.option("--max-tokens", default=128, show_default=True, type=int, help="Tokens to generate at most (up to 1,048,576, and the target's context)."),
    click.option("--temperature", default=0.0, show_default=True, type=float, help="0 is greedy decoding."),
    click.option("--top-p", default=1.0, show_default=True, type=float, help="Nucleus sampling mass, from 1e-6 to 1 (1: off)."),
    click.option("--top-k", default=0, show_default=True, type=int, help="Sample among the k likeliest tokens (0: off)."),
    click.option("--seed", type=int,
                 help="Random seed for sampling, 0 to 2**63 - 1 (default: a new random one each run)."),
    click.option("--verify", default="auto", show_default=True, type=click.Choice(VERIFY, case_sensitive=False),
                 help="When sampling: tli (speculative sampling over the tokens both vocabularies share: the draft "
                      "samples, the target accepts with probability min(1, p/q); keeps acceptance up as the "
                      "temperature rises), exact (a candidate counts only where the target samples the same token), "
                      "or auto (tli). Greedy decoding always verifies by exact match."),
    click.option("--raw", is_flag=True, help="Continue prompts as plain text instead of applying the chat templates."),
]


def decoding_options(command: Callable) -> Callable:
    """Add the model and decoding options; the command receives them as keyword arguments."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def decoding_params(options: dict):
    """DecodingParams from the parsed options (validated there, with one-line errors that name
    the option as it was typed: ``--max-tokens``, where a JSONL line or sweep file says
    ``max_tokens``)."""
    from polspec.decoding.params import DecodingParams
    from polspec.jobs.spec import ITEM_PARAMS

    try:
        return DecodingParams(**{name: options[name] for name in ITEM_PARAMS})
    except PolspecError as error:
        field, _, rest = str(error).partition(" ")
        if field in ITEM_PARAMS and rest:
            raise PolspecError(f"--{field.replace('_', '-')} {rest}") from None
        raise


def note_if_the_draft_is_the_target(target: str, draft: str) -> None:
    """Say so, on stderr, when the draft is the target's own weights: the output stays exact,
    but each draft token costs a target step, so speculation can only lose."""
    from polspec.models.registry import load_registry, same_model

    if draft == "none":
        return
    registry = load_registry()
    if same_model(registry.model(target), registry.model(draft)):
        click.echo(f"note: the draft {draft} is the target's own model: its guesses cost as much as the "
                   "target's steps, so --draft none is faster", err=True)


# Options that change nothing without a draft, and at temperature 0 (greedy decoding).
DRAFT_OPTIONS = ("k", "strategy", "prefix", "partial_word", "draft_vocab", "verify")
SAMPLING_OPTIONS = ("top_p", "top_k", "seed", "verify")


def why_nothing_translates(target: str, draft: str, runs: Iterable[DecodingParams]) -> str | None:
    """Why no round of these ``runs`` translates draft tokens, if none does: the draft shares the
    target's tokenizer family, or every run verifies by speculative sampling (tli), which maps
    tokens. None without a draft (the draft's options are noted as such) or where some run does."""
    from polspec.models.registry import load_registry

    if draft == "none":
        return None
    registry = load_registry()
    if registry.model(draft).tokenizer_family == registry.model(target).tokenizer_family:
        return "with a draft of the target's tokenizer family (its tokens need no translation)"
    if all(run.verification == "tli" for run in runs):
        return ("under --verify tli (auto's choice when sampling): speculative sampling maps tokens, it "
                "translates none")
    return None


def note_options_without_effect(ctx: click.Context, draft: str, sampling: bool, strategies: Collection[str],
                                untranslated: str | None = None) -> None:
    """Say so, on stderr, when options typed on the command line change nothing: the draft's
    without a draft, the sampler's when nothing is sampled (``sampling`` False), a translation
    strategy's own when none of ``strategies`` (those the run uses) reads them, and the
    translation's, ``--strategy`` included, where no round translates (``untranslated`` says
    why). A user who asked for ``--seed 7`` at temperature 0 should not believe the seed was used."""
    typed = [name for name in ctx.params if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE]
    without_draft = [name for name in typed if name in DRAFT_OPTIONS] if draft == "none" else []
    greedy = [name for name in typed if name in SAMPLING_OPTIONS and name not in without_draft] if not sampling else []
    translation = [name for name in typed if name in ("strategy", *STRATEGY_OPTIONS) and name not in without_draft] \
        if untranslated else []
    unread = options_unread_by(strategies, [name for name in typed if name not in without_draft + translation])
    named = ", ".join(sorted(strategies))
    for unused, reason in ((without_draft, "without a --draft"), (greedy, "at --temperature 0 (greedy decoding)"),
                           (translation, untranslated), (unread, f"with --strategy {named}")):
        if unused:
            names = ", ".join("--" + name.replace("_", "-") for name in unused)
            click.echo(f"note: {names} {'has' if len(unused) == 1 else 'have'} no effect {reason}", err=True)
