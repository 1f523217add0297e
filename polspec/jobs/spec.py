"""What a generation batch asks for, and the prompt lines it is made of, validated at the edge.

A batch is a :class:`GenerateSpec` (target and draft aliases, decoding parameters, chat or raw
mode) plus a list of :class:`ItemInput`. Prompt files are JSONL, one object per line::

    {"id": "q1", "prompt": "Jaka jest stolica Czech?"}
    {"id": "q2", "messages": [{"role": "user", "content": "Napisz haiku o Wiśle."}], "max_tokens": 64}

Every line is checked before anything is written; the first problem is raised as one
:class:`PolspecError` naming the file and line.
"""

from __future__ import annotations

import codecs
import json
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from polspec.decoding.params import DecodingParams
from polspec.decoding.prompts import (
    chat_mode, check_draft_template, check_messages, check_prompt, check_text, encode_with, too_long,
)
from polspec.errors import PolspecError, past_parser_limits
from polspec.models.registry import ModelEntry, load_registry, same_model

# Decoding parameters a line may set for itself; the rest are per batch.
ITEM_PARAMS = ("max_tokens", "k", "strategy", "prefix", "partial_word", "temperature", "top_p", "top_k", "seed",
               "draft_vocab", "verify")
ITEM_KEYS = ("id", "prompt", "messages", *ITEM_PARAMS)


@dataclass(frozen=True)
class GenerateSpec:
    """The batch-wide request: which models, how to decode, chat template or raw text.

    ``chat=None`` applies the chat template when the target has one. ``source`` says where the
    prompts came from (a file name, ``stdin`` or ``dataset:NAME``), for provenance.
    """

    target: str
    draft: str | None
    params: DecodingParams
    chat: bool | None = None
    source: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"kind": "generate", "target": self.target, "draft": self.draft, "params": self.params.as_dict(),
                "chat": self.chat, "source": self.source}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerateSpec:
        return cls(data["target"], data["draft"], DecodingParams(**data["params"]), data["chat"], data["source"])


@dataclass(frozen=True)
class ItemInput:
    """One prompt: its key within the batch, the text or messages, and its own parameter overrides."""

    key: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    where: str = field(default="", compare=False)  # "FILE:LINE" it was read from, for errors

    def params(self, base: DecodingParams) -> DecodingParams:
        return DecodingParams(**(base.as_dict() | self.overrides))


def has_control_characters(name: str) -> bool:
    """Whether a batch's or sweep's name, or a prompt's id, holds a line break, a tab or another
    control character (a no-break space or a soft hyphen, common in pasted Polish text, is no
    such character)."""
    return any(unicodedata.category(character) in ("Cc", "Zl", "Zp") for character in name)


def check_models(spec: GenerateSpec, items: list[ItemInput], raw_option: str = "--raw") -> None:
    """Refuse, before anything is queued, what would fail on the worker for every item alike:
    an alias the registry does not know (with close matches), messages for a model with no chat
    template, chat mode for a draft with no chat template, or a draft put in the target's
    tokenizer family by mistake (where both are on this machine). ``raw_option`` is how the user
    asks for raw text where the check is made (a sweep file says ``raw = true``). What would fail
    for one item is :func:`check_items_fit`'s."""
    registry = load_registry()
    target = registry.model(spec.target)
    draft = registry.model(spec.draft) if spec.draft is not None else None
    chat = chat_mode(target, spec.chat)
    with_messages = next((item for item in items if item.messages is not None), None)
    if with_messages is not None and not chat:
        reason = f"{raw_option} asks for raw text" if spec.chat is False else f"{target.alias} has no chat template"
        raise PolspecError(f"{with_messages.where or spec.source}: item {with_messages.key!r} has messages, "
                           f"but {reason}; give it a 'prompt'")
    check_draft_template(target, draft, chat, raw_option)
    if draft is not None and draft.tokenizer_family == target.tokenizer_family and not same_model(target, draft):
        _check_family_here(target, draft)


