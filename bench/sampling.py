"""Speculation when sampling: exact match against speculative sampling (TLI), side by side in one run.

    .venv/bin/python bench/sampling.py --target gemma3-270m --drafts smollm2-135m --prompts 4
    .venv/bin/python bench/sampling.py --target qwen2.5-coder-1.5b --drafts gemma3-270m,smollm2-135m \\
        --datasets pl-wiki,pl-instruct,pl-struct --prompts 4 --max-tokens 24

For each draft and dataset, every prompt is decoded as raw text (as bench/decode.py does), in turn (so machine drift hits all alike):
target-only sampling, speculative with exact-match verification and with speculative sampling
(the same seed, temperature and k), and greedy speculative for the pair's greedy acceptance.
Reports per configuration the tokens/s ratio against target-only sampling (median with
min-max, and the mean with its 95% interval over prompts), acceptance per draft token, and
how it compares to the greedy acceptance of the same pair and prompts (with a 95% bootstrap
interval over prompts: acceptance is pooled over a set's prompts, so the prompts are what
varies). Prints Markdown.
"""

from __future__ import annotations

import argparse
import random
import statistics

from polspec import backend

from polspec.decoding import DecodingParams, generate
from polspec.decoding.metrics import DecodeMetrics
from polspec.decoding.speculative_sampling import polish_coverage
from polspec.jobs.datasets import load_dataset
from polspec.models.loader import load_model
from polspec.report.summary import mean_interval


def acceptance(metrics: list[DecodeMetrics]) -> float:
    return sum(m.draft_tokens_accepted for m in metrics) / max(1, sum(m.draft_tokens for m in metrics))


def ratio_interval(sampled: list[DecodeMetrics], greedy: list[DecodeMetrics], resamples: int = 2000
                   ) -> tuple[float, float]:
    """95% bootstrap interval of acceptance(sampled) / acceptance(greedy), prompts resampled
    together (entry i of both lists is prompt i)."""
    rng = random.Random(0)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(len(sampled)) for _ in sampled]
        greedy_acceptance = acceptance([greedy[i] for i in picks])
        if greedy_acceptance > 0:
            ratios.append(acceptance([sampled[i] for i in picks]) / greedy_acceptance)
    cuts = statistics.quantiles(ratios, n=40)
    return cuts[0], cuts[-1]


def speed(ratios: list[float]) -> str:
    mean, low, high = mean_interval(ratios)
    interval = f" [{low:.2f}-{high:.2f}]" if low is not None else ""
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | {mean:.2f}x{interval}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="gemma3-270m")
    parser.add_argument("--drafts", default="smollm2-135m")
    parser.add_argument("--datasets", default="pl-wiki")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--k", default="2")
    args = parser.parse_args()
    info = backend.setup()
    k = int(args.k) if args.k.isdigit() else args.k
    print(info.summary)
    print(f"\nTarget {args.target}, temperature {args.temperature}, k={k}, {args.max_tokens} tokens, "
          f"{args.prompts} prompts per dataset, seeds 0..{args.prompts - 1}:\n")
    print("| draft | dataset | verify | speed vs target-only sampling (median, min-max) | mean [95% interval] "
          "| accepted / draft token | vs greedy acceptance [95% interval] |")
    print("|---|---|---|---|---|---|---|")
    target = load_model(args.target)
    coverage = {}
    for draft_alias in args.drafts.split(","):
        draft = load_model(draft_alias)
        coverage[draft_alias] = polish_coverage(target, draft)
        for dataset in args.datasets.split(","):
            items = load_dataset(dataset, DecodingParams(), args.prompts)
            ratios: dict[str, list[float]] = {"exact": [], "tli": []}
            metrics: dict[str, list[DecodeMetrics]] = {"exact": [], "tli": [], "greedy": []}
            for seed, item in enumerate(items):
                prompt = item.prompt
                sampled = DecodingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=seed, k=k)
                base = generate(target, None, prompt, sampled, chat=False)
                for verify in ("exact", "tli"):
                    spec = generate(target, draft, prompt, DecodingParams(**{**sampled.as_dict(), "verify": verify}), chat=False)
                    ratios[verify].append(spec.metrics.decode_tokens_per_s / base.metrics.decode_tokens_per_s)
                    metrics[verify].append(spec.metrics)
                greedy = generate(target, draft, prompt, DecodingParams(max_tokens=args.max_tokens, k=k), chat=False)
                metrics["greedy"].append(greedy.metrics)
            greedy_acceptance = acceptance(metrics["greedy"])
            for verify in ("exact", "tli"):
                accepted = acceptance(metrics[verify])
                low, high = ratio_interval(metrics[verify], metrics["greedy"])
                print(f"| {draft_alias} | {dataset} | {verify} | {speed(ratios[verify])} | {accepted:.1%} "
                      f"| {accepted / greedy_acceptance:.2f}x [{low:.2f}-{high:.2f}] of {greedy_acceptance:.1%} |",
                      flush=True)
    print()
    for draft_alias, share in coverage.items():
        print(f"- {draft_alias} can propose {share:.1%} of {args.target}'s tokens on Polish text under TLI")


if __name__ == "__main__":
    main()
