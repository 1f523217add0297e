"""Model aliases: the built-in registry (``polspec/data/models.toml``) plus the user's file.

An alias names a model (weights and tokenizer) or, under ``tok:``, a tokenizer alone. The
user file ``$POLSPEC_HOME/models.toml`` has the same shape and adds aliases; its table for a
built-in alias changes the keys it gives and keeps the others.
"""

from __future__ import annotations

import codecs
import re
import difflib
import tomllib
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from polspec.decoding.params import MAX_DRAFT_VOCAB, MIN_DRAFT_VOCAB
from polspec.errors import PolspecError, not_utf8, past_parser_limits
from polspec.files import file_lock, write_file_atomically
from polspec.models.sources import WheelSource, is_sha256, parse_source
from polspec.settings import user_registry_file

TOKENIZER_PREFIX = "tok:"
# What `polspec models import --name` accepts: an alias that needs no quoting anywhere.
ALIAS_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"
NO_MODEL = "none"  # what --draft takes for target-only decoding: no alias, in any case
MODEL_KEYS = {"source", "sha256", "architecture", "tokenizer_family", "chat_template", "eos_tokens", "description",
              "draft_vocab"}
TOKENIZER_KEYS = {"source", "sha256", "format", "tokenizer_family", "description"}
TOKENIZER_FORMATS = ("sentencepiece", "tiktoken-llama3")
# The type each key's value must have (draft_vocab is checked on its own: a number or "full").
KEY_TYPES = {"source": str, "sha256": str, "architecture": str, "tokenizer_family": str, "description": str,
             "format": str, "chat_template": bool, "eos_tokens": list}


@dataclass(frozen=True)
class ModelEntry:
    """One registered model.

    ``source`` says where the weights come from (see :mod:`polspec.models.sources`);
    ``sha256`` pins the GGUF bytes for ``wheel:`` and ``gguf:`` sources; ``chat_template``
    says whether the model has one; ``eos_tokens`` are the token strings that end generation;
    ``draft_vocab`` overrides how many tokens the model proposes as a draft by default (a
    number, or ``"full"``; see :mod:`polspec.decoding.draft_vocab`).
    """

    alias: str
    source: str
    architecture: str
    tokenizer_family: str
    chat_template: bool = False
    eos_tokens: tuple[str, ...] = ()
    sha256: str | None = None
    description: str = ""
    draft_vocab: int | str | None = None


@dataclass(frozen=True)
class TokenizerEntry:
    """A tokenizer with no model, for translation work (alias ``tok:<name>``)."""

    alias: str
    source: str
    format: str
    tokenizer_family: str
    sha256: str | None = None
    description: str = ""


@dataclass
class Registry:
    models: dict[str, ModelEntry] = field(default_factory=dict)
    tokenizers: dict[str, TokenizerEntry] = field(default_factory=dict)

    def model(self, alias: str) -> ModelEntry:
        """The model entry for ``alias``; an unknown alias lists the close matches."""
        if alias in self.models:
            return self.models[alias]
        if alias in self.tokenizers:
            raise PolspecError(f"{alias} is a tokenizer alone, not a model that can run")
        raise PolspecError(_unknown("model", alias, list(self.models)))

    def tokenizer(self, alias: str) -> TokenizerEntry:
        if alias in self.tokenizers:
            return self.tokenizers[alias]
        raise PolspecError(_unknown("tokenizer", alias, list(self.tokenizers)))


def same_model(one: ModelEntry, other: ModelEntry) -> bool:
    """Whether two aliases name one model: one GGUF file's bytes under two aliases (an import of
    a registered model) are one model too."""
    return (one.sha256 or one.source) == (other.sha256 or other.source)


def _unknown(kind: str, alias: str, known: list[str]) -> str:
    by_lower = {name.lower(): name for name in known}
    close = [by_lower[name] for name in difflib.get_close_matches(alias.lower(), list(by_lower), n=3, cutoff=0.5)]
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(sorted(known))}"
    return f"unknown {kind} alias {alias!r}{hint} (polspec models list shows them all)"