def _check_family_here(target: ModelEntry, draft: ModelEntry) -> None:
    """:func:`~polspec.decoding.translate.check_one_family` for two models of one family, where
    both are on this machine (enqueue may run where they are not: the worker then refuses every
    item alike, with the same reason)."""
    from polspec.decoding.translate import check_one_family
    from polspec.models.files import cached_path
    from polspec.models.tokenizers import tokenizer_from_directory

    target_path, draft_path = cached_path(target), cached_path(draft)
    if target_path is not None and draft_path is not None:
        check_one_family(target, tokenizer_from_directory(target_path, target.alias),
                         draft, tokenizer_from_directory(draft_path, draft.alias))


# Tokens a chat template may add around the messages, for the cheap test below: the registry's
# templates add under 100, and under 16 around each message (ChatML: 5). Every token but a
# template's and a few specials covers at least one byte of the text, so a prompt of N bytes in
# M messages is at most N + these many tokens.
TEMPLATE_TOKENS = 1024
MESSAGE_TOKENS = 16


def check_items_fit(spec: GenerateSpec, items: list[ItemInput]) -> None:
    """Refuse, at its FILE:LINE, an item whose prompt and ``max_tokens`` exceed the target's
    context, as the worker would. This depends on the target alone, so a sweep checks once for
    all its drafts. Only where the target's files are on this machine (enqueue may run where they
    are not: then the worker fails such an item, with the same reason); only items long enough to
    be in doubt are tokenized, so the tokenizer is seldom even loaded."""
    from polspec.models.files import cached_path, context_length

    target = load_registry().model(spec.target)
    path = cached_path(target)
    limit = context_length(path) if path is not None else None
    if not limit:
        return
    budgets = ((item, item.params(spec.params).max_tokens) for item in items)
    in_doubt = [(item, budget) for item, budget in budgets if _byte_bound(item) + TEMPLATE_TOKENS + budget > limit]
    if not in_doubt:
        return
    from polspec.models.tokenizers import tokenizer_from_directory

    tokenizer = tokenizer_from_directory(path, target.alias)
    chat = chat_mode(target, spec.chat)
    for item, budget in in_doubt:
        prompt = item.prompt if item.prompt is not None else item.messages
        try:
            reason = too_long(target, len(encode_with(target, tokenizer, prompt, chat)), budget, limit)
        except PolspecError as error:
            reason = str(error)
        if reason:
            raise PolspecError(f"{item.where or item.key}: {reason}")


def _byte_bound(item: ItemInput) -> int:
    if item.prompt is not None:
        return len(item.prompt.encode("utf-8"))
    return sum(len(message["content"].encode("utf-8")) + MESSAGE_TOKENS for message in item.messages)


def parse_jsonl(lines: Iterable[bytes], source: str, base: DecodingParams) -> list[ItemInput]:
    """Parse and validate JSONL prompt lines (raw bytes, so bad UTF-8 is reported by line).

    Blank lines are skipped. Raises :class:`PolspecError` "SOURCE:LINE: problem" for the first
    bad line; then as :func:`parse_items`.
    """
    return parse_items(_json_lines(lines, source), source, base)


