"""``polspec generate``: one prompt, streamed to the terminal as it is committed."""

from __future__ import annotations

import sys

import click

from polspec.cli.console import json_lines
from polspec.cli.progress import progress_bar
from polspec.cli.options import (
    decoding_options,
    decoding_params,
    note_if_the_draft_is_the_target,
    note_options_without_effect,
    why_nothing_translates,
)


class _Printer:
    """Prints committed text as it grows, holding back an incomplete character."""

    def __init__(self, tokenizer, mark_accepted: bool):
        self.tokenizer = tokenizer
        self.mark = mark_accepted
        self.tokens: list[int] = []
        self.shown = ""
        self.color = sys.stdout.isatty()

    def add(self, tokens: list[int], drafted: int) -> None:
        for index, token in enumerate(tokens):
            self.tokens.append(token)
            text = self.tokenizer.decode(self.tokens)
            if text.endswith("\ufffd"):
                continue
            piece, self.shown = text[len(self.shown):], text
            from_draft = self.mark and index < drafted
            if from_draft and self.color:
                piece = click.style(piece, fg="green", underline=True)
            elif from_draft:
                piece = f"[{piece}]"
            click.echo(piece, nl=False)


@click.command()
@click.argument("prompt")
@decoding_options
@click.option("--show-accepted", is_flag=True, help="Mark text the target accepted from the draft.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: text, token ids, spans, metrics.")
@click.pass_context
def generate(ctx: click.Context, prompt: str, target: str, draft: str, raw: bool, show_accepted: bool, as_json: bool,
             **options) -> None:
    """Generate a continuation of PROMPT, speculatively when a --draft is given.

    The output is always the target's: with a draft, every token is still chosen by the
    target (greedy output equals target-only output token for token). It is faster only when
    the draft is cheap and guesses well: on a 2-core CPU it pays with the 1.5B target and the
    gemma3-270m draft (1.1-1.3x) and is slower with the default 270M target (BENCHMARKS.md has
    the figures). Models with a chat template get PROMPT as a user message; each model renders
    it with its own template.

    \b
    Examples:
      polspec generate "Kraków jest"
      polspec generate "Kraków jest" --target gemma3-270m --draft smollm2-135m --show-accepted
      polspec generate "Napisz haiku o Wiśle." --target qwen2.5-coder-1.5b --draft gemma3-270m --raw --json
    """
    from polspec.decoding.metrics import DecodeMetrics
    from polspec.decoding.probe_files import load_probe
    from polspec.decoding.prompts import chat_mode, check_draft_template, check_prompt
    from polspec.decoding.run import generate as generate_text, probe_outdated, stream
    from polspec.jobs.spec import GenerateSpec, ItemInput, check_items_fit
    from polspec.models.loader import load_model
    from polspec.models.registry import load_registry

    if show_accepted and draft == "none":
        raise click.UsageError("--show-accepted marks text taken from the draft; give a --draft")
    if show_accepted and as_json:
        raise click.UsageError("--show-accepted marks the printed text; with --json the spans say which "
                               "tokens came from the draft")
    params = decoding_params(options)
    check_prompt(prompt)  # before the models load: an empty prompt or a mistyped alias is told at once
    registry = load_registry()
    target_entry = registry.model(target)
    draft_entry = None if draft == "none" else registry.model(draft)
    chat = False if raw else None
    check_draft_template(target_entry, draft_entry, chat_mode(target_entry, chat))
    note_if_the_draft_is_the_target(target, draft)
    note_options_without_effect(ctx, draft, sampling=params.temperature > 0, strategies={params.strategy},
                                untranslated=why_nothing_translates(target, draft, [params]))
    # Where the target's files are here, a prompt too long for it is told before any model loads.
    check_items_fit(GenerateSpec(target, None, params, chat), [ItemInput("PROMPT", prompt)])
    with progress_bar("loading") as report:  # a first use fetches and imports, for minutes
        target_model = load_model(target, progress=report)
        draft_model = None if draft == "none" else load_model(draft, progress=report)
    if draft_model is not None and params.k == "auto" and probe_outdated(load_probe(target, draft), draft_model,
                                                                         draft_vocab=params.draft_vocab):
        click.echo(f"k=auto: measuring what a round costs for {target} with {draft} on this machine, once "
                   "(a minute or two; `polspec models probe` does it ahead of time)", err=True)
    if as_json:
        result = generate_text(target_model, draft_model, prompt, params, chat)
        json_lines([{"target": target, "draft": draft, "params": params.as_dict(), "text": result.text,
                     "token_ids": result.token_ids, "spans": result.spans, "metrics": result.metrics.as_dict()}])
        return
    printer = _Printer(target_model.tokenizer, show_accepted)
    metrics = DecodeMetrics()
    for commit in stream(target_model, draft_model, prompt, params, metrics, chat):
        printer.add(commit.tokens, commit.drafted)
    click.echo()
    if metrics.k_policy_note:  # the draft was loaded but not used, or not to the end: say why
        click.echo(f"note: {metrics.k_policy_note}", err=True)
