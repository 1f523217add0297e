"""Translating token sequences between two tokenizers, byte-exactly.

Every token of a fast tokenizer stands for a fixed string of bytes (its *raw bytes*: a
byte-level BPE piece mapped back to bytes, or a SentencePiece piece with ``▁`` as a space
and ``<0xNN>`` as a byte). Working on raw bytes instead of ``decode`` keeps what decoding
loses: the bytes of a Polish letter split across two tokens, and the leading space that a
SentencePiece decoder strips.

Strategies for turning a draft's proposal into target candidates (``STRATEGIES``):

- ``none``: draft ids used as target ids (the study's no-translation baseline);
- ``naive``: decode the chunk, encode it;
- ``context``: the study's rule: decode the last ``p`` committed target tokens plus the chunk,
  encode, strip ``p`` tokens by count, unchecked;
- ``aligned`` (default): raw bytes of the chunk, cut to whole UTF-8 characters, encoded after
  a window of committed target text and aligned by bytes rather than by count. When the chunk
  stops inside a word or after whitespace, the tokens that the continuation could re-merge
  are *tentative*: the decoder verifies them (``partial_word="verify"``) or leaves them for
  the next round (``"hold"``).
  A round whose window re-encodes to different ids is a boundary miss.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from polspec.decoding.params import PARTIAL_WORD, STRATEGIES
from polspec.errors import PolspecError

if TYPE_CHECKING:
    from polspec.models.loader import LoadedModel
    from polspec.models.registry import ModelEntry

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_WORD_START = re.compile(rb"[ \t\n\r]")
# Draft tokens of committed text re-tokenized together with new text in each re-sync.
RESYNC_WINDOW = 8
_PUNCTUATION_END = re.compile(rb"[!-/:-@\[-`{-~]$")


@dataclass(frozen=True)
class TokenBytes:
    """The raw bytes of every token of one tokenizer (None for special tokens).

    A model may have more output rows than its tokenizer has tokens (Qwen2.5's 151,936 against
    151,665: padding). Sampled, such an id is read as a special token, with no text, as the
    tokenizer's own decode reads it, not as an error in the middle of a generation."""

    tokenizer: PreTrainedTokenizerFast
    raw: tuple[bytes | None, ...]

    def piece(self, token: int) -> bytes | None:
        """The raw bytes of ``token``; None for a special token or one past the tokenizer's."""
        return self.raw[token] if token < len(self.raw) else None

    def text(self, ids: list[int]) -> bytes:
        """Concatenated raw bytes of ``ids``; special tokens contribute nothing."""
        return b"".join(self.piece(i) or b"" for i in ids)

    def is_special(self, token: int) -> bool:
        return self.piece(token) is None

    def encode(self, text: bytes) -> list[int]:
        """Token ids of ``text`` (whole UTF-8 characters), with no special tokens added."""
        return self.tokenizer.encode(text.decode("utf-8"), add_special_tokens=False)


