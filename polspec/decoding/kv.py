"""KV caches for decoding: creation with the trimmability check, prefill, length, trim."""

from __future__ import annotations

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache, trim_prompt_cache

from polspec.errors import PolspecError

PREFILL_STEP = 512


def new_cache(model: nn.Module, alias: str, longest: int) -> list:
    """A fresh cache for ``model`` that can be trimmed while it holds up to ``longest`` tokens.

    Speculative decoding trims rejected candidates every round: caches of state-space
    layers cannot be trimmed at all, and a rotating (sliding-window) cache only until it
    wraps, so such models are refused with the reason.
    """
    cache = make_prompt_cache(model)
    for layer in cache:
        if isinstance(layer, RotatingKVCache):
            if longest >= layer.max_size:
                raise PolspecError(
                    f"{alias} uses a sliding-window cache of {layer.max_size} tokens that cannot be trimmed once "
                    f"full; prompt plus generation needs {longest}: shorten the prompt or --max-tokens"
                )
        elif not isinstance(layer, KVCache):
            raise PolspecError(
                f"{alias} has {type(layer).__name__} layers (state-space or similar) whose cache cannot be trimmed; "
                "speculative decoding needs a trimmable cache"
            )
    return cache


def prefill(model: nn.Module, cache: list, ids: list[int]) -> None:
    """Run ``ids`` through the model into ``cache`` (no logits kept)."""
    for start in range(0, len(ids), PREFILL_STEP):
        model(mx.array([ids[start:start + PREFILL_STEP]]), cache=cache)
        mx.eval([c.state for c in cache])


def cached_length(cache: list) -> int:
    return cache[0].offset


def trim(cache: list, tokens: int) -> None:
    """Drop the last ``tokens`` entries from every layer, or fail loudly: never a partial trim."""
    if tokens <= 0:
        return
    trimmed = trim_prompt_cache(cache, tokens)
    if trimmed != tokens:
        raise PolspecError(
            f"the KV cache could trim only {trimmed} of {tokens} tokens (a sliding window is full); "
            "shorten the prompt or --max-tokens"
        )
