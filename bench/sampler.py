"""The sampler's passes over the vocabulary, per row: exp through MLX and through numpy, and a draw.

    .venv/bin/python bench/sampler.py [--rows 8] [--repeats 30]

Every sampled token costs passes over the whole vocabulary (49k for SmolLM2, 152k for Qwen2.5,
262k for Gemma-3): the exp of the sampler's distribution, a cumulative sum and a compare for
the draw. On Linux MLX's CPU wheel spends about 12 ns an element on exp (each element makes six
calls to glibc's ``fmaf``), so polspec's sampler takes its exp through numpy there
(:func:`polspec.decoding.sampling.exp`). For each vocabulary size this times, on random logits
of ``--rows`` rows at once, in milliseconds per row (medians of ``--repeats``):

- ``mx.exp`` and ``sampling.exp`` over the rows;
- a token drawn per row at temperature 0.7 by polspec's sampler
  (:func:`~polspec.decoding.sampling.sampling_probabilities` and
  :func:`~polspec.decoding.sampling.draw_in_proportion`), with its exp through numpy and
  through MLX;
- mlx-lm's draw for the same distribution (``mx.random.categorical`` of the logits over the
  temperature: Gumbel noise over the vocabulary), for reference.

Prints Markdown: the backend line, then the table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from polspec import backend

import mlx.core as mx

from polspec.decoding import DecodingParams, sampling
from polspec.decoding.sampling import draw_in_proportion, sampling_probabilities

VOCABULARIES = {"SmolLM2": 49_152, "Qwen2.5": 151_936, "Gemma-3": 262_144}
TEMPERATURE = 0.7


def per_row_ms(work: Callable[[], mx.array], rows: int, repeats: int) -> float:
    """Median milliseconds of ``work`` (evaluated) over ``repeats`` runs after one, per row."""
    mx.eval(work())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(work())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000 / rows


def polspec_draw(logits: mx.array, key: mx.array, numpy_exp: bool) -> mx.array:
    """polspec's draw of one token a row, its exp through numpy (where the platform allows) or
    MLX: the flag chooses how the graph is built, so it may be evaluated after."""
    default, sampling.NUMPY_EXP = sampling.NUMPY_EXP, sampling.NUMPY_EXP and numpy_exp
    try:
        return draw_in_proportion(sampling_probabilities(logits, DecodingParams(temperature=TEMPERATURE)), key)
    finally:
        sampling.NUMPY_EXP = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8, help="rows sampled at once (a batch's sequences)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    print(backend.setup().summary, "\n")
    print("| vocabulary | `mx.exp` | `sampling.exp` | polspec draw, numpy exp | polspec draw, MLX exp "
          "| mlx-lm's categorical draw |")
    print("|---|---|---|---|---|---|")
    key = mx.random.key(0)
    for name, size in VOCABULARIES.items():
        logits = mx.random.normal((args.rows, size), key=key) * 3
        mx.eval(logits)
        cells = [per_row_ms(work, args.rows, args.repeats) for work in (
            lambda: mx.exp(logits),
            lambda: sampling.exp(logits),
            lambda: polspec_draw(logits, key, numpy_exp=True),
            lambda: polspec_draw(logits, key, numpy_exp=False),
            lambda: mx.random.categorical(logits * (1 / TEMPERATURE), key=key),
        )]
        print(f"| {name} ({size:,}) | " + " | ".join(f"{ms:.2f} ms" for ms in cells) + " |")
    print(f"\nMilliseconds per row, {args.rows} rows at once, medians of {args.repeats}; temperature {TEMPERATURE}.")


if __name__ == "__main__":
    main()