@lru_cache(maxsize=16)
def token_bytes(tokenizer: PreTrainedTokenizerFast) -> TokenBytes:
    """Build the raw-bytes table of a fast tokenizer (cached per tokenizer object)."""
    size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    special = {index for index, token in tokenizer.added_tokens_decoder.items() if token.special}
    byte_level = type(tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel"
    decoder = {char: byte for byte, char in bytes_to_unicode().items()}
    raw: list[bytes | None] = []
    for index, piece in enumerate(pieces):
        if piece is None or index in special:
            raw.append(None)
        elif byte_level:
            raw.append(bytes(decoder[c] for c in piece) if all(c in decoder for c in piece) else piece.encode())
        elif match := _BYTE_PIECE.match(piece):
            raw.append(bytes([int(match.group(1), 16)]))
        else:
            raw.append(piece.replace("\u2581", " ").encode())
    return TokenBytes(tokenizer, tuple(raw))


def complete_utf8(data: bytes) -> bytes:
    """``data`` without a trailing incomplete UTF-8 character."""
    for cut in range(1, min(4, len(data)) + 1):
        lead = data[-cut]
        if lead < 0x80:  # ASCII: everything up to here is complete
            return data
        if lead >= 0xC0:  # the lead byte of the last character
            needed = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
            return data if cut >= needed else data[:-cut]
    return data


def _cumulative(table: TokenBytes, ids: list[int]) -> list[int]:
    ends, total = [0], 0
    for token in ids:
        total += len(table.piece(token) or b"")
        ends.append(total)
    return ends


def encode_after(table: TokenBytes, context: bytes, text: bytes,
                 ids: list[int] | None = None) -> tuple[list[int], list[int]] | None:
    """Tokenize ``text`` as the tokenizer would right after ``context``.

    Returns ``(context_ids, text_ids)`` with raw bytes equal to ``context`` and ``text``
    exactly, or None when some token spans the boundary between the two (or the tokenizer
    cannot represent the text byte for byte). A SentencePiece dummy prefix added in front
    of the context is not part of ``context_ids``; one fused into the first token of the
    text (no context) makes it unrepresentable, hence None. ``ids``: the tokenizer's encoding
    of ``context + text`` where the caller has it (encoded in one batch with others).
    """
    full = context + text
    if ids is None:
        try:
            ids = table.encode(full)
        except UnicodeDecodeError:  # a context window that starts inside a character
            return None
    ends = _cumulative(table, ids)
    offset = ends[-1] - len(full)
    if offset < 0 or table.text(ids)[offset:] != full:
        return None
    if offset not in ends:  # the dummy prefix space is fused into the first token
        return None
    start = ends.index(offset)
    boundary = offset + len(context)
    if boundary not in ends:
        return None
    split = ends.index(boundary)
    return ids[start:split], ids[split:]


def extend_tokens(table: TokenBytes, ids: list[int], new: bytes, window: int) -> tuple[int, list[int]]:
    """Re-tokenize the end of ``ids`` with ``new`` bytes appended.

    Returns ``(keep, tail)``: the new sequence is ``ids[:keep] + tail``, whose raw bytes are
    those of ``ids`` followed by ``new``. The last ``window`` tokens (extended back to a
    word start) are re-encoded with the new text, so a token that now merges differently
    is replaced rather than kept.
    """
    start = window_start(table, ids, window)
    encoded = encode_after(table, table.text(ids[start:]), new)
    if encoded is not None:
        context_ids, tail = encoded
        same = common_prefix(context_ids, ids[start:])
        return start + same, context_ids[same:] + tail
    # A token of the window would merge into the new text: keep the window, and tokenize
    # the new text after a neutral newline.
    encoded = encode_after(table, b"\n", new)
    if encoded is not None:
        return len(ids), encoded[1]
    # Bytes that are not valid UTF-8 (a sampled target can commit a stray byte): the draft
    # only needs an approximation of such text.
    return len(ids), table.tokenizer.encode(new.decode("utf-8", "replace"), add_special_tokens=False)


def follow_text(table: TokenBytes, ids: list[int], lag: bytes, new: bytes) -> tuple[list[int], bytes]:
    """Extend the token sequence ``ids`` by committed bytes ``new``, one tokenizer following another.

    ``lag`` holds committed bytes not yet tokenized (an incomplete character); returns the
    new sequence and the new lag.
    """
    pending = lag + new
    whole = complete_utf8(pending)
    if whole:
        keep, tail = extend_tokens(table, ids, whole, RESYNC_WINDOW)
        ids = ids[:keep] + tail
    return ids, pending[len(whole):]


def same_tokenizer(target: LoadedModel, draft: LoadedModel) -> bool:
    """Whether the draft's ids are the target's: the registry puts both models in one tokenizer
    family (checked with :func:`check_one_family`)."""
    if target.entry.tokenizer_family != draft.entry.tokenizer_family:
        return False
    check_one_family(target.entry, target.tokenizer._tokenizer, draft.entry, draft.tokenizer._tokenizer)
    return True


def check_one_family(target: ModelEntry, target_tokenizer: PreTrainedTokenizerFast, draft: ModelEntry,
                     draft_tokenizer: PreTrainedTokenizerFast) -> None:
    """A PolspecError where two models the registry puts in one tokenizer family name most ids
    differently (a wrong ``polspec models import --tokenizer-family``): read as the target's, the
    draft's ids would propose other tokens than it chose, and speculation would be work for
    nothing. (A model's chat variant may rename a few control tokens: those pass.)"""
    differ, size, example = _renamed_ids(target_tokenizer, draft_tokenizer)
    if differ > size * RENAMED_IDS_ALLOWED:
        token_id, theirs, ours = example
        raise PolspecError(
            f"{draft.alias} and {target.alias} are registered as one tokenizer family ({target.tokenizer_family}), "
            f"but {differ:,} of the {size:,} ids they share name different tokens (id {token_id} is {ours!r} to "
            f"{draft.alias} and {theirs!r} to {target.alias}): give one of them its own family "
            "(polspec models import --tokenizer-family, or tokenizer_family in models.toml)")


# The share of ids a tokenizer family's models may name differently: a few control tokens.
RENAMED_IDS_ALLOWED = 0.01


@lru_cache(maxsize=8)
def _renamed_ids(target: PreTrainedTokenizerFast, draft: PreTrainedTokenizerFast) -> tuple[int, int, tuple | None]:
    """How many ids of both base vocabularies name two different tokens, of how many, and the first."""
    size = min(target.vocab_size, draft.vocab_size)
    pairs = zip(target.convert_ids_to_tokens(range(size)), draft.convert_ids_to_tokens(range(size)))
    renamed = [(token_id, theirs, ours) for token_id, (theirs, ours) in enumerate(pairs) if theirs != ours]
    return len(renamed), size, renamed[0] if renamed else None


def window_start(table: TokenBytes, ids: list[int], window: int) -> int:
    """Start of a window of about ``window`` tokens, moved back to a token that starts a word."""
    start = max(0, len(ids) - window)
    for index in range(start, max(-1, start - 16), -1):
        raw = table.piece(ids[index]) if index < len(ids) else None
        if raw and _WORD_START.match(raw[:1]):
            return index
    return start


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Translation:
    """Target candidates for one round and how they were obtained."""

    candidates: list[int]
    boundary_miss: bool = False  # the window's text agreed but re-encoded to other ids
    held_back: int = 0  # proposal bytes not among the candidates (an incomplete character, a trailing space, a held word, the cap)


def translate_draft_to_target(
    strategy: str,
    draft: TokenBytes,
    target: TokenBytes,
    proposal: list[int],
    committed: list[int],
    prefix: int = 5,
    cap: int | None = None,
    lag: bytes = b"",
    partial_word: str = "verify",
) -> Translation:
    """Target token ids standing for the draft's ``proposal``, to be verified by the target.

    ``committed`` are the target ids already committed (generated text, possibly preceded
    by prompt ids); ``prefix`` is the context size in target tokens for ``context`` and
    ``aligned``; ``cap`` bounds the number of candidates; ``lag`` are committed bytes the
    draft has not seen yet (part of a character), which its proposal starts by repeating;
    ``partial_word`` says whether ``aligned`` keeps its tentative candidates (``verify``) or
    drops them (``hold``). A draft special token (its EOS) ends the proposal: ``aligned``
    maps it to the target's EOS when nothing was held back.
    """
    text_ids = proposal
    special = next((i for i, token in enumerate(proposal) if draft.is_special(token)), None)
    if special is not None:
        text_ids = proposal[:special]
    if strategy == "none":
        candidates = [t for t in proposal if t < len(target.raw)]
        return Translation(candidates[:cap])
    if strategy == "naive":
        text = draft.tokenizer.decode(text_ids)
        return Translation(target.tokenizer.encode(text, add_special_tokens=False)[:cap])
    if strategy == "context":
        window = committed[-prefix:] if prefix else []
        text = target.tokenizer.decode(window) + draft.tokenizer.decode(text_ids)
        return Translation(target.tokenizer.encode(text, add_special_tokens=False)[len(window):][:cap])
    if strategy != "aligned":
        raise ValueError(f"unknown translation strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if partial_word not in PARTIAL_WORD:
        raise ValueError(f"unknown partial_word {partial_word!r}; choose one of {', '.join(PARTIAL_WORD)}")
    return _aligned(draft, target, text_ids, special is not None, committed, prefix, cap, lag, partial_word == "hold")


# Letters a word could go on with, to probe whether its last token would re-merge.
_PROBES = tuple(s.encode() for s in ("a", "e", "i", "o", "y", "ą", "ę", "ó", "ch", "cz", "sz", "rz", "n", "m", "k", "ł", "ś", "ż", "w",
                                    "c", "ć", "j", "r", "s", "t", "z"))


def _stable_length(target: TokenBytes, context: bytes, text: bytes, candidates: list[int]) -> int:
    """How many leading candidates keep their form however the trailing partial word goes on.

    The proposal stops inside a word, so the target may tokenize the completed word
    differently; each probe letter appended shows which leading candidates survive.
    """
    stable = len(candidates)
    for probe in _PROBES:
        encoded = encode_after(target, context, text + probe)
        ids = encoded[1] if encoded is not None else []
        same = 0
        while same < min(stable, len(ids)) and ids[same] == candidates[same]:
            same += 1
        stable = same
    return stable


def _aligned(draft, target, text_ids, ended, committed, prefix, cap, lag, hold) -> Translation:
    proposal = draft.text(text_ids)
    if not proposal.startswith(lag):
        return Translation([], held_back=len(proposal))
    proposal = proposal[len(lag):]
    eos = target.tokenizer.eos_token_id
    if ended and not proposal:  # the draft's first token was its EOS: propose the target's
        return Translation([eos] if eos is not None else [])
    complete = complete_utf8(proposal)
    finished = ended and complete == proposal
    # Trailing whitespace may merge into the next word's token (a space, in both families) or
    # stand alone (a newline, a space before digits): ``verify`` proposes it as tentative,
    # which never costs a committed token; ``hold`` leaves it for the next round.
    whole = complete if finished or not hold else complete.rstrip()
    if not whole:
        return Translation([], held_back=len(proposal))
    window = [t for t in committed[window_start(target, committed, prefix):] if not target.is_special(t)]
    # A newline is a neutral context when the window's last token would merge into the text.
    context = target.text(window)
    encoded = encode_after(target, context, whole)
    if encoded is None:
        context = b"\n"
        encoded = encode_after(target, context, whole)
    if encoded is None:
        return Translation([], boundary_miss=True, held_back=len(proposal))
    window_ids, candidates = encoded
    # The last word may still go on unless the draft finished, stopped after whitespace
    # (stripped above) or after punctuation; only ``hold`` pays for finding its unstable tokens.
    if hold and not finished and whole == complete and not _PUNCTUATION_END.search(whole):
        candidates = candidates[:_stable_length(target, context, whole, candidates)]
    held_back = len(proposal) - len(target.text(candidates[:cap]))
    if finished and held_back == 0 and eos is not None:
        candidates = candidates + [eos]
    candidates = candidates[:cap]
    return Translation(candidates, boundary_miss=bool(window) and window_ids != window, held_back=held_back)
