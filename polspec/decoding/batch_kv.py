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
import time
from collections.abc import Iterator

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache, dynamic_roll, make_prompt_cache

from polspec.cpu_share import share_cores
from polspec.decoding.kv import PREFILL_STEP, prefill
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


# Prompts fed in one forward: their tokens, padding included, at most one prefill chunk
# (kv.PREFILL_STEP, so a forward holds no more memory than a long prompt's chunk does), and the
# padding at most this share of their own tokens. Feeding prompts together is 1.2-1.3x (60-120
# tokens) to 1.8-2.4x (6-19 tokens) faster per prompt than one at a time (BENCHMARKS).
PADDING_SHARE = 0.1


def prefill_groups(model: nn.Module, layers: int,
                   prompts: list[list[int]]) -> Iterator[tuple[list[int], list[BatchKVCache], float]]:
    """The prompts fed to ``model`` in groups of similar length, each group yielded as it is
    ready: the indices of the prompts its rows hold, in row order, its batch cache (left
    padded, for :func:`extend`) and the seconds its feed took. A prompt given more than once (a
    sweep's repeats, a sampled request's seeds) is fed once and its row copied. A prompt alone
    in its group is fed as :func:`prefill_one` feeds it, so a row joining on its own decodes as
    a single sequence would; rows fed together differ from that only by float rounding."""
    copies: dict[tuple[int, ...], list[int]] = {}
    for index, ids in enumerate(prompts):
        copies.setdefault(tuple(ids), []).append(index)
    for group in _similar_lengths(sorted(copies, key=len)):
        clock = time.perf_counter()
        if len(group) == 1:
            cache = [BatchKVCache.merge([single]) for single in prefill_one(model, layers, list(group[0]))]
        else:
            cache = _prefill_left_padded(model, layers, [list(ids) for ids in group])
        rows = [(position, index) for position, ids in enumerate(group) for index in copies[ids]]
        if len(rows) > len(group):
            keep_rows(cache, [position for position, _ in rows])
        mx.eval([(c.keys, c.values) for c in cache if c.keys is not None])  # merging and copying count in its time
        yield [index for _, index in rows], cache, time.perf_counter() - clock


def append_prompts(batch: list[BatchKVCache] | None, model: nn.Module, layers: int,
                   prompts: list[list[int]]) -> tuple[list[BatchKVCache], list[int], list[float]]:
    """``batch`` (a new one when None) with a row for each prompt appended, fed by
    :func:`prefill_groups`: the batch, the prompts' indices in the order of the new rows, and
    each new row's share of its group's feed time (its own prefill time)."""
    order: list[int] = []
    shares: list[float] = []
    for rows, cache, seconds in prefill_groups(model, layers, prompts):
        order += rows
        shares += [seconds / len(rows)] * len(rows)
        batch = extend(batch, cache)
    return batch, order, shares


def _similar_lengths(by_length: list[tuple[int, ...]]) -> Iterator[list[tuple[int, ...]]]:
    """Runs of the prompts (shortest first) that :data:`PADDING_SHARE` and one chunk allow together."""
    group: list[tuple[int, ...]] = []
    for ids in by_length:
        together = group + [ids]
        padded, own = len(together) * len(ids), sum(map(len, together))
        if group and (padded > PREFILL_STEP or padded > (1 + PADDING_SHARE) * own):
            yield group
            together = [ids]
        group = together
    if group:
        yield group


def _prefill_left_padded(model: nn.Module, layers: int, prompts: list[list[int]]) -> list[BatchKVCache]:
    """One forward over the prompts, left padded to the longest (the padding is masked)."""
    longest = max(map(len, prompts))
    padding = [longest - len(ids) for ids in prompts]
    cache = [BatchKVCache(padding) for _ in range(layers)]
    share_cores()
    model(mx.array([[0] * pad + ids for pad, ids in zip(padding, prompts)]), cache=cache)
    return cache


def empty_rows(layers: int, rows: int) -> list[BatchKVCache]:
    """A batch cache of ``rows`` rows that hold nothing yet, for :func:`extend`."""
    return [BatchKVCache([0] * rows) for _ in range(layers)]


def join(batch: list[BatchKVCache] | None, singles: list[list[KVCache]]) -> list[BatchKVCache]:
    """``batch`` with the single-sequence caches appended as new rows (a new batch when None)."""
    return extend(batch, [BatchKVCache.merge([single[layer] for single in singles]) for layer in range(len(singles[0]))])


def extend(batch: list[BatchKVCache] | None, rows: list[BatchKVCache]) -> list[BatchKVCache]:
    """``batch`` with the rows of another batch cache appended (``rows`` itself when None)."""
    if batch is None:
        return rows
    for mine, theirs in zip(batch, rows):
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
