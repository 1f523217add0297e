"""Checks the decoder tests share: equal greedy output or a float tie shown in the target's own
logits, and a chi-square goodness of fit of sampled two-token sequences against the target's
exact joint distribution."""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx
import numpy as np

from polspec.decoding.batch import stream_batch
from polspec.decoding.params import DecodingParams
from polspec.decoding.run import encode_prompt
from polspec.decoding.sampling import sampling_probabilities

TIE = 1e-5


def last_logits(model, ids: list[int]) -> np.ndarray:
    """The model's logits for the token after ``ids``, from one forward without a cache."""
    return np.array(model.model(mx.array([ids]))[0, -1])


def assert_same_or_float_tie(target, prompt: str, expected: list[int], actual: list[int]) -> None:
    """Equal ids, or the first difference is a float tie in the target's own logits (shown, not assumed)."""
    if actual == expected:
        return
    index = next(i for i, (a, b) in enumerate(zip(actual, expected)) if a != b)
    logits = np.sort(last_logits(target, encode_prompt(target, prompt, chat=False) + expected[:index]))
    gap = float(logits[-1] - logits[-2])
    assert gap < TIE, f"{prompt!r}: token {index} differs ({actual[index]} vs {expected[index]}) with a logit gap of {gap}"


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


SAMPLED_PROMPT = "Wisła to najdłuższa rzeka"  # a next-token distribution with a few likely tokens
OPEN_PROMPT = "Lubię jeść"  # likely two-token continuations enough to test even at temperature 0.7


def next_token_probabilities(model, ids: list[int], params: DecodingParams) -> np.ndarray:
    """The target-only sampler's distribution after ``ids`` (temperature, top-p, top-k)."""
    return np.array(sampling_probabilities(mx.array(last_logits(model, ids)), params)).astype(np.float64)


def two_token_bins(model, prompt: str, temperature: float, samples: int, top_p: float = 1.0,
                   top_k: int = 0) -> dict[tuple, float]:
    """Exact probabilities of the first two sampled tokens, from the target's own logits, in bins
    that ``samples`` draws fill at least 5 times on average: ``(t0, t1)`` for a likely pair,
    ``(t0, None)`` for a likely first token followed by any other. The chi-square test pools the
    sequences of no bin into one whose probability is the rest of the mass.
    """
    params = DecodingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    ids = encode_prompt(model, prompt, chat=False)
    first = next_token_probabilities(model, ids, params)
    eos = set(model.tokenizer.eos_token_ids)
    bins: dict[tuple, float] = {}
    for t0 in map(int, np.flatnonzero(first * samples >= 5)):
        if t0 in eos:  # generation stops after it: a one-token sequence
            bins[(t0,)] = float(first[t0])
            continue
        joint = first[t0] * next_token_probabilities(model, ids + [t0], params)
        pairs = {(t0, int(t1)): float(joint[t1]) for t1 in np.flatnonzero(joint * samples >= 5)}
        bins |= pairs
        other = float(first[t0]) - sum(pairs.values())
        if other * samples >= 5:
            bins[(t0, None)] = other
    return bins


def goodness_of_fit(sequences: list[list[int]], bins: dict[tuple, float]) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of sampled sequences against exact bin probabilities."""
    def bin_of(ids: list[int]) -> tuple | None:
        for key in (tuple(ids), (ids[0], None)):
            if key in bins:
                return key
        return None

    n = len(sequences)
    observed = Counter(bin_of(ids) for ids in sequences)
    cells = [(observed[key], n * p) for key, p in bins.items()]
    rest = (observed[None], n * (1 - sum(bins.values())))
    if rest[1] > 1e-9:
        cells.append(rest)
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


def sampled_sequences(target, draft, prompt: str, params: list[DecodingParams], max_batch: int = 16,
                      metrics: list | None = None) -> list[list[int]]:
    """Each request's committed ids, decoded ``max_batch`` at a time by the batched decoder:
    many seeded samples at the cost of a few. (The single-sequence decoder draws what a row of
    a batch draws with the same seed, as test_batch and test_speculative_sampling check.)
    Each finished sequence's metrics go to ``metrics`` when given."""
    sequences: list[list[int]] = [[] for _ in params]
    for event in stream_batch(target, draft, [(prompt, p) for p in params], max_batch=max_batch, chat=False):
        if event.commit:
            sequences[event.key] += event.commit.tokens
        if event.finished and metrics is not None:
            metrics.append(event.metrics)
    return sequences
