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
`` przepływa``, Qwen2.5's `` prz`` ``ep`` ``ły`` ``wa``) proposes the first of them, so ``q`` of
a target token is the draft's probability of every token that starts with it; the proposal
ends there, as the draft has seen more text than the candidate holds. No re-tokenization:
candidates are the mapped tokens themselves, which the target may score although it would
have split the text otherwise; lossless all the same, since the rule above holds for any
``q`` that depends only on the committed text.

``p`` and ``q`` are both the sampler's distribution (:func:`~polspec.decoding.sampling.sampling_logprobs`:
top-p, top-k, temperature), ``q`` over the shared vocabulary of the draft's output layer
(pruned or full). Random draws are keyed by the sequence's seed and position
(:func:`~polspec.decoding.sampling.position_key`), so a sequence samples the same tokens
alone or in any batch.
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
from polspec.decoding.sampling import position_key, sampling_logprobs
from polspec.decoding.translate import TokenBytes, token_bytes
from polspec.models.loader import LoadedModel

# What a random draw is for, in position_key.
_DRAFT, _ACCEPT = 1, 2


@dataclass(frozen=True)
class SharedVocabulary:
    """The target token each draft token proposes: ``to_target[d]`` is draft token ``d``'s twin
    (the target token with the same bytes; ``twin[d]``), else the target's first token of its
    text, else -1 (the draft never proposes it: a special token, part of a character). Where
    several target tokens have the same bytes (a SentencePiece byte piece ``<0x41>`` beside
    ``A``), the twin is the one the target's tokenizer produces for them. Several draft tokens
    map to one target token (`` prz`` and `` przepływa``): its ``q`` is the sum of theirs."""

    to_target: np.ndarray  # int64 [draft vocabulary]
    target_vocabulary: int
    twin: np.ndarray  # bool [draft vocabulary]: the draft token's text is exactly its target token's

    @property
    def size(self) -> int:
        """Draft tokens that propose a target token."""
        return int((self.to_target >= 0).sum())


def shared_vocabulary(target: LoadedModel, draft: LoadedModel) -> SharedVocabulary:
    """The pair's :class:`SharedVocabulary` (the identity where both use one tokenizer family)."""
    target_tokenizer, draft_tokenizer = target.tokenizer._tokenizer, draft.tokenizer._tokenizer
    if target.entry.tokenizer_family == draft.entry.tokenizer_family:
        size = len(draft_tokenizer)
        to_target = np.arange(size)
        to_target[to_target >= len(target_tokenizer)] = -1
        return SharedVocabulary(to_target, len(target_tokenizer), to_target >= 0)
    return _byte_twins(draft_tokenizer, target_tokenizer, tuple(draft.tokenizer.eos_token_ids),
                       target.tokenizer.eos_token_id)


@lru_cache(maxsize=8)
def _byte_twins(draft_tokenizer, target_tokenizer, draft_eos: tuple[int, ...], target_eos: int | None) -> SharedVocabulary:
    draft_table, target_table = token_bytes(draft_tokenizer), token_bytes(target_tokenizer)
    target_ids = _canonical_ids(target_table)
    to_target = np.array([target_ids.get(raw, -1) if raw else -1 for raw in draft_table.raw])
    twin = to_target >= 0
    to_target[~twin] = _first_target_tokens(draft_table, target_table, np.flatnonzero(~twin))
    if target_eos is not None:
        ends = [eos for eos in draft_eos if eos < len(to_target)]
        to_target[ends], twin[ends] = target_eos, True
    return SharedVocabulary(to_target, len(target_table.raw), twin)


