"""Prompts joining a batch, prefilled one at a time against together in groups of similar length.

    .venv/bin/python bench/prefill.py [--model gemma3-270m] [--datasets pl-short,pl-wiki] [--prompts 32]

When several sequences join the batched decoder at once (a batch's start, a sweep cell), their
prompts are fed to the target in left-padded groups
(:func:`polspec.decoding.batch_kv.prefill_groups`; the draft's feed on a row's first proposal
goes the same way). For each set this times feeding its first ``--prompts`` prompts (as the
decoder feeds them: all but the last token) each alone with
:func:`~polspec.decoding.batch_kv.prefill_one`, and through ``prefill_groups``, in turn within
each repeat (medians of ``--repeats``), and checks that every row holds what its prompt fed
alone holds, up to float rounding (the largest difference in any layer's keys or values).

Prints Markdown: the backend line, then the table.
"""

from __future__ import annotations

import argparse
import statistics
import time

from polspec import backend

import mlx.core as mx

from polspec.decoding import DecodingParams, batch_kv
from polspec.decoding.run import encode_prompt
from polspec.jobs.datasets import load_dataset
from polspec.models.loader import load_model


def each_alone(model, layers: int, prompts: list[list[int]]) -> list:
    return [batch_kv.prefill_one(model, layers, ids) for ids in prompts]


def largest_difference(model, layers: int, prompts: list[list[int]]) -> float:
    """The largest difference between a row fed in its group and its prompt fed alone."""
    worst = 0.0
    for rows, cache, _ in batch_kv.prefill_groups(model, layers, prompts):
        for position, index in enumerate(rows):
            length = len(prompts[index])
            for grouped, alone in zip(cache, batch_kv.prefill_one(model, layers, prompts[index])):
                for part, want in zip(grouped.keys_and_values(), (alone.keys, alone.values)):
                    difference = mx.abs(part[position, :, -length:] - want[0, :, :length]).max().item()
                    worst = max(worst, difference)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--datasets", default="pl-short,pl-wiki", help="comma-separated built-in sets")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(backend.setup().summary, "\n")
    loaded = load_model(args.model)
    layers = batch_kv.check_batchable(loaded.model, args.model)
    print("| set | prompt tokens (min / median / max) | groups | each alone | in groups | alone / groups "
          "| largest difference |")
    print("|---|---|---|---|---|---|---|")
    for name in args.datasets.split(","):
        items = load_dataset(name, DecodingParams(), args.prompts)
        prompts = [encode_prompt(loaded, item.prompt, chat=False)[:-1] for item in items]
        alone, grouped, groups = [], [], 0
        for _ in range(args.repeats + 1):  # the first repeat warms each shape up and is not kept
            start = time.perf_counter()
            each_alone(loaded.model, layers, prompts)
            alone.append(time.perf_counter() - start)
            start = time.perf_counter()
            groups = len(list(batch_kv.prefill_groups(loaded.model, layers, prompts)))
            grouped.append(time.perf_counter() - start)
        alone_s, grouped_s = statistics.median(alone[1:]), statistics.median(grouped[1:])
        lengths = sorted(map(len, prompts))
        print(f"| {name} | {lengths[0]} / {statistics.median(lengths):g} / {lengths[-1]} | {groups} "
              f"| {alone_s:.2f} s | {grouped_s:.2f} s | {alone_s / grouped_s:.2f}x "
              f"| {largest_difference(loaded.model, layers, prompts):.1e} |")
    print(f"\n{args.model}, {args.prompts} prompts a set, medians of {args.repeats}.")


if __name__ == "__main__":
    main()
