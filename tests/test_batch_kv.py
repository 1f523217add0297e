"""The ragged batch KV cache on its own, with small random arrays in place of a model's keys."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from polspec.decoding import batch_kv

HEADS, DIM, WIDTH = 2, 4, 5  # WIDTH: the positions each round feeds (k = 4 and the bonus token)


def row_cache(length: int, rng: np.random.Generator) -> tuple[KVCache, np.ndarray]:
    keys = rng.standard_normal((1, HEADS, length, DIM)).astype(np.float32)
    cache = KVCache()
    cache.update_and_fetch(mx.array(keys), mx.array(-keys))
    return cache, keys[0]


def test_rows_that_keep_different_runs_keep_their_entries_and_no_padding_piles_up():
    """Each round feeds every row WIDTH positions and keeps 1 + its accepted ones, the longest
    run moving from row to row: the rows stay exact, and the padding every row has is cut
    (it grew by the longest run each round: hundreds of entries attention read for nothing)."""
    rng = np.random.default_rng(0)
    rows = [row_cache(length, rng) for length in (3, 9, 1, 6)]
    layers = [batch_kv.join(None, [[cache] for cache, _ in rows])[0] for _ in range(2)]
    expected = [keys for _, keys in rows]
    for round_ in range(200):
        fed = rng.standard_normal((len(rows), HEADS, WIDTH, DIM)).astype(np.float32)
        for layer in layers:
            layer.update_and_fetch(mx.array(fed), mx.array(-fed))
        accepted = [(round_ + row) % WIDTH for row in range(len(rows))]
        batch_kv.trim_each(layers, [WIDTH - 1 - kept for kept in accepted])
        expected = [np.concatenate([keys, fed[row, :, :1 + accepted[row]]], axis=1) for row, keys in enumerate(expected)]
        for layer in layers:
            padding, lengths = layer.left_padding.tolist(), layer.offset.tolist()
            assert lengths == [keys.shape[1] for keys in expected]
            assert [pad + length for pad, length in zip(padding, lengths)] == [layer._idx] * len(rows)
            assert min(padding) < batch_kv.PADDING_CUT
        keys, values = (np.array(part) for part in layers[1].keys_and_values())
        for row, want in enumerate(expected):
            assert np.array_equal(keys[row, :, padding[row]:], want) and np.array_equal(values[row, :, padding[row]:], -want)
    assert max(lengths) > 300  # long past the cut, many times over


def test_prompts_are_grouped_by_length_within_the_padding_share_and_one_chunk():
    """Sorted prompts run together while the group's padding stays within PADDING_SHARE of its
    tokens and its padded tokens within one prefill chunk; an empty prompt and one longer than a
    chunk go alone."""
    def lengths(*sizes: int) -> list[list[int]]:
        groups = batch_kv._similar_lengths([(1,) * size for size in sorted(sizes)])
        return [[len(ids) for ids in group] for group in groups]

    assert lengths(18, 19, 20, 45) == [[18, 19, 20], [45]]  # 45 beside them: 180 padded for 102
    assert lengths(0, 5) == [[0], [5]]
    assert lengths(10, 11) == [[10, 11]]  # 22 padded for 21 tokens
    assert lengths(10, 12) == [[10, 12]]  # 24 for 22: within 10%
    assert lengths(10, 13) == [[10], [13]]  # 26 for 23: over
    assert lengths(*[100] * 6) == [[100] * 5, [100]]  # 600 tokens would be over one chunk
    assert lengths(600, 600) == [[600], [600]]  # over a chunk alone: fed in chunks, as ever
