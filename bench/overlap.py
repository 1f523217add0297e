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
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from polspec import backend

import mlx.core as mx

from polspec.decoding import DecodingParams, generate
from polspec.decoding.draft_vocab import draft_head
from polspec.decoding.kv import new_cache
from polspec.decoding.prompts import encode_prompt
from polspec.decoding.sampling import sampling_logprobs
from polspec.decoding.speculative_sampling import shared_draft
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
    args = parser.parse_args()
    info = backend.setup()
    print(info.summary)
    temperatures = [float(t) for t in args.draft_temperatures.split(",")]
    target, draft = load_model(args.target), load_model(args.draft)
    head = draft_head(draft, "auto")
    sampler = shared_draft(head, target, draft)
    params = DecodingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    overlaps: dict[float, list[float]] = {t: [] for t in temperatures}
    agree = []
    for seed, item in enumerate(load_dataset(args.dataset, DecodingParams(), args.prompts)):
        continuation = generate(target, None, item.prompt, dataclasses.replace(params, seed=seed), chat=False).token_ids
        prompt_ids = encode_prompt(target, item.prompt, chat=False)
        draft_prompt = encode_prompt(draft, item.prompt, chat=False)
        logits = target.model(mx.array([prompt_ids + continuation]))[0, len(prompt_ids) - 1:-1]
        p = mx.exp(sampling_logprobs(logits, params))
        width = p.shape[-1]
        for position in range(len(continuation)):
            text = target.tokenizer.decode(continuation[:position])
            if "\ufffd" in text:  # the prefix ends inside a character: the draft cannot read it
                continue
            ids = draft_prompt + (draft.tokenizer.encode(text, add_special_tokens=False) if text else [])
            draft_logits = mx.where(sampler.shared, head(mx.array([ids]), new_cache(draft.model, draft.entry.alias))[0],
                                    -mx.inf)
            for t in temperatures:
                q = sampler.in_target_space([mx.exp(sampling_logprobs(draft_logits, dataclasses.replace(params, temperature=t)))], width)[0]
                overlaps[t].append(mx.minimum(p[position], q).sum().item())
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


if __name__ == "__main__":
    main()
