"""Several processes decoding on one Linux CPU at once: every process's OpenBLAS on a thread per
core (as before ``polspec.cpu_share``) against the cores shared among them, and one process alone.

    .venv/bin/python bench/cpu_share.py --markdown          # about 4 minutes on a 2-core VM

Each process loads the model, waits until all have loaded, then decodes the same prompts
target-only and greedy: one sequence at a time, then the same prompts as one batch. "Each its
own threads" sets ``OPENBLAS_NUM_THREADS`` to the cores OpenBLAS starts with (which polspec
leaves alone: what every process ran before it shared the cores); "shared" sets nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from polspec import backend
from polspec.settings import BLAS_THREAD_VARIABLES

PROMPTS = ["Kraków jest miastem", "Wisła płynie przez", "Polska kuchnia słynie z", "Najdłuższa polska rzeka to"]


def decode(model: str, max_tokens: int) -> None:
    """One process's part: load, say so, wait for the go, decode both ways, print the times."""
    backend.setup()
    from polspec.decoding.batch import stream_batch
    from polspec.decoding.params import DecodingParams
    from polspec.decoding.run import generate
    from polspec.models.loader import load_model

    loaded = load_model(model)
    params = DecodingParams(max_tokens=max_tokens)
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.perf_counter()
    tokens = sum(len(generate(loaded, None, prompt, params).token_ids) for prompt in PROMPTS)
    one_at_a_time = time.perf_counter() - started
    started = time.perf_counter()
    batched = sum(len(event.commit.tokens) for event in stream_batch(loaded, None, [(p, params) for p in PROMPTS],
                                                                     max_batch=len(PROMPTS)) if event.commit)
    print(json.dumps({"one_at_a_time_s": one_at_a_time, "batched_s": time.perf_counter() - started,
                      "tokens": tokens, "batched_tokens": batched, "threads": backend.blas_threads()}), flush=True)


def run(processes: int, model: str, max_tokens: int, threads: int | None) -> list[dict]:
    """Start ``processes`` decoders together; the results each printed."""
    env = {key: value for key, value in os.environ.items() if key not in BLAS_THREAD_VARIABLES}
    if threads is not None:
        env["OPENBLAS_NUM_THREADS"] = str(threads)
    children = [subprocess.Popen([sys.executable, __file__, "--decode", "--model", model, "--max-tokens",
                                  str(max_tokens)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env=env) for _ in range(processes)]
    for child in children:
        assert child.stdout.readline().strip() == "ready"
    for child in children:
        child.stdin.write("go\n")
        child.stdin.flush()
    results = [json.loads(child.stdout.readline()) for child in children]
    for child in children:
        assert child.wait() == 0
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--decode", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.decode:
        decode(args.model, args.max_tokens)
        return
    cores = backend.blas_threads()
    if cores is None:
        sys.exit("no BLAS fix here (macOS, POLSPEC_BLAS=off): polspec leaves the BLAS's threads alone")
    rows = [("one process alone", 1, None),
            (f"{args.processes} at once, each its own {cores} threads", args.processes, cores),
            (f"{args.processes} at once, shared", args.processes, None)]
    table = []
    for name, processes, threads in rows:
        results = run(processes, args.model, args.max_tokens, threads)
        tokens = sum(r["tokens"] for r in results)
        single = statistics.median(r["one_at_a_time_s"] for r in results)
        batched = statistics.median(r["batched_s"] for r in results)
        table.append((name, single, tokens / max(r["one_at_a_time_s"] for r in results), batched,
                      sum(r["batched_tokens"] for r in results) / max(r["batched_s"] for r in results),
                      sorted({r["threads"] for r in results})))
    header = ("| processes | one at a time: s a process (median) | machine tok/s | batch of 4: s a process (median) "
              "| machine tok/s | BLAS threads of each process at its end |")
    if args.markdown:
        print(header)
        print("|---|---|---|---|---|---|")
    for name, single, single_rate, batched, batched_rate, threads in table:
        line = (f"| {name} | {single:.1f} | {single_rate:.1f} | {batched:.1f} | {batched_rate:.1f} | "
                f"{', '.join(map(str, threads))} |")
        print(line if args.markdown else line.strip("| ").replace(" | ", "  "))


if __name__ == "__main__":
    main()
