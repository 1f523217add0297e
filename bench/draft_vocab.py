"""What a pruned draft vocabulary saves: the draft step against the target step, per size.

    .venv/bin/python bench/draft_vocab.py --target qwen2.5-coder-1.5b --drafts gemma3-270m,smollm2-135m

For each draft, one target step and one draft step per vocabulary size (the draft's logits at
the last position only, as it decodes) are timed in turn within every repeat, 64 tokens
cached, so that drift hits them alike; c is the draft step over the target step. The last
column is the old draft step, the whole forward with logits at every fed position, for the
first draft step of a round that feeds 8 positions, against the full vocabulary at the last
position only (``--sizes`` starts with ``full``). Prints Markdown. Acceptance per size
comes from ``bench/decode.py --draft-vocab full,auto``.
"""

from __future__ import annotations

import argparse

from polspec import backend

import mlx.core as mx

from polspec.decoding.draft_vocab import draft_head
from polspec.decoding.kv import new_cache, prefill, trim
from polspec.decoding.measure import median_times
from polspec.models.loader import load_model

CONTEXT = 64


def cached(loaded, positions: int) -> list:
    cache = new_cache(loaded.model, loaded.entry.alias)
    prefill(loaded.model, cache, list(range(1, CONTEXT + 1)))
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--drafts", default="gemma3-270m,smollm2-135m")
    parser.add_argument("--sizes", default="full,32768,16384,8192")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    info = backend.setup()
    print(f"MLX {info.mlx_version} on {info.device}, dtype {info.dtype}; target {args.target}, "
          f"median of {args.repeats} interleaved repeats, {CONTEXT} tokens cached\n")
    target = load_model(args.target)
    sizes = [int(s) if s.isdigit() else s for s in args.sizes.split(",")]
    print("| draft | vocabulary | kept tokens | draft step (ms) | c | vs full | 8-position step, all logits / last only |")
    print("|---|---|---|---|---|---|---|")
    one = mx.array([[7]])
    eight = mx.array([list(range(2, 10))])
    for alias in args.drafts.split(","):
        draft = load_model(alias)
        heads = [draft_head(draft, size) for size in sizes]
        forwards = [target.model, *heads, draft.model, heads[0]]
        inputs = [one] * (1 + len(heads)) + [eight, eight]
        caches = [cached(target, 1)] + [cached(draft, 1) for _ in heads] + [cached(draft, 8), cached(draft, 8)]
        undo = [lambda cache: trim(cache, 1)] * (1 + len(heads)) + [lambda cache: trim(cache, 8)] * 2
        times = median_times(forwards, inputs, caches, undo, args.repeats)
        step, drafts, (every, last) = times[0], times[1:1 + len(heads)], times[-2:]
        for size, head, seconds in zip(sizes, heads, drafts):
            print(f"| {alias} | {size} | {head.size or len(draft.tokenizer._tokenizer)} | {seconds * 1000:.1f} "
                  f"| {seconds / step:.3f} | {seconds / drafts[0]:.2f}x | {every * 1000:.0f} / {last * 1000:.0f} ms |",
                  flush=True)
        print(f"| {alias}: target step | | | {step * 1000:.1f} | | | |")


if __name__ == "__main__":
    main()
