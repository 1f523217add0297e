"""The sampler stack shared by both decoders: greedy, temperature, top-p, top-k."""

from __future__ import annotations

from collections.abc import Callable

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from polspec.decoding.params import DecodingParams


def token_sampler(params: DecodingParams) -> Callable[[mx.array], mx.array]:
    """A function from logits ``(..., vocab)`` to sampled token ids ``(...)``.

    Rows are sampled independently, which is what lossless verification needs: each
    candidate position draws its own token from the target's distribution there.
    """
    if params.temperature == 0:
        return lambda logits: mx.argmax(logits, axis=-1)
    sampler = make_sampler(temp=params.temperature, top_p=params.top_p if params.top_p < 1 else 0.0, top_k=params.top_k)
    return lambda logits: sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
