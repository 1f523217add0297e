"""KV caches for decoding: creation with the trimmability check, prefill, length, trim."""

from __future__ import annotations

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache, trim_prompt_cache

from polspec.cpu_share import share_cores
from polspec.errors import PolspecError

PREFILL_STEP = 512


def new_cache(model: nn.Module, alias: str) -> list:
    """A fresh cache for ``model`` that can be trimmed at any length.

    Speculative decoding trims rejected candidates every round. A rotating (sliding-window)
    cache can be trimmed only until it wraps, so every layer gets a plain cache instead, and
    mlx-lm's models apply the window through the attention mask (``window_size``), which
    attends to exactly the keys a rotating cache would hold: a sliding-window model serves any
    length its context allows, at the memory of a full cache. The caches of state-space layers
    cannot be trimmed at all, so such models are refused with the reason.
    """
    cache = make_prompt_cache(model)
    for layer in cache:
        if not isinstance(layer, (KVCache, RotatingKVCache)):
            raise PolspecError(
                f"{alias} has {type(layer).__name__} layers (state-space or similar) whose cache cannot be trimmed; "
                "speculative decoding needs a trimmable cache"
            )
    return [KVCache() for _ in cache]


def prefill(model: nn.Module, cache: list, ids: list[int]) -> None:
    """Run ``ids`` through the model into ``cache`` (no logits kept), taking this process's share
    of the cores between chunks (:func:`~polspec.cpu_share.share_cores`: a long prompt on a large
    model takes minutes)."""
    for start in range(0, len(ids), PREFILL_STEP):
        share_cores()
        model(mx.array([ids[start:start + PREFILL_STEP]]), cache=cache)
        mx.eval([c.state for c in cache if c.keys is not None])  # a layer may hold nothing yet


def cached_length(cache: list) -> int:
    return cache[0].offset


def trim(cache: list, tokens: int) -> None:
    """Drop the last ``tokens`` entries from every layer, or fail loudly: never a partial trim."""
    if tokens <= 0:
        return
    trimmed = trim_prompt_cache(cache, tokens)
    if trimmed != tokens:
        raise PolspecError(f"the KV cache could trim only {trimmed} of {tokens} tokens")
