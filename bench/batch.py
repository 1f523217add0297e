"""Batched decoding against one-at-a-time decoding and mlx-lm's batch_generate, in one process.

    .venv/bin/python bench/batch.py --target gemma3-270m --drafts smollm2-135m
    .venv/bin/python bench/batch.py --target qwen2.5-coder-1.5b --drafts gemma3-270m,smollm2-135m \\
        --prompts 8 --max-tokens 32 --batches 1,4,8
    .venv/bin/python bench/batch.py --target qwen2.5-coder-1.5b --drafts gemma3-270m --k auto \\
        --prompts 8 --max-tokens 32 --batches 1,8 --repeats 3 --no-mlx-lm

Every configuration decodes the same prompts (by default half `pl-wiki`, half `pl-struct`), greedy, raw
text, on the same loaded weights: polspec one prompt at a time (the single-sequence
decoder), polspec's batched decoder target-only and speculative at each batch size, and
mlx-lm's `batch_generate` at each batch size. Reports aggregate tokens/s of the whole run
(prefill included), the median per-sequence latency, peak memory, how many sequences differ
from one-at-a-time output (float ties of batched products; the tests show them; with
``--no-one-at-a-time``, from the first batched row's), and the
ratio to batched target-only decoding at the same B. With ``--repeats N`` the batched
configurations at each B run N times, interleaved, and each row is the median run (every
run's tokens/s in the last column): the way to tell a few percent from this machine's drift.
`auto` needs the pair's probe with its
batch table (measured first when missing); every run starts with no pooled acceptance
estimate, as a fresh process does. Prints Markdown; progress to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from polspec import backend

import mlx.core as mx
from mlx_lm import batch_generate

from polspec.decoding import DecodingParams, generate
from polspec.decoding.acceptance import forget_estimates
from polspec.decoding.batch import BatchDecoder
from polspec.decoding.run import stored_probe
from polspec.jobs.datasets import load_dataset
from polspec.models.loader import load_model


def bench_prompts(datasets: list[str], count: int) -> list[str]:
    """`count` prompts split evenly over `datasets`, the first ones taking the remainder."""
    sizes = [count // len(datasets) + (index < count % len(datasets)) for index in range(len(datasets))]
    return [item.prompt for name, size in zip(datasets, sizes) if size
            for item in load_dataset(name, DecodingParams(), size)]


def run_one_at_a_time(target, prompts, max_tokens):
    outputs, latencies = [], []
    mx.reset_peak_memory()
    start = time.perf_counter()
    for prompt in prompts:
        clock = time.perf_counter()
        outputs.append(generate(target, None, prompt, DecodingParams(max_tokens=max_tokens), chat=False).token_ids)
        latencies.append(time.perf_counter() - clock)
    return outputs, time.perf_counter() - start, latencies


def run_batched(target, draft, prompts, max_tokens, k, batch, probe):
    forget_estimates()  # every run starts as a fresh process would, knowing nothing of the pair's acceptance
    decoder = BatchDecoder(target, draft, max_batch=batch, probe=probe)
    for index, prompt in enumerate(prompts):
        decoder.add(index, prompt, DecodingParams(max_tokens=max_tokens, k=k), chat=False)
    outputs = [[] for _ in prompts]
    joined, latencies = {}, []
    accepted = candidates = 0
    mx.reset_peak_memory()
    start = time.perf_counter()
    while decoder:
        round_start = time.perf_counter()
        for event in decoder.step():
            joined.setdefault(event.key, round_start)  # it joined (was prefilled) in this round
            if event.commit:
                outputs[event.key] += event.commit.tokens
            if event.finished:
                latencies.append(time.perf_counter() - joined[event.key])
                accepted += event.metrics.candidates_accepted
                candidates += event.metrics.candidates
    return outputs, time.perf_counter() - start, latencies, accepted / candidates if candidates else None


def run_mlx_lm(target, prompts, max_tokens, batch):
    ids = [target.tokenizer.encode(prompt) for prompt in prompts]
    mx.reset_peak_memory()
    start = time.perf_counter()
    response = batch_generate(target.model, target.tokenizer, ids, max_tokens=max_tokens, return_token_ids=True,
                              completion_batch_size=batch, prefill_batch_size=batch)
    return response.token_ids, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="gemma3-270m")
    parser.add_argument("--drafts", default="smollm2-135m", help="Comma-separated; empty for target-only.")
    parser.add_argument("--k", default="1,2,auto")
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--datasets", default="pl-wiki,pl-struct", help="Comma-separated built-in sets.")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1,
                        help="Runs of every batched configuration, interleaved at each B (plain, then each "
                             "speculative one, then again); rows give the median run.")
    parser.add_argument("--no-mlx-lm", action="store_true", help="Leave out mlx-lm's rows (for a shorter run).")
    parser.add_argument("--no-one-at-a-time", action="store_true",
                        help="Leave out the one-at-a-time run (long for many prompts on a large target): the first "
                             "batched row is then what the others' speed and outputs are compared with.")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be 1 or more, got {args.repeats}")
    info = backend.setup()
    print(info.summary + "\n")
    target = load_model(args.target)
    datasets = args.datasets.split(",")
    prompts = bench_prompts(datasets, args.prompts)
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) if k.isdigit() else k for k in args.k.split(",")]
    drafts = {alias: load_model(alias) for alias in filter(None, args.drafts.split(","))}
    probes = {alias: stored_probe(target, draft, batched=True) if "auto" in ks else None
              for alias, draft in drafts.items()}
    print(f"Target {args.target}, {len(prompts)} prompts ({', '.join(datasets)}), {args.max_tokens} tokens, greedy"
          f"{f', median of {args.repeats} interleaved runs' if args.repeats > 1 else ''}:\n")
    print(f"| how | B | tokens/s | vs {'first row' if args.no_one_at_a_time else 'one at a time'} "
          "| vs batched plain at B | latency per sequence (median s) "
          "| peak GB | acceptance | differ | runs (tokens/s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    first: dict = {}  # the first row's outputs and tokens/s, which every row is compared with

    def row(how, batch, runs, plain=None):
        """One table row from ``runs`` of (outputs, wall, latencies, acceptance, peak bytes); the median run's figures."""
        rates = [sum(map(len, outputs)) / wall for outputs, wall, *_ in runs]
        outputs, _, latencies, acceptance, peak = runs[rates.index(statistics.median_low(rates))]
        rate = statistics.median(rates)
        first.setdefault("outputs", outputs)
        first.setdefault("rate", rate)
        differ = sum(a != b for a, b in zip(outputs, first["outputs"]))
        print(f"| {how} | {batch} | {rate:.2f} | {rate / first['rate']:.2f}x | {f'{rate / plain:.2f}x' if plain else '-'} "
              f"| {f'{statistics.median(latencies):.1f}' if latencies else '-'} | {peak / 1e9:.2f} "
              f"| {'-' if acceptance is None else f'{acceptance:.1%}'} | {differ} "
              f"| {', '.join(f'{r:.2f}' for r in rates) if len(rates) > 1 else '-'} |", flush=True)
        return rate

    if not args.no_one_at_a_time:
        print("one at a time ...", file=sys.stderr)
        reference, wall, latencies = run_one_at_a_time(target, prompts, args.max_tokens)
        row("polspec one at a time", 1, [(reference, wall, latencies, None, mx.get_peak_memory())])
    for batch in batches:
        runs: dict[str, list] = {}
        for repeat in range(args.repeats):
            print(f"B={batch}, run {repeat + 1} of {args.repeats}: plain ...", file=sys.stderr)
            runs.setdefault("plain", []).append(
                (*run_batched(target, None, prompts, args.max_tokens, 2, batch, None), mx.get_peak_memory()))
            if not args.no_mlx_lm:
                print(f"B={batch}: mlx-lm ...", file=sys.stderr)
                runs.setdefault("mlx-lm", []).append(
                    (*run_mlx_lm(target, prompts, args.max_tokens, batch), None, None, mx.get_peak_memory()))
            for alias, draft in drafts.items():
                for k in ks:
                    print(f"B={batch}: {alias} k={k} ...", file=sys.stderr)
                    runs.setdefault(f"{alias} k={k}", []).append(
                        (*run_batched(target, draft, prompts, args.max_tokens, k, batch, probes[alias]),
                         mx.get_peak_memory()))
        plain = row("polspec batched target-only", batch, runs.pop("plain"))
        if "mlx-lm" in runs:
            row("mlx-lm batch_generate", batch, runs.pop("mlx-lm"), plain)
        for how, speculative in runs.items():
            row(f"polspec batched, {how}", batch, speculative, plain)


if __name__ == "__main__":
    main()