def _first_target_tokens(draft: TokenBytes, target: TokenBytes, tokens: np.ndarray) -> np.ndarray:
    """For draft tokens without a twin, the target's first token of their text where it is a
    proper prefix of it (`` przepływa`` in Qwen2.5's tokens is `` prz``, ``ep``, ...), else -1."""
    texts, which = [], []
    for token in tokens.tolist():
        raw = draft.raw[token]
        try:
            texts.append(raw.decode("utf-8"))
        except (AttributeError, UnicodeDecodeError):  # special, or part of a character
            continue
        which.append(token)
    first = np.full(len(tokens), -1)
    position = {token: index for index, token in enumerate(tokens.tolist())}
    encoded = target.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    for token, text, ids in zip(which, texts, encoded):
        head = target.raw[ids[0]] if ids else None
        if head and text.encode().startswith(head):
            first[position[token]] = ids[0]
    return first


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
    :class:`SharedVocabulary`) and maps what it samples to target ids."""

    def __init__(self, head: DraftHead, shared: SharedVocabulary, draft: LoadedModel):
        width = head.size if head.size is not None else vocabulary_size(draft.model)
        to_target = np.full(max(width, len(shared.to_target)), -1)
        to_target[: len(shared.to_target)] = shared.to_target
        targets = to_target[np.array(head.keep)] if head.keep is not None else to_target[:width]
        self.head = head
        self.to_target = to_target  # by draft token id
        self.twin = np.zeros(len(to_target), bool)
        self.twin[: len(shared.twin)] = shared.twin
        self.shared = mx.array(targets >= 0)  # by logit index
        # Where each logit index's probability lands in the target's vocabulary (added up where
        # indices share a twin); an index with no twin adds its probability (zero: it is
        # masked) to token 0.
        self.scatter = mx.array(np.maximum(targets, 0))
        self.share = float((targets >= 0).mean())

    def sample(self, logits: mx.array, params: DecodingParams, seed: int, position: int, step: int
               ) -> tuple[mx.array, mx.array]:
        """The logit index of a draft token sampled from ``logits`` (one row) restricted to the
        tokens that propose a target token, and that distribution over the logit indices; both lazy."""
        logprobs = sampling_logprobs(mx.where(self.shared, logits, -mx.inf), params)
        index = mx.random.categorical(logprobs, key=position_key(seed, position, _DRAFT, step))
        return index, mx.exp(logprobs)

    def candidates(self, proposal: list[int]) -> list[int]:
        """The target tokens that proposed draft token ids stand for, up to and including the
        first that is not a twin (the draft's later tokens follow text the candidates lack)."""
        found = []
        for token in proposal:
            found.append(int(self.to_target[token]))
            if not self.twin[token]:
                break
        return found

    def in_target_space(self, probabilities: list[mx.array], width: int) -> mx.array:
        """Draft distributions over logit indices as distributions over the target's ``width``
        ids: each twin gets the probability of every draft token that maps to it."""
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
    shipped words, by frequency) that the draft can propose under TLI: those with a twin in the
    draft's output layer under ``draft_vocab``. Speculative sampling can accept no other token,
    so a low share caps its acceptance for the pair."""
    head = draft_head(draft, draft_vocab)
    sampler = shared_draft(head, target, draft)
    proposable = set(sampler.to_target[np.array(head.keep) if head.keep is not None else slice(None)].tolist())
    weights = polish_token_weights(target.tokenizer._tokenizer, words)
    return sum(w for token, w in weights.items() if token in proposable) / sum(weights.values())


def speculative_choices(logits: mx.array, candidates: list[int], draft_probabilities: mx.array | None,
                        params: DecodingParams, seed: int, position: int) -> mx.array:
    """The target's token at each position of a round under speculative sampling, lazily.

    ``logits`` [m + 1, vocabulary] are the target's over the pending token and the ``m``
    candidates, ``draft_probabilities`` [m, vocabulary] the ``q`` each candidate was drawn
    from (in target ids; None when m = 0), ``position`` the tokens committed before the round.
    Choice i is candidate i where the target accepts it (a uniform draw below p/q), else a
    draw from the residual max(0, p - q); the last is a draw from p. Exact-match settling of
    these choices (:func:`~polspec.decoding.speculative.settle_round`) then commits the
    accepted run and the first replacement: speculative sampling.
    """
    logprobs = sampling_logprobs(logits, params)
    accept_key, residual_key, bonus_key = mx.random.split(position_key(seed, position, _ACCEPT), 3)
    bonus = mx.random.categorical(logprobs[-1:], key=bonus_key)
    if not candidates:
        return bonus
    p = mx.exp(logprobs[:-1])
    proposed = mx.array(candidates)
    rows = mx.arange(len(candidates))
    accepted = mx.random.uniform(shape=(len(candidates),), key=accept_key) * draft_probabilities[rows, proposed] \
        < p[rows, proposed]
    replacement = mx.random.categorical(mx.log(mx.maximum(p - draft_probabilities, 0.0)), key=residual_key)
    return mx.concatenate([mx.where(accepted, proposed, replacement), bonus])
