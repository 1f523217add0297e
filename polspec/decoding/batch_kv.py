"""The ragged batch KV cache: mlx-lm's ``BatchKVCache`` with per-sequence trimming.

mlx-lm keeps a batch left-padded: every row's entries end at the same physical index, each
row's ``left_padding`` is masked out, and ``offset`` (one per row) gives RoPE each row's own
positions. Speculative decoding needs more: after verification each row keeps its own number
of the positions fed this round, and a right-padded catch-up chunk leaves a different number
of padding entries at the end of each row. :func:`trim_each` trims row by row and rolls each
row right by what it lost beyond the least, so that every row stays contiguous and
right-aligned, which is what ``BatchKVCache``'s masks assume.

Every layer, sliding-window ones included, gets a plain (non-rotating) cache: the window is
applied by the attention mask (``window_size`` in ``make_mask``), which attends to exactly
the keys a rotating cache would hold, and a plain cache can be trimmed at any length.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache, dynamic_roll, make_prompt_cache

from polspec.decoding.kv import prefill
from polspec.errors import PolspecError

# Memory a batch may plan to use, as a share of what is free when the decoder starts: the
# rest is left for activations, the allocator's cache and other processes.
MEMORY_SHARE = 0.7


def check_batchable(model: nn.Module, alias: str) -> int:
    """The model's number of cache layers; refuses models whose cache cannot be trimmed."""
    layers = make_prompt_cache(model)
    for layer in layers:
        if not isinstance(layer, (KVCache, RotatingKVCache)):
            raise PolspecError(
                f"{alias} has {type(layer).__name__} layers (state-space or similar) whose cache cannot be trimmed; "
                "batched and speculative decoding need a trimmable cache"
            )
    return len(layers)


def prefill_one(model: nn.Module, layers: int, ids: list[int]) -> list[KVCache]:
    """A single sequence's cache with ``ids`` fed (no logits kept), ready to join a batch."""
    cache = [KVCache() for _ in range(layers)]
    prefill(model, cache, ids)
    return cache


def prefill_each(model: nn.Module, layers: int, prompts: list[list[int]]) -> Iterator[list[KVCache]]:
    """:func:`prefill_one` for each prompt in turn, yielded as it is ready; a prompt given
    before (a sweep's repeats, a sampled request's seeds) is not fed again but yielded again,
    since :func:`join` copies a cache into each row it makes."""
    fed: dict[tuple[int, ...], list[KVCache]] = {}
    for ids in prompts:
        key = tuple(ids)
        if key not in fed:
            fed[key] = prefill_one(model, layers, ids)
        yield fed[key]


def join(batch: list[BatchKVCache] | None, singles: list[list[KVCache]]) -> list[BatchKVCache]:
    """``batch`` with the single-sequence caches appended as new rows (a new batch when None)."""
    merged = [BatchKVCache.merge([single[layer] for single in singles]) for layer in range(len(singles[0]))]
    if batch is None:
        return merged
    for mine, theirs in zip(batch, merged):
        mine.extend(theirs)
    return batch


def keep_rows(batch: list[BatchKVCache], rows: list[int]) -> None:
    """Drop every row not in ``rows`` (in place); the left padding they shared is cut."""
    indices = mx.array(rows)
    for layer in batch:
        layer.filter(indices)


def trim_each(batch: list[BatchKVCache], amounts: list[int]) -> None:
    """Drop the last ``amounts[i]`` entries of row ``i`` in every layer, rows kept right-aligned."""
    least = min(amounts)
    shifts = [amount - least for amount in amounts]
    for layer in batch:
        if layer.trim(least) != least:
            raise PolspecError(f"the batch KV cache holds fewer than the {least} entries to trim")
        if not any(shifts) or layer.keys is None:
            continue
        end = layer._idx
        by = mx.array(shifts)[:, None]
        # What each row rolls out at the end wraps into its left padding, which is masked.
        layer.keys[..., :end, :] = dynamic_roll(layer.keys[..., :end, :], by, axis=2)
        layer.values[..., :end, :] = dynamic_roll(layer.values[..., :end, :], by, axis=2)
        step = mx.array(shifts)
        layer.offset = layer.offset - step
        layer.left_padding = layer.left_padding + step
    if any(shifts):
        _cut_shared_padding(batch)


# Left padding every row has is cut once it reaches this many entries: each cut copies the cache.
PADDING_CUT = 64


def _cut_shared_padding(batch: list[BatchKVCache]) -> None:
    """Drop the left padding every row of the batch has (a host sync of one small array).

    :func:`trim_each` moves a row right by what it lost beyond the row that lost least, so
    while rows stay together (mlx-lm cuts shared padding only when a row leaves) every row
    gathers padding that the cache holds and attention reads: 326 entries beside a longest row
    of 462 after 150 rounds of 8 rows at k = 4."""
    if batch[0].keys is None:
        return
    shared = min(batch[0].left_padding.tolist())
    if shared < PADDING_CUT:
        return
    for layer in batch:  # every layer was trimmed alike: one padding for all
        layer.keys = layer.keys[..., shared:, :]
        layer.values = layer.values[..., shared:, :]
        layer._idx -= shared
        layer.left_padding = layer.left_padding - shared


def row_lengths(batch: list[BatchKVCache]) -> list[int]:
    """Entries each row holds (a host sync: for checks, not for the decode loop)."""
    return batch[0].offset.tolist()


_KV_BYTES: dict[int, int] = {}


def kv_bytes_per_token(model: nn.Module, alias: str) -> int:
    """Bytes one token of one sequence adds to the model's KV cache, measured once with one forward
    (a model whose cache cannot be trimmed is refused, see :func:`check_batchable`)."""
    if id(model) not in _KV_BYTES:
        cache = prefill_one(model, check_batchable(model, alias), [1, 1])
        _KV_BYTES[id(model)] = sum(c.keys[..., :1, :].nbytes + c.values[..., :1, :].nbytes for c in cache)
    return _KV_BYTES[id(model)]


def free_memory_bytes() -> int:
    """Memory this process may still use: on a CUDA GPU the device's free memory, where the
    caches live (the host's MemAvailable says nothing of it, and the weights fill part of the
    card already); else the kernel's MemAvailable on Linux, else physical memory less what MLX
    holds (unified memory on a Mac)."""
    if mx.default_device().type == mx.gpu:
        free = mx.device_info().get("free_memory")  # MLX gives it for CUDA devices only
        if isinstance(free, int):
            return free + mx.get_cache_memory()  # the driver counts MLX's cached buffers as used
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") - mx.get_active_memory()
