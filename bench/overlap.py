"""How much speculative sampling (TLI) can accept, position by position: the overlap sum min(p, q).

    .venv/bin/python bench/overlap.py --target qwen2.5-coder-1.5b --draft gemma3-270m --prompts 8

Speculative sampling accepts a candidate with probability sum_x min(p(x), q(x)), where p is the
target's sampling distribution and q the draft's over the shared vocabulary. This measures that
overlap directly, without the noise of accept/reject draws: the target samples a continuation
of each prompt alone (temperature ``--temperature``, seed = prompt index), then at every
position of it the target's p (teacher-forced) is set beside the draft's q, the draft reading
the same text in its own tokens (the prompt, then the continuation so far re-tokenized, as the
decoder's resync gives it). q is drawn at several draft temperatures (``--draft-temperatures``):
TLI stays lossless for any q, so the temperature of the draft is free to choose. Also reports
how often the draft's greedy token is the target's greedy token at the same positions (what
greedy speculation accepts per candidate, before translation). Prints Markdown.

``--string-level N`` also estimates what string-level verification (SLRS, Timor et al. 2025)
would accept at the first candidate: there the draft samples text, by any of its token paths,
and q(t) is the chance that the target's first token of that text is t (SmolLM2's `` p`` +
``od`` counts for Qwen2.5's `` pod``). q is estimated from N continuations of
``--string-steps`` draft tokens sampled at the target's temperature, each cut to the target's
first token of its text; TLI's q is sampled N times the same way, so both overlaps carry the
same small-sample bias, and TLI's exact overlap beside them shows its size.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics

from polspec import backend

import mlx.core as mx

from polspec.decoding import DecodingParams, generate
from polspec.decoding.draft_vocab import draft_head
from polspec.decoding.kv import new_cache, prefill
from polspec.decoding.prompts import encode_prompt
from polspec.decoding.sampling import draw_in_proportion, sampling_probabilities
from polspec.decoding.speculative_sampling import shared_draft
from polspec.decoding.translate import token_bytes
from polspec.jobs.datasets import load_dataset
from polspec.models.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="gemma3-270m")
    parser.add_argument("--draft", default="smollm2-135m")
    parser.add_argument("--dataset", default="pl-wiki")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--draft-temperatures", default="0.5,0.7,0.85,1.0,1.2,1.5")
    parser.add_argument("--string-level", type=int, default=0, metavar="N",
                        help="also estimate string-level verification's overlap from N draft samples a position")
    parser.add_argument("--string-steps", type=int, default=3, help="draft tokens in each sampled continuation")
    args = parser.parse_args()
    info = backend.setup()
    print(info.summary)
    temperatures = [float(t) for t in args.draft_temperatures.split(",")]
    target, draft = load_model(args.target), load_model(args.draft)
    head = draft_head(draft, "auto")
    sampler = shared_draft(head, target, draft)
    params = DecodingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    overlaps: dict[float, list[float]] = {t: [] for t in temperatures}
    agree, string_level, tli_sampled, tli_exact = [], [], [], []
    for seed, item in enumerate(load_dataset(args.dataset, DecodingParams(), args.prompts)):
        continuation = generate(target, None, item.prompt, dataclasses.replace(params, seed=seed), chat=False).token_ids
        prompt_ids = encode_prompt(target, item.prompt, chat=False)
        draft_prompt = encode_prompt(draft, item.prompt, chat=False)
        logits = target.model(mx.array([prompt_ids + continuation]))[0, len(prompt_ids) - 1:-1]
        p = sampling_probabilities(logits, params)
        width = p.shape[-1]
        for position in range(len(continuation)):
            text = target.tokenizer.decode(continuation[:position])
            if "\ufffd" in text:  # the prefix ends inside a character: the draft cannot read it
                continue
            ids = draft_prompt + (draft.tokenizer.encode(text, add_special_tokens=False) if text else [])
            draft_logits = mx.where(sampler.shared, head(mx.array([ids]), new_cache(draft.model, draft.entry.alias))[0],
                                    -mx.inf)
            for t in temperatures:
                q = sampler.in_target_space([sampling_probabilities(draft_logits, dataclasses.replace(params, temperature=t))], width)[0]
                overlaps[t].append(mx.minimum(p[position], q).sum().item())
            if args.string_level:
                key = mx.random.key(seed * 10_000 + position)
                q = sampler.in_target_space([sampling_probabilities(draft_logits, params)], width)
                tli_exact.append(mx.minimum(p[position], q[0]).sum().item())
                tli_sampled.append(sampled_overlap(p[position], mx.random.categorical(
                    mx.log(q), num_samples=args.string_level, key=key)[0].tolist()))
                string_level.append(sampled_overlap(p[position], first_target_tokens(
                    target, draft, head, ids, params, args.string_level, args.string_steps, key)))
            greedy = int(sampler.to_target[head.vocabulary_ids(mx.argmax(draft_logits)).item()])
            agree.append(greedy == int(mx.argmax(logits[position]).item()))
        print(f"prompt {seed}: {len(agree)} positions", flush=True)
    print(f"\nTarget {args.target} at temperature {args.temperature}, draft {args.draft}, {args.dataset}, "
          f"{args.prompts} prompts x {args.max_tokens} tokens, {len(agree)} positions:\n")
    print("| draft temperature | mean overlap sum min(p, q) | median |")
    print("|---|---|---|")
    for t in temperatures:
        print(f"| {t} | {statistics.mean(overlaps[t]):.3f} | {statistics.median(overlaps[t]):.3f} |")
    print(f"\nGreedy agreement (draft's argmax mapped = target's argmax): {statistics.mean(agree):.3f}")
    if args.string_level:
        print(f"\nFirst-candidate overlap at draft temperature {args.temperature}, {args.string_level} samples a "
              f"position: string-level {statistics.mean(string_level):.3f}, TLI {statistics.mean(tli_sampled):.3f} "
              f"(sampled the same way; exactly {statistics.mean(tli_exact):.3f}); string-level / TLI "
              f"{statistics.mean(string_level) / statistics.mean(tli_sampled):.2f}x")


def first_target_tokens(target, draft, head, ids: list[int], params: DecodingParams, samples: int, steps: int,
                        key: mx.array) -> list[int]:
    """The target's first token of each of ``samples`` continuations of ``steps`` draft tokens
    that the draft samples after ``ids`` (-1 where a continuation has no text the target can
    read, e.g. the draft's end of sequence)."""
    cache = new_cache(draft.model, draft.entry.alias)
    prefill(draft.model, cache, ids[:-1])
    logits = head(mx.array([ids[-1:]]), cache)
    for layer in cache:  # the same prefix for every sample
        layer.keys = mx.repeat(layer.keys[..., :layer.offset, :], samples, axis=0)
        layer.values = mx.repeat(layer.values[..., :layer.offset, :], samples, axis=0)
    logits = mx.repeat(logits, samples, axis=0)
    drawn = []
    for step, step_key in enumerate(mx.random.split(key, steps)):
        token = draw_in_proportion(sampling_probabilities(logits, params), step_key)
        drawn.append(head.vocabulary_ids(token))
        if step < steps - 1:
            logits = head(token[:, None], cache)
    raw = token_bytes(draft.tokenizer._tokenizer).raw
    texts = []
    for row in mx.stack(drawn, axis=1).tolist():
        text = b""
        for token in row:
            if raw[token] is None:
                break
            text += raw[token]
        texts.append(text.decode("utf-8", errors="ignore"))
    encoded = target.tokenizer._tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [tokens[0] if tokens else -1 for tokens in encoded]


def sampled_overlap(p: mx.array, tokens: list[int]) -> float:
    """sum_t min(p(t), q(t)) with q the share of ``tokens`` that are t."""
    counts = collections.Counter(token for token in tokens if token >= 0)
    return sum(min(p[token].item(), count / len(tokens)) for token, count in counts.items())


if __name__ == "__main__":
    main()