def _check_keys(where: str, alias: str, table: object, allowed: set[str]) -> None:
    if not isinstance(table, dict):
        raise PolspecError(f"{where}: [{alias}] must be a table of keys, got {table!r}")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise PolspecError(f"{where}: [{alias}] has unknown key {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}")
    if "source" not in table:
        raise PolspecError(f"{where}: [{alias}] has no 'source'")
    for key, value in table.items():
        wanted = KEY_TYPES.get(key)
        if wanted is not None and not isinstance(value, wanted):
            what = {str: "text", bool: "true or false", list: "a list of texts"}[wanted]
            raise PolspecError(f"{where}: [{alias}] {key} must be {what}, got {value!r}")
    if "sha256" in table and not is_sha256(table["sha256"].lower()):
        raise PolspecError(f"{where}: [{alias}] sha256 must be 64 hexadecimal digits, got {table['sha256']!r}")
    if not all(isinstance(token, str) for token in table.get("eos_tokens", [])):
        raise PolspecError(f"{where}: [{alias}] eos_tokens must be a list of texts, got {table['eos_tokens']!r}")
    try:
        parse_source(table["source"])  # a bad source is told here, with its file, not at fetch time
    except PolspecError as error:
        raise PolspecError(f"{where}: [{alias}] {error}") from None


def parse_registry(text: str, where: str, base: Registry | None = None) -> Registry:
    """Parse one registry file; ``where`` names it in error messages. A table for an alias of
    ``base`` (the built-in registry, under the user's file) is read over that entry
    (:func:`_over`)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise PolspecError(f"{where}: {error}") from None
    except (ValueError, RecursionError) as error:
        raise past_parser_limits(where, error) from None
    unknown = sorted(set(data) - {"models", "tokenizers"})
    if unknown:
        raise PolspecError(f"{where}: unknown table [{unknown[0]}]; expected [models.NAME] or [tokenizers.NAME]")
    for kind in ("models", "tokenizers"):
        if not isinstance(data.get(kind, {}), dict):
            raise PolspecError(f"{where}: '{kind}' must be tables such as [{kind}.NAME], got {data[kind]!r}")
    registry = Registry()
    for alias, table in data.get("models", {}).items():
        if not re.fullmatch(ALIAS_PATTERN, alias):  # an alias names files: a '/' or '..' leads out of their folder
            raise PolspecError(f"{where}: [models.{alias}] is no alias: letters, digits, '.', '_' and '-', starting "
                               "with a letter or digit")
        if alias.lower() == NO_MODEL:
            raise PolspecError(f"{where}: [models.{alias}] cannot be an alias: {NO_MODEL} means no model (--draft none)")
        table = _over(base and base.models.get(alias), table)
        _check_keys(where, f"models.{alias}", table, MODEL_KEYS)
        table = dict(table, eos_tokens=tuple(table.get("eos_tokens", ())))
        if "sha256" in table:  # the cache names an import by its lowercase hash
            table["sha256"] = table["sha256"].lower()
        table.setdefault("architecture", "")
        table.setdefault("tokenizer_family", alias)
        vocab = table.get("draft_vocab")
        if vocab is not None and vocab != "full" and not (
                isinstance(vocab, int) and not isinstance(vocab, bool) and MIN_DRAFT_VOCAB <= vocab <= MAX_DRAFT_VOCAB):
            raise PolspecError(f"{where}: [models.{alias}] draft_vocab must be {MIN_DRAFT_VOCAB} to {MAX_DRAFT_VOCAB} "
                               f"tokens or \"full\", got {vocab!r}")
        registry.models[alias] = ModelEntry(alias=alias, **table)
    for name, table in data.get("tokenizers", {}).items():
        table = _over(base and base.tokenizers.get(TOKENIZER_PREFIX + name), table)
        _check_keys(where, f"tokenizers.{name}", table, TOKENIZER_KEYS)
        if table.get("format") not in TOKENIZER_FORMATS:
            raise PolspecError(f"{where}: [tokenizers.{name}] format must be one of {', '.join(TOKENIZER_FORMATS)}")
        if not isinstance(parse_source(table["source"]), WheelSource):  # a tokenizer file comes only in a wheel
            raise PolspecError(f"{where}: [tokenizers.{name}] source must be a wheel: source, got {table['source']!r}")
        table.setdefault("tokenizer_family", name)
        alias = TOKENIZER_PREFIX + name
        registry.tokenizers[alias] = TokenizerEntry(alias=alias, **table)
    return registry


def load_registry(user_file: Path | None = None) -> Registry:
    """The built-in registry with the user's file merged over it."""
    registry = _built_in_registry()
    user_file = user_file or user_registry_file()
    if user_file.exists():
        user = parse_registry(read_registry_text(user_file), str(user_file), base=registry)
        registry.models.update(user.models)
        registry.tokenizers.update(user.tokenizers)
    return registry