def _json_lines(lines: Iterable[bytes], source: str) -> Iterator[tuple[str, str, Any]]:
    """("SOURCE:N", "line N", the line's JSON value) for every line N that is not blank."""
    for number, raw in enumerate(lines, start=1):
        where = f"{source}:{number}"
        if number == 1:
            raw = raw.removeprefix(codecs.BOM_UTF8)  # editors on Windows start UTF-8 files with one
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise PolspecError(f"{where}: not UTF-8 (byte 0x{raw[error.start]:02x} at column {error.start + 1})") from None
        if not line.strip():
            continue
        try:
            value = json.loads(line, object_pairs_hook=_refusing_repeated_keys)
        except RepeatedKey as error:
            raise PolspecError(f"{where}: {error}") from None
        except json.JSONDecodeError as error:
            # A value cut at the line's end is most often a JSON file written over several lines
            cut = ("; the line ends inside a JSON value, and each line must hold one whole JSON object (JSON Lines)"
                   if error.pos >= len(line.rstrip()) or error.msg.startswith("Unterminated string") else "")
            message = error.msg.removesuffix(" at")  # "Unterminated string starting at" at column N
            raise PolspecError(f"{where}: malformed JSON: {message} at column {error.colno}{cut}") from None
        except (ValueError, RecursionError) as error:
            raise past_parser_limits(where, error) from None
        yield where, f"line {number}", value


class RepeatedKey(Exception):
    """A JSON object that gives one key twice."""


def _refusing_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # JSON keeps the last of a repeated key without a word: a line giving 'max_tokens' or
    # 'prompt' twice says two things, and the user should learn which one is not used.
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise RepeatedKey(f"key {key!r} is given twice")
        data[key] = value
    return data


def parse_items(objects: Iterable[tuple[str, str, Any]], source: str, base: DecodingParams) -> list[ItemInput]:
    """Every (where, place in the source, prompt object) checked by :func:`parse_item`; ids must
    be unique, and an input with no prompts at all is an error too."""
    items: list[ItemInput] = []
    seen: dict[str, str] = {}
    for where, place, data in objects:
        item = parse_item(data, where, base)
        if item.key in seen:
            raise PolspecError(f"{where}: duplicate id {item.key!r} (first on {seen[item.key]})")
        seen[item.key] = place
        items.append(item)
    if not items:
        raise PolspecError(f"{source}: no prompts in it")
    return items


def parse_item(data: Any, where: str, base: DecodingParams) -> ItemInput:
    """One prompt object, checked: keys, id, prompt or messages, and its decoding parameters."""
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", bool: "true or false", int: "a number", float: "a number"}
        raise PolspecError(f"{where}: expected a JSON object, got {kind.get(type(data), 'null')}")
    unknown = sorted(set(data) - set(ITEM_KEYS))
    if unknown:
        raise PolspecError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(ITEM_KEYS)})")
    if "id" not in data:
        raise PolspecError(f"{where}: every line needs an 'id' (a non-empty string or a whole number)")
    key = data["id"]
    if isinstance(key, bool) or not isinstance(key, str | int) or not str(key).strip():
        raise PolspecError(f"{where}: 'id' must be a non-empty string or a whole number, got {json.dumps(key)}")
    try:
        check_text(str(key), "the id")
    except PolspecError as error:
        raise PolspecError(f"{where}: {error}") from None
    if has_control_characters(str(key)):  # a line break would split the id's row in results list
        raise PolspecError(f"{where}: the id may not hold a line break or other control character, got {key!r}")
    prompt, messages = data.get("prompt"), data.get("messages")
    if (prompt is None) == (messages is None):
        raise PolspecError(f"{where}: give exactly one of 'prompt' or 'messages'")
    if prompt is not None and not isinstance(prompt, str):
        raise PolspecError(f"{where}: 'prompt' must be a string")
    try:
        if prompt is not None:
            check_prompt(prompt)
        else:
            check_messages(messages)
    except PolspecError as error:
        raise PolspecError(f"{where}: {error}") from None
    overrides = {name: data[name] for name in ITEM_PARAMS if name in data}
    unset = next((name for name, value in overrides.items() if value is None), None)
    if unset is not None:  # "seed": null from a half-filled table's export would drop the batch's --seed unseen
        raise PolspecError(f"{where}: '{unset}' is null; leave it out to take the batch's setting")
    item = ItemInput(str(key), prompt, messages, overrides, where)
    try:
        item.params(base)
    except (PolspecError, TypeError) as error:
        raise PolspecError(f"{where}: {error}") from None
    return item
