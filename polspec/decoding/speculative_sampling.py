"""Speculative sampling across tokenizers: token-level intersection (TLI).

Exact-match verification keeps a candidate only where the sampled target happens to draw
the same token, so acceptance falls with temperature. Speculative sampling (Leviathan et al.
2023; Chen et al. 2023) uses the draft's probabilities instead: the draft samples ``x`` from
its distribution ``q``, the target accepts it with probability ``min(1, p(x) / q(x))`` and at
the first rejection draws from the residual ``max(0, p - q)`` (normalized). Every committed
token then follows the target's distribution ``p`` exactly, and a candidate is accepted with
probability ``sum_x min(p(x), q(x))``.

Across vocabularies ``q`` must be a distribution over target tokens. TLI (Timor et al., ICML
2025, arXiv 2502.05202; transformers' ``UniversalSpeculativeDecodingGenerator``) restricts the
draft to the tokens whose bytes are one target token too (their *twins*: a SentencePiece
``▁kot`` and a byte-level ``Ġkot`` are both `` kot``; the draft's end of sequence stands for
the target's), renormalizes, and maps each proposed draft token to its twin. polspec keeps
the mass TLI drops: a draft token whose text is several target tokens (Gemma-3's
`` przepływa``, Qwen2.5's `` prz`` ``ep`` ``ły`` ``wa``) proposes all of them, as greedy
translation does. The first is drawn from ``q`` of a target token = the draft's probability of
every token that starts with it; each later one from the draft's distribution conditioned on
its token continuing past the pieces before (the draft tokens that start with them and go
on, by the piece they put next). Speculative sampling stays exact with any ``q`` a candidate
was really drawn from, given the committed text and the draft's own draws. No re-tokenization:
candidates are the mapped tokens themselves, which the target may score although it would
have split the text otherwise.

``p`` and ``q`` are both the sampler's distribution (:func:`~polspec.decoding.sampling.sampling_probabilities`:
top-p, top-k, temperature), ``q`` over the shared vocabulary of the draft's output layer
(pruned or full). Random draws are keyed by the sequence's seed and position
(:func:`~polspec.decoding.sampling.position_key`), so a sequence with a fixed ``k`` samples
the same tokens alone or in any batch (under ``k = auto`` its rounds end where the acceptance
seen so far says, and a position drawn as a candidate in one run may be the bonus in another).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx
import numpy as np

from polspec.decoding.draft_head import DraftHead, vocabulary_size
from polspec.decoding.draft_vocab import draft_head, polish_token_weights
from polspec.decoding.params import DecodingParams
from polspec.decoding.sampling import draw_in_proportion, fine_uniform, position_key, sampling_probabilities
from polspec.decoding.translate import TokenBytes, encode_after, same_tokenizer, token_bytes
from polspec.models.loader import LoadedModel

# What a random draw is for, in position_key.
_DRAFT, _ACCEPT = 1, 2


# Most target tokens one draft token proposes; a longer split proposes its first MAX_PIECES and
# ends the proposal there. Of Gemma-3's tokens of the shipped Polish words, none is more than 5
# of Qwen2.5's tokens, and 18 of 4,964 are 7 or 8 of SmolLM2's.
MAX_PIECES = 6


@dataclass(frozen=True)
class SharedVocabulary:
    """The target tokens each draft token proposes: ``pieces[d]`` (-1 padded) is draft token
    ``d``'s twin (the target token with the same bytes), else the target's tokens of its text
    where they spell it exactly (up to :data:`MAX_PIECES`), else the first of them where it is
    a proper prefix of it; a row of -1: the draft never proposes it (a special token, part of
    a character). ``whole[d]``: the pieces spell all of ``d``'s text, so a proposal may go on
    after it. Where several target tokens have the same bytes (a SentencePiece byte piece
    ``<0x41>`` beside ``A``), the twin is the one the target's tokenizer produces for them.
    Several draft tokens map to one first piece (`` prz`` and `` przepływa``): its ``q`` is the
    sum of theirs."""

    pieces: np.ndarray  # int64 [draft vocabulary, MAX_PIECES]
    target_vocabulary: int
    whole: np.ndarray  # bool [draft vocabulary]

    @property
    def to_target(self) -> np.ndarray:
        """The first target token each draft token proposes (-1: none)."""
        return self.pieces[:, 0]

    @property
    def twin(self) -> np.ndarray:
        """The draft tokens whose text is exactly one target token."""
        return self.whole & (self.pieces[:, 0] >= 0) & (self.pieces[:, 1] < 0)

    @property
    def size(self) -> int:
        """Draft tokens that propose a target token."""
        return int((self.to_target >= 0).sum())


def shared_vocabulary(target: LoadedModel, draft: LoadedModel) -> SharedVocabulary:
    """The pair's :class:`SharedVocabulary` (the identity where both use one tokenizer family)."""
    target_tokenizer, draft_tokenizer = target.tokenizer._tokenizer, draft.tokenizer._tokenizer
    if same_tokenizer(target, draft):
        size = len(draft_tokenizer)
        pieces = np.full((size, MAX_PIECES), -1)
        pieces[:, 0] = np.arange(size)
        pieces[pieces[:, 0] >= len(target_tokenizer), 0] = -1
        return SharedVocabulary(pieces, len(target_tokenizer), pieces[:, 0] >= 0)
    return _byte_twins(draft_tokenizer, target_tokenizer, tuple(draft.tokenizer.eos_token_ids),
                       target.tokenizer.eos_token_id)


