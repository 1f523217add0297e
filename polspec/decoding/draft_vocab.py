"""A pruned draft vocabulary: the draft proposes only its most frequent tokens on Polish text.

As in FR-Spec (ACL 2025) and transformers' ``assistant_prune_lm_head``, the draft's output
layer is cut to the ``size`` tokens it uses most on Polish text, plus every special and
single-byte token, so that each draft step multiplies by far fewer rows. Lossless by
construction: the target verifies every candidate, and a token the draft cannot propose only
costs acceptance where the target would have chosen it.

Token frequencies come from ``polspec/data/polish-words.tsv.gz``: the 50,000 most frequent
Polish words with their frequencies, from wordfreq 3.1.1 (Robyn Speer; data CC-BY-SA 4.0,
drawn from Wikipedia, OpenSubtitles, ParaCrawl, the Leeds Internet Corpus and others; see
``polspec/data/README.md``). Each word is tokenized after a space, lower-case and (at a
tenth of its weight) capitalized, as it appears inside and at the start of a sentence;
every token it yields counts the word's frequency. Tokens Polish text never yields rank after
those by id, which in BPE and SentencePiece vocabularies roughly follows training frequency.
The ranking is deterministic and cached beside the model.
"""

from __future__ import annotations

import gzip
import json
import string
from collections import defaultdict
from importlib import resources

from polspec.decoding.draft_head import DraftHead, can_split
from polspec.decoding.params import MAX_DRAFT_VOCAB, MIN_DRAFT_VOCAB
from polspec.decoding.translate import encode_after, token_bytes
from polspec.errors import PolspecError
from polspec.files import write_file_atomically
from polspec.models.loader import LoadedModel

RANKING_FORMAT = 2  # 2: a SentencePiece tokenizer's dummy prefix is not counted
RANKING_FILE = "polspec-polish-token-ranking.json"
RANKED = MAX_DRAFT_VOCAB  # ranks kept in the cached file: every size a pruned draft may have
CAPITALIZED_WEIGHT = 0.1
# Pruned when the vocabulary is at least twice this: below that the output layer is too small
# a share of a draft step to be worth cutting. 16,384 takes Gemma-3-270M's draft step to half
# and SmolLM2-135M's to 0.91x with acceptance as before (BENCHMARKS.md, issue 19).
DEFAULT_SIZE = 16_384
# Text every draft must be able to propose whatever the ranking: punctuation, digits, line breaks.
_SYMBOLS = [*string.punctuation, *string.digits, *(f" {n}" for n in range(100)), "\n", "\n\n", " ", "  ", "\t",
            ". ", ", ", ": ", "; ", " -", " –", " „", "”", "...", "…"]


def polish_texts() -> list[str]:
    """The dozen short Polish texts shipped for measuring and testing (``polish-texts.jsonl``)."""
    lines = resources.files("polspec.data").joinpath("polish-texts.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines if line.strip()]


def polish_words() -> list[tuple[str, float]]:
    """The shipped Polish words with their frequencies, most frequent first."""
    data = resources.files("polspec.data").joinpath("polish-words.tsv.gz").read_bytes()
    words = []
    for line in gzip.decompress(data).decode("utf-8").splitlines():
        word, centibels = line.split("\t")
        words.append((word, 10 ** (-int(centibels) / 100)))
    return words


def token_ranking(loaded: LoadedModel) -> list[int]:
    """The model's token ids, most frequent on Polish text first (the top ``RANKED``), cached."""
    cached = loaded.path / RANKING_FILE
    try:
        stored = json.loads(cached.read_text())
        if stored.get("format") == RANKING_FORMAT:
            return stored["ranking"]
    except (OSError, ValueError, AttributeError):  # none yet, or unreadable: rank again
        pass
    ranking = _rank(loaded.tokenizer._tokenizer)
    try:  # whole or not at all: a crash, or a worker ranking the same draft, leaves no half ranking
        write_file_atomically(cached, lambda out: json.dump({"format": RANKING_FORMAT, "ranking": ranking}, out))
    except PolspecError:  # a read-only model directory: rank again next time
        pass
    return ranking


def _rank(tokenizer) -> list[int]:
    weights = polish_token_weights(tokenizer)
    vocabulary = len(tokenizer)
    return sorted(range(vocabulary), key=lambda token: (-weights.get(token, 0.0), token))[:RANKED]


def polish_token_weights(tokenizer, words: int | None = None) -> dict[int, float]:
    """How much each token of ``tokenizer`` is used on Polish text: the summed frequency of the
    shipped words (the ``words`` most frequent, default all) whose tokens include it, plus the symbols."""
    weights: dict[int, float] = defaultdict(float)
    texts, text_weights = [], []
    for word, frequency in polish_words()[:words]:
        texts += [f" {word}", f" {word[:1].upper()}{word[1:]}"]
        text_weights += [frequency, frequency * CAPITALIZED_WEIGHT]
    top = max(text_weights)
    texts += _SYMBOLS
    text_weights += [top] * len(_SYMBOLS)
    table = token_bytes(tokenizer)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    for text, ids, weight in zip(texts, encoded, text_weights):
        # A SentencePiece dummy prefix (a lone "▁" before " word") is no token of the text:
        # counted, it was the most used token of Mistral's vocabulary.
        spelled = encode_after(table, b"", text.encode(), ids)
        for token in spelled[1] if spelled else ids:
            weights[token] += weight
    return weights


def draft_vocab_size(loaded: LoadedModel, setting: int | str) -> int | None:
    """How many tokens the draft proposes from under ``setting`` (``DecodingParams.draft_vocab``);
    None for its whole vocabulary.

    ``auto`` is the registry entry's ``draft_vocab`` if it has one, else ``DEFAULT_SIZE`` where
    the vocabulary is at least twice that and the architecture allows pruning, else the full
    vocabulary. A size at or above the vocabulary is the full vocabulary.
    """
    vocabulary = len(loaded.tokenizer._tokenizer)
    if setting == "auto":
        setting = loaded.entry.draft_vocab or (
            DEFAULT_SIZE if vocabulary >= 2 * DEFAULT_SIZE and can_split(loaded.model) else "full")
    return None if setting == "full" or setting >= vocabulary else setting


def draft_head(loaded: LoadedModel, setting: int | str) -> DraftHead:
    """The draft's :class:`DraftHead` under ``setting``, built once per size and kept with the model."""
    size = draft_vocab_size(loaded, setting)
    if size not in loaded.draft_heads:
        keep = pruned_vocabulary(loaded, size) if size is not None else None
        loaded.draft_heads[size] = DraftHead(loaded.model, keep, loaded.entry.alias)
    return loaded.draft_heads[size]


def pruned_vocabulary(loaded: LoadedModel, size: int) -> list[int]:
    """The ``size`` most frequent token ids on Polish text plus every single-byte, special (not
    a tokenizer's unused reserved ones) and end-of-sequence token, sorted; PolspecError when ``size`` is out of range."""
    vocabulary = len(loaded.tokenizer._tokenizer)
    if not MIN_DRAFT_VOCAB <= size <= RANKED:
        raise PolspecError(f"a pruned draft vocabulary holds {MIN_DRAFT_VOCAB} to {RANKED} tokens, got {size}")
    table = token_bytes(loaded.tokenizer._tokenizer)
    always = {token for token, raw in enumerate(table.raw) if raw is not None and len(raw) == 1}
    always |= set(loaded.tokenizer._tokenizer.all_special_ids) | set(loaded.tokenizer.eos_token_ids)
    return sorted(set(token_ranking(loaded)[:size]) | {t for t in always if t < vocabulary})
