"""The sampler stack shared by every decoder: greedy, temperature, top-p, top-k.

A sampler owns its random key (from the sequence's seed), so a sequence with a fixed ``k``
draws the same samples whether it decodes alone or inside a batch with any other sequences
(under ``k = auto`` the batch's shared draft length decides where its rounds end, and so which
draw a position gets; not the distribution).
"""

from __future__ import annotations

import platform
import random
from collections.abc import Callable

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from polspec.decoding.params import DecodingParams


def sampling_probabilities(logits: mx.array, params: DecodingParams) -> mx.array:
    """Probabilities ``(..., vocab)`` (float32, each row summing to 1) of the distribution a
    sampled decoder draws from at ``params.temperature > 0``: top-p and top-k on the model's
    probabilities, then the temperature. Speculative sampling needs this distribution itself,
    not just a draw from it. Without top-p or top-k it takes one :func:`exp` over the
    vocabulary, after the temperature; with them, one more before. A ``top_k`` of the vocabulary
    or more keeps every token (a draft's pruned vocabulary can be smaller than the target's)."""
    scores = logits.astype(mx.float32)
    top_k = params.top_k if params.top_k < logits.shape[-1] else 0
    if params.top_p < 1 or top_k > 0:
        shifted = scores - scores.max(axis=-1, keepdims=True)
        scores = shifted - mx.log(exp(shifted).sum(axis=-1, keepdims=True))
    if params.top_p < 1:
        scores = nucleus(scores, params.top_p)
    if top_k > 0:
        scores = apply_top_k(scores, top_k)
    weights = exp((scores - scores.max(axis=-1, keepdims=True)) * (1.0 / params.temperature))
    return weights / weights.sum(axis=-1, keepdims=True)


# Whether :func:`exp` computes through numpy on the CPU device (tests switch it off to check
# that both ways give the same distribution).
NUMPY_EXP = platform.system() == "Linux"


def exp(x: mx.array) -> mx.array:
    """``mx.exp(x)``, through numpy on the CPU device under Linux, where MLX's wheel computes
    each element with six calls to glibc's ``fmaf`` (about 12 ns; numpy's vectorized exp:
    0.4 ns): over a 262k vocabulary that is 3 ms against 0.1 ms a row, a quarter of a batched
    sampled step of the 270M Gemma-3 target (BENCHMARKS, "A faster exp for the sampler").
    Evaluates ``x`` there; lazy elsewhere."""
    if not NUMPY_EXP or mx.default_device() != mx.cpu:
        return mx.exp(x)
    return mx.array(np.exp(np.asarray(x.astype(mx.float32))))


def draw_in_proportion(weights: mx.array, key: mx.array) -> mx.array:
    """An index into the last axis of ``weights`` (non-negative, unnormalized), drawn with
    probability proportional to its weight, for each row, lazily. Inverse CDF: one uniform
    number a row where a categorical draw takes Gumbel noise and two logs over the whole
    vocabulary. A zero weight is never drawn, but in a row of zeros, which gives the last index.

    In float64, on the CPU (MLX has no float64 on GPUs), with a :func:`fine_uniform` number
    (MLX's float32 ones are not spaced quite evenly: a share of 2**-23 may be off by about
    2**-25): a float32 running sum stops growing at weights below about 3e-8 of the total
    once it passes half of it, and a float32 uniform number has 24 bits, so most of a large
    vocabulary could never be drawn (up to 1e-3 of Gemma-3's next-token mass at temperature 1)."""
    with mx.stream(mx.cpu):
        cumulative = mx.cumsum(weights.astype(mx.float64), axis=-1)
        total = cumulative[..., -1:]
        # Strictly below the total, or rounding of uniform * total could reach it and draw the
        # last index whatever its weight.
        threshold = mx.minimum(fine_uniform(total.shape, key) * total, total * (1 - 2**-52))
        return mx.minimum((cumulative <= threshold).sum(axis=-1), weights.shape[-1] - 1)


