"""Speculative decoding against target-only decoding, side by side in one run.

    .venv/bin/python bench/decode.py --target gemma3-270m --drafts smollm2-135m --prompts 5
    .venv/bin/python bench/decode.py --fidelity          # the oracle fidelity table only

For each draft, strategy and k, every prompt is decoded target-only and speculatively in
turn (so machine drift hits both), greedy, and the report gives the median and spread over
prompts of the tokens/s ratio, with acceptance, committed tokens per round and translation
overhead as a fraction of the target's verification time. Prints Markdown.
"""

from __future__ import annotations

import argparse
import statistics
from itertools import product
from collections.abc import Iterator

from polspec import backend

from polspec.decoding import DecodingParams, generate
from polspec.decoding.draft_vocab import polish_texts
from polspec.decoding.fidelity import Fidelity, oracle_fidelity
from polspec.decoding.translate import STRATEGIES
from polspec.jobs.datasets import load_dataset
from polspec.models.loader import load_model
from polspec.models.tokenizers import load_tokenizer
from polspec.report.summary import mean_interval

FIDELITY_PAIRS = [
    ("gemma3-270m", "smollm2-135m"), ("gemma3-270m", "qwen2.5-coder-1.5b"),
    ("tok:mistral-32k", "qwen2.5-coder-1.5b"), ("tok:mistral-32k", "tok:llama3"),
    ("tok:mistral-32k", "smollm2-135m"), ("tok:mistral-32k", "gemma3-270m"),
    ("qwen2.5-coder-1.5b", "smollm2-135m"), ("qwen2.5-coder-1.5b", "gemma3-270m"),
]



def fidelity_table(ks: list[int]) -> str:
    """Oracle fidelity per pair, k and strategy: candidates accepted / tokens per round."""
    texts = polish_texts()
    tokenizers = {alias: load_tokenizer(alias) for pair in FIDELITY_PAIRS for alias in pair}
    strategies = ["naive", "context", "aligned/hold", "aligned"]
    lines = ["| target | draft | k | " + " | ".join(strategies) + " |", "|---|---|---|" + "---|" * len(strategies)]
    for target, draft in FIDELITY_PAIRS:
        for k in ks:
            cells = []
            for name in strategies:
                strategy, partial_word = translation(name)
                total = sum((oracle_fidelity(tokenizers[target], tokenizers[draft], text, k, strategy,
                                             partial_word=partial_word) for text in texts),
                            Fidelity(0, 0, 0, 0))
                cells.append(f"{total.acceptance:.1%} / {total.tokens_per_round:.2f}")
            lines.append(f"| {target} | {draft} | {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def translation(name: str) -> tuple[str, str]:
    """Strategy and partial-word mode of a column name: ``aligned/hold`` or a plain strategy (``verify``)."""
    strategy, _, partial_word = name.partition("/")
    return strategy, partial_word or "verify"


def prompts(count: int, dataset: str | None) -> list[str]:
    """The first ``count`` prompts of a dataset, or openings of the built-in Polish texts (eight words each)."""
    if dataset:
        return [item.prompt for item in load_dataset(dataset, DecodingParams(), count)]
    return [" ".join(text.split()[:8]) for text in polish_texts()[:count]]


def speed_table(target_alias: str, drafts: list[str], strategies: list[str], ks: list, prompt_list: list[str],
                max_tokens: int, vocabs: list) -> Iterator[str]:
    """The speed table's lines, each row as soon as its configuration has run."""
    target = load_model(target_alias)
    yield ("| draft | vocab | strategy | k | speed vs target-only (median, min-max) | mean [95% interval] "
           "| accepted / candidate "
           "| accepted / draft token | tokens / round | translate / verify | draft / verify |")
    yield "|---|---|---|---|---|---|---|---|---|---|---|"
    for draft_alias in drafts:
        draft = load_model(draft_alias)
        for (vocab, name, k) in product(vocabs, strategies, ks):
            strategy, partial_word = translation(name)
            params = {"strategy": strategy, "partial_word": partial_word, "draft_vocab": vocab}
            ratios, metrics = [], []
            for prompt in prompt_list:
                base = generate(target, None, prompt, DecodingParams(max_tokens=max_tokens), chat=False)
                spec = generate(target, draft, prompt, DecodingParams(max_tokens=max_tokens, k=k, **params), chat=False)
                assert spec.token_ids == base.token_ids, f"not lossless on {prompt!r}"
                ratios.append(spec.metrics.decode_tokens_per_s / base.metrics.decode_tokens_per_s)
                metrics.append(spec.metrics)
            per_candidate = sum(m.candidates_accepted for m in metrics) / max(1, sum(m.candidates for m in metrics))
            per_draft = sum(m.draft_tokens_accepted for m in metrics) / max(1, sum(m.draft_tokens for m in metrics))
            per_round = sum(m.generated_tokens for m in metrics) / sum(m.rounds for m in metrics)
            overhead = sum(m.translate_s for m in metrics) / sum(m.verify_s for m in metrics)
            drafting = sum(m.draft_s for m in metrics) / sum(m.verify_s for m in metrics)
            size = metrics[0].draft_vocab or "full"
            mean, low, high = mean_interval(ratios)
            interval = f" [{low:.2f}-{high:.2f}]" if low is not None else ""
            yield (
                f"| {draft_alias} | {size} | {name} | {k} | {statistics.median(ratios):.2f}x "
                f"({min(ratios):.2f}-{max(ratios):.2f}) | {mean:.2f}x{interval} | {per_candidate:.1%} | {per_draft:.1%} | {per_round:.2f} "
                f"| {overhead:.1%} | {drafting:.2f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="gemma3-270m")
    parser.add_argument("--drafts", default="smollm2-135m")
    parser.add_argument("--strategies", default="naive,context,aligned/hold,aligned",
                        help="Comma-separated; aligned/hold is aligned with partial_word=hold.")
    parser.add_argument("--k", default="1,2,3,4,heuristic,confidence")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--dataset", help="Take the prompts from a built-in set (pl-wiki, pl-struct, ...) "
                                          "instead of the openings of the built-in Polish texts.")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--draft-vocab", default="auto",
                        help="Comma-separated draft vocabularies: auto, full or a number of tokens.")
    parser.add_argument("--fidelity", action="store_true", help="Only the oracle fidelity table.")
    parser.add_argument("--no-fidelity", action="store_true", help="Only the speed table.")
    args = parser.parse_args()
    info = backend.setup()
    print(info.summary + "\n")
    if not args.no_fidelity:
        print("Oracle fidelity (candidates accepted / committed tokens per round):\n")
        print(fidelity_table([2, 4]))
    if args.fidelity:
        return
    ks = [int(k) if k.isdigit() else k for k in args.k.split(",")]
    strategies = [s for s in args.strategies.split(",") if translation(s)[0] in STRATEGIES]
    source = f"the first of {args.dataset}" if args.dataset else "openings of the built-in texts"
    print(f"\nTarget {args.target}, greedy, {args.max_tokens} tokens, {args.prompts} prompts ({source}):\n")
    vocabs = [int(v) if v.isdigit() else v for v in args.draft_vocab.split(",")]
    for line in speed_table(args.target, args.drafts.split(","), strategies, ks, prompts(args.prompts, args.dataset),
                            args.max_tokens, vocabs):
        print(line, flush=True)


if __name__ == "__main__":
    main()
