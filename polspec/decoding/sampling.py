"""The sampler stack shared by every decoder: greedy, temperature, top-p, top-k.

A sampler owns its random key (from the sequence's seed), so a sequence draws the same
samples whether it decodes alone or inside a batch with any other sequences.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from polspec.decoding.params import DecodingParams


def token_sampler(params: DecodingParams) -> Callable[[mx.array], mx.array]:
    """A function from logits ``(..., vocab)`` to sampled token ids ``(...)``.

    Rows are sampled independently, which is what lossless verification needs: each
    candidate position draws its own token from the target's distribution there. Each call
    splits the sampler's own key (``params.seed``, or a random one when the seed is None).
    """
    if params.temperature == 0:
        return lambda logits: mx.argmax(logits, axis=-1)
    filters = []
    if params.top_p < 1:
        filters.append(lambda logprobs: apply_top_p(logprobs, params.top_p))
    if params.top_k > 0:
        filters.append(lambda logprobs: apply_top_k(logprobs, params.top_k))
    seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(63)
    key = mx.random.key(seed)

    def sample(logits: mx.array) -> mx.array:
        nonlocal key
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        for keep_likely in filters:
            logprobs = keep_likely(logprobs)
        key, draw = mx.random.split(key)
        return mx.random.categorical(logprobs * (1.0 / params.temperature), key=draw)

    return sample