def fine_uniform(shape: tuple[int, ...], key: mx.array) -> mx.array:
    """Uniform numbers in [0, 1) of about 46 bits, float64 on the CPU, made of two float32 ones
    (whose 24 bits cannot tell a chance below 2**-24 from 0, nor two chances 2**-24 apart)."""
    with mx.stream(mx.cpu):
        coarse, fine = mx.random.uniform(shape=(2, *shape), key=key).astype(mx.float64)
        return (mx.floor(coarse * 2**23) + fine) * 2**-23


# How many of the most likely tokens :func:`nucleus` sorts before it falls back to sorting the
# whole vocabulary: they hold 0.95 of Gemma-3's next-token mass at 22 of the 23 positions of a
# Polish sentence (the test's), and sorting 1,024 values costs nothing next to sorting
# 262,144 (30 ms a row on a 2-core CPU).
NUCLEUS_BOUND = 1024


def nucleus(logprobs: mx.array, top_p: float) -> mx.array:
    """``logprobs (..., vocab)`` (normalized) outside each row's nucleus set to -inf. The nucleus
    is mlx-lm's ``apply_top_p``'s, up to float rounding at its edge, but where a row's
    :data:`NUCLEUS_BOUND` most likely tokens hold ``top_p`` of its mass, as they mostly do,
    only those are sorted, not the whole vocabulary. Each row's result depends on that row
    alone, so a sequence keeps its samples whatever a batch holds. Reads one flag back from
    the device."""
    if logprobs.shape[-1] <= 4 * NUCLEUS_BOUND:
        return apply_top_p(logprobs, top_p)
    top = mx.sort(mx.topk(logprobs, NUCLEUS_BOUND, axis=-1), axis=-1)
    top_probs = mx.exp(top)
    mass = top_p * exp(logprobs).sum(axis=-1, keepdims=True)
    mass_above = mx.cumsum(top_probs, axis=-1, reverse=True, inclusive=False)
    threshold = mx.take_along_axis(top, (mass_above >= mass).sum(axis=-1, keepdims=True), axis=-1)
    kept = mx.where(logprobs < threshold, -float("inf"), logprobs)
    covered = mass_above[..., :1] + top_probs[..., :1] >= mass
    if mx.all(covered).item():
        return kept
    return mx.where(covered, kept, apply_top_p(logprobs, top_p))


def sequence_seed(params: DecodingParams) -> int:
    """The sequence's seed: ``params.seed``, or a random one when it is None."""
    return params.seed if params.seed is not None else random.SystemRandom().getrandbits(63)


def token_sampler(params: DecodingParams, seed: int | None = None) -> Callable[[mx.array], mx.array]:
    """A function from logits ``(..., vocab)`` to sampled token ids ``(...)``.

    Rows are sampled independently, which is what lossless verification needs: each
    candidate position draws its own token from the target's distribution there. Each call
    splits the sampler's own key (``seed``, default :func:`sequence_seed`).
    """
    if params.temperature == 0:
        return lambda logits: mx.argmax(logits, axis=-1)
    key = mx.random.key(seed if seed is not None else sequence_seed(params))

    def sample(logits: mx.array) -> mx.array:
        nonlocal key
        key, draw = mx.random.split(key)
        return draw_in_proportion(sampling_probabilities(logits, params), draw)

    return sample


def position_key(seed: int, position: int, purpose: int, step: int = 0) -> mx.array:
    """A random key for one draw of a sequence, fixed by where it is drawn rather than by how
    many draws came before: the ``step``-th draw for ``purpose`` when ``position`` tokens are
    committed. The batched decoder may run a row through more or fewer draft steps than the
    single-sequence decoder would, and the row must still draw what it would draw alone."""
    mixed = seed & (2**64 - 1)
    for value in (position, purpose, step):
        mixed = _splitmix64(mixed ^ (value & (2**64 - 1)))
    return mx.random.key(mixed >> 1)


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & (2**64 - 1)
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return value ^ (value >> 31)