@lru_cache(maxsize=8)
def _byte_twins(draft_tokenizer, target_tokenizer, draft_eos: tuple[int, ...], target_eos: int | None) -> SharedVocabulary:
    draft_table, target_table = token_bytes(draft_tokenizer), token_bytes(target_tokenizer)
    target_ids = _canonical_ids(target_table)
    pieces = np.full((len(draft_table.raw), MAX_PIECES), -1)
    pieces[:, 0] = [target_ids.get(raw, -1) if raw else -1 for raw in draft_table.raw]
    whole = pieces[:, 0] >= 0
    split = np.flatnonzero(~whole)
    pieces[split], whole[split] = _target_pieces(draft_table, target_table, split)
    if target_eos is not None:
        ends = [eos for eos in draft_eos if eos < len(pieces)]
        pieces[ends], whole[ends] = -1, True
        pieces[ends, 0] = target_eos
    return SharedVocabulary(pieces, len(target_table.raw), whole)


def _target_pieces(draft: TokenBytes, target: TokenBytes, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For draft tokens without a twin, the target's tokens of their text and whether they spell
    all of it (`` przepływa`` in Qwen2.5's tokens is `` prz``, ``ep``, ``ły``, ``wa``); where
    they do not, only a first token that is a proper prefix of it; else none. A SentencePiece
    target's dummy prefix is left out: Mistral's tokens of `` przepływa`` are ``▁``, ``▁prz``,
    ``ep``, ``ły``, ``wa``, and the text itself starts at ``▁prz``."""
    texts, which = [], []
    for token in tokens.tolist():
        raw = draft.raw[token]
        try:
            texts.append(raw.decode("utf-8"))
        except (AttributeError, UnicodeDecodeError):  # special, or part of a character
            continue
        which.append(token)
    pieces = np.full((len(tokens), MAX_PIECES), -1)
    whole = np.zeros(len(tokens), bool)
    position = {token: index for index, token in enumerate(tokens.tolist())}
    encoded = target.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    for token, text, ids in zip(which, texts, encoded):
        row = position[token]
        spelled = encode_after(target, b"", text.encode(), ids) if ids else None
        if spelled and spelled[1]:
            ids = spelled[1]
            pieces[row, : min(len(ids), MAX_PIECES)] = ids[:MAX_PIECES]
            whole[row] = len(ids) <= MAX_PIECES
        elif ids and target.raw[ids[0]] and text.encode().startswith(target.raw[ids[0]]):
            pieces[row, 0] = ids[0]
    return pieces, whole


def _canonical_ids(table: TokenBytes) -> dict[bytes, int]:
    """Each byte string that is one token of ``table``, with the id its tokenizer gives it."""
    ids: dict[bytes, int] = {}
    clashes = set()
    for token, raw in enumerate(table.raw):
        if not raw:
            continue
        if raw in ids:
            clashes.add(raw)
        else:
            ids[raw] = token
    for raw in clashes:
        try:
            encoded = table.encode(raw)
        except UnicodeDecodeError:  # a lone byte: the first id (the byte piece) stands for it
            continue
        if len(encoded) == 1 and table.raw[encoded[0]] == raw:
            ids[raw] = encoded[0]
    return ids


class SharedDraft:
    """A draft output layer (:class:`DraftHead`) proposing under TLI: it samples from its
    distribution restricted to the tokens that propose a target token (see
    :class:`SharedVocabulary`) and maps what it samples to target candidates, each with the
    distribution it was drawn from."""

    def __init__(self, head: DraftHead, shared: SharedVocabulary, draft: LoadedModel):
        width = head.size if head.size is not None else vocabulary_size(draft.model)
        pieces = np.full((max(width, len(shared.pieces)), MAX_PIECES), -1)
        pieces[: len(shared.pieces)] = shared.pieces
        self.whole = np.zeros(len(pieces), bool)
        self.whole[: len(shared.whole)] = shared.whole
        by_index = pieces[np.array(head.keep)] if head.keep is not None else pieces[:width]
        self.head = head
        self.pieces = pieces  # by draft token id
        self.shared = mx.array(by_index[:, 0] >= 0)  # by logit index
        self.pieces_by_index = mx.array(by_index)
        # Where each logit index's probability lands in the target's vocabulary (added up where
        # indices share a first piece); an index with none adds its probability (zero: it is
        # masked) to token 0.
        self.scatter = mx.array(np.maximum(by_index[:, 0], 0))
        self.share = float((by_index[:, 0] >= 0).mean())

    @property
    def to_target(self) -> np.ndarray:
        """The first target token each draft token id proposes (-1: none)."""
        return self.pieces[:, 0]

    def sample(self, logits: mx.array, params: DecodingParams, seed: int, position: int, step: int
               ) -> tuple[mx.array, mx.array]:
        """The logit index of a draft token sampled from ``logits`` (one row) restricted to the
        tokens that propose a target token, and that distribution over the logit indices; both lazy."""
        probabilities = sampling_probabilities(mx.where(self.shared, logits, -mx.inf), params)
        return draw_in_proportion(probabilities, position_key(seed, position, _DRAFT, step)), probabilities

    def pieces_of(self, token: int) -> list[int]:
        """The target tokens draft token id ``token`` proposes, in order."""
        return [int(piece) for piece in self.pieces[token] if piece >= 0]

    def candidates(self, proposal: list[int], cap: int) -> list[int]:
        """The target tokens that proposed draft token ids stand for, at most ``cap``, up to and
        including those of the first draft token whose text they do not spell whole (the
        draft's later tokens follow text the candidates lack)."""
        found: list[int] = []
        for token in proposal:
            found += self.pieces_of(token)
            if not self.whole[token]:
                break
        return found[:cap]

    def distributions(self, proposal: list[int], probabilities: list[mx.array], count: int, width: int) -> mx.array:
        """The distributions over the target's ``width`` ids that the first ``count``
        :meth:`candidates` of ``proposal`` were drawn from, lazily [count, width].
        ``probabilities[s]`` is what the draft drew its ``s``-th token from, over logit indices.

        A draft token's first piece was drawn from its step's distribution mapped to first
        pieces (:meth:`in_target_space`); a later piece from that distribution restricted to
        the draft tokens that start with the pieces before it and go on, by the piece they put
        next: given what the draft drew, exactly the chance of that candidate."""
        rows = []
        for step, token in enumerate(proposal):
            pieces = self.pieces_of(token)
            for index in range(len(pieces)):
                if len(rows) == count:
                    return mx.stack(rows)
                if index == 0:
                    rows.append(self.in_target_space([probabilities[step]], width)[0])
                    continue
                follows = (self.pieces_by_index[:, :index] == mx.array(pieces[:index])).all(axis=1) \
                    & (self.pieces_by_index[:, index] >= 0)
                weights = mx.where(follows, probabilities[step], 0.0)
                row = mx.zeros((width,)).at[mx.maximum(self.pieces_by_index[:, index], 0)].add(weights)
                rows.append(row / weights.sum())
        return mx.stack(rows)

    def in_target_space(self, probabilities: list[mx.array], width: int) -> mx.array:
        """Draft distributions over logit indices as distributions over the target's ``width``
        ids of first pieces: each gets the probability of every draft token that starts with it."""
        rows = mx.stack(probabilities)
        return mx.zeros((rows.shape[0], width)).at[:, self.scatter].add(rows)


def shared_draft(head: DraftHead, target: LoadedModel, draft: LoadedModel) -> SharedDraft:
    """The :class:`SharedDraft` of ``head`` (an output layer of ``draft``) for ``target``, built
    once per head and target (a few ms over a 262k vocabulary) and kept with the head."""
    cached = head.shared_drafts.get(target.entry.alias)
    if cached is None:
        cached = head.shared_drafts[target.entry.alias] = SharedDraft(head, shared_vocabulary(target, draft), draft)
    return cached


def polish_coverage(target: LoadedModel, draft: LoadedModel, draft_vocab: int | str = "auto",
                    words: int = 5_000) -> float:
    """The share of the target's tokens on Polish text (its tokens of the ``words`` most frequent
    shipped words, by frequency) that the draft can propose first under TLI: those some token of
    the draft's output layer under ``draft_vocab`` starts with (its twin, or the first target
    token of its text). A draft step can open with no other token, so a low share caps the
    pair's acceptance (the later pieces of split words only add to it)."""
    head = draft_head(draft, draft_vocab)
    sampler = shared_draft(head, target, draft)
    proposable = set(sampler.to_target[np.array(head.keep) if head.keep is not None else slice(None)].tolist())
    weights = polish_token_weights(target.tokenizer._tokenizer, words)
    return sum(w for token, w in weights.items() if token in proposable) / sum(weights.values())


def accept_in_proportion(p: mx.array, q: mx.array, key: mx.array) -> mx.array:
    """True with probability ``min(1, p / q)``, elementwise: a :func:`~polspec.decoding.sampling.fine_uniform`
    number times ``q`` below ``p``, in float64. MLX's float32 uniform numbers resolve a chance only
    to about 1e-7 (none of 2**25 fell below 1.0e-7), so a ``p / q`` below that was never accepted."""
    with mx.stream(mx.cpu):
        return fine_uniform(p.shape, key) * q.astype(mx.float64) < p.astype(mx.float64)


def speculative_choices(logits: mx.array, candidates: list[int], draft_probabilities: mx.array | None,
                        params: DecodingParams, seed: int, position: int) -> mx.array:
    """The target's token at each position of a round under speculative sampling, lazily.

    ``logits`` [m + 1, vocabulary] are the target's over the pending token and the ``m``
    candidates, ``draft_probabilities`` [m, vocabulary] the ``q`` each candidate was drawn
    from (in target ids; None when m = 0), ``position`` the tokens committed before the round.
    Choice i is candidate i where the target accepts it (:func:`accept_in_proportion`), else a
    draw from the residual max(0, p - q) (from p where rounding leaves no residual); the last
    is a draw from p. Exact-match settling of these choices
    (:func:`~polspec.decoding.speculative.settle_round`) then commits the accepted run and the
    first replacement: speculative sampling.
    """
    probabilities = sampling_probabilities(logits, params)
    accept_key, residual_key, bonus_key = mx.random.split(position_key(seed, position, _ACCEPT), 3)
    bonus = draw_in_proportion(probabilities[-1:], bonus_key)
    if not candidates:
        return bonus
    p = probabilities[:-1]
    proposed = mx.array(candidates)
    rows = mx.arange(len(candidates))
    accepted = accept_in_proportion(p[rows, proposed], draft_probabilities[rows, proposed], accept_key)
    residual = mx.maximum(p - draft_probabilities, 0.0)
    # No residual means p = q up to rounding, which may still reject (once in some 1e7 candidates);
    # the last index, which a row of zeros draws, could be a token p rules out.
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p)
    replacement = draw_in_proportion(residual, residual_key)
    return mx.concatenate([mx.where(accepted, proposed, replacement), bonus])