def _built_in_registry() -> Registry:
    text = resources.files("polspec.data").joinpath("models.toml").read_text(encoding="utf-8")
    return parse_registry(text, "polspec/data/models.toml")


def _over(entry: ModelEntry | TokenizerEntry | None, table: object) -> object:
    """A user's ``table`` for a built-in ``entry``: the built-in's keys with the table's over
    them, so that changing one key (a local ``source``, a ``draft_vocab``) keeps the chat
    template and end tokens. Another source drops the built-in ``sha256`` and ``description``,
    which pinned and told of the built-in's bytes."""
    if entry is None or not isinstance(table, dict):
        return table
    kept = {key: list(value) if isinstance(value, tuple) else value
            for key, value in asdict(entry).items() if key != "alias" and value is not None}
    if table.get("source", entry.source) != entry.source:
        kept.pop("sha256", None)
        kept.pop("description", None)
    return kept | table


def read_registry_text(path: Path) -> str:
    """The text of the user's registry file, or a one-line error saying why it cannot be read."""
    try:
        # An editor's byte order mark is no error.
        return path.read_bytes().removeprefix(codecs.BOM_UTF8).decode("utf-8")
    except UnicodeDecodeError as error:
        raise not_utf8(str(path), error) from None
    except OSError as error:
        raise PolspecError(f"{path}: {error.strerror}") from None


def add_user_model(entry: ModelEntry, user_file: Path | None = None) -> None:
    """Append ``entry`` to the user's registry file (used by ``polspec models import``); two
    imports at once each add theirs (the file is read and written under a lock)."""
    user_file = user_file or user_registry_file()
    with file_lock(user_file.with_name(user_file.name + ".lock"), "registry lock"):
        _append_model(entry, user_file)


def _append_model(entry: ModelEntry, user_file: Path) -> None:
    existing = read_registry_text(user_file) if user_file.exists() else ""
    built_in = _built_in_registry()  # the file's tables for built-in aliases may give only what they change
    if entry.alias in parse_registry(existing, str(user_file), base=built_in).models:
        raise PolspecError(f"{user_file}: alias {entry.alias!r} already exists; choose another --name")
    lines = [
        f"\n[models.{_toml_string(entry.alias)}]",
        f"source = {_toml_string(entry.source)}",
        f"architecture = {_toml_string(entry.architecture)}",
        f"tokenizer_family = {_toml_string(entry.tokenizer_family)}",
        f"chat_template = {'true' if entry.chat_template else 'false'}",
        f"eos_tokens = [{', '.join(_toml_string(token) for token in entry.eos_tokens)}]",
    ]
    if entry.sha256:
        lines.append(f"sha256 = {_toml_string(entry.sha256)}")
    text = existing + "\n".join(lines) + "\n"
    try:
        parse_registry(text, str(user_file), base=built_in)
    except PolspecError:  # TOML forbids a [models.NAME] table after an inline `models = { ... }`
        raise PolspecError(f"{user_file}: cannot add a [models.{entry.alias}] table to it: it writes its models "
                           "inline (models = { ... }); write each as a [models.NAME] table and import again (the "
                           "import itself is cached)") from None
    write_file_atomically(user_file, lambda out: out.write(text))  # a crash cannot cut the user's file short


def _toml_string(value: str) -> str:
    """``value`` as a TOML basic string: backslashes, quotes and control characters escaped."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(f"\\u{ord(char):04x}" if char < " " or char == "\x7f" else char for char in escaped) + '"'
