"""What the queue and the resident worker cost, on a private redis-server and a fresh SQLite.

    .venv/bin/python bench/jobs.py --markdown                 # 10,000 items; 30 items of 16 tokens
    .venv/bin/python bench/jobs.py --items 1000 --jobs 10     # a quick look
    .venv/bin/python bench/jobs.py --markdown --batches 1,4,8 --batch-jobs 16 --batch-tokens 32

1. Enqueueing: ``--items`` prompts through the same path as ``polspec enqueue generate``
   (validation, one database transaction, RQ jobs in pipelines), timed per phase, and the
   memory Redis holds for them.
2. Worker overhead: ``--jobs`` items on the smallest model (smollm2-135m, target-only,
   ``--tokens`` tokens each) through a burst worker. For every job after the first (which
   loads the model) the wall time between job ends is compared with the generation time the
   worker measured around the decoder; the difference is what the queue, the database writes
   and the heartbeat thread cost per item.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file is named queue.py as the issue asks, which would shadow the standard library's
# queue module (redis-py imports it) while this directory is first on the path.
HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != HERE]

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from polspec import backend  # noqa: E402,F401  (before mlx: the Linux BLAS fix)

import redis
from sqlalchemy import select

from polspec.decoding import generate, stream_batch
from polspec.decoding.params import DecodingParams
from polspec.jobs.datasets import load_dataset
from polspec.jobs.enqueue import enqueue_generate
from polspec.jobs.local_redis import redis_available
from polspec.jobs.spec import GenerateSpec, ItemInput, check_models
from polspec.models.loader import load_model
from polspec.store.engine import make_engine, session_scope
from polspec.store.schema import Item, Result
from polspec.worker.run import WorkerOptions, run_worker

MODEL = "smollm2-135m"


def machine_description() -> dict[str, str]:
    """The machine table of bench/backend.py."""
    spec = importlib.util.spec_from_file_location("bench_backend", HERE / "backend.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.machine_description()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def synthetic_items(count: int) -> list[ItemInput]:
    """``count`` prompts cycled from the built-in sets, each with its own id."""
    pool = [item.prompt for name in ("pl-wiki", "pl-instruct", "pl-short")
            for item in load_dataset(name, DecodingParams())]
    return [ItemInput(f"p{index:06d}", pool[index % len(pool)]) for index in range(count)]


def bench_enqueue(count: int, url: str) -> dict:
    connection = redis.Redis.from_url(url)
    before = connection.info("memory")["used_memory"]
    spec = GenerateSpec(MODEL, None, DecodingParams(max_tokens=16), False, "bench")
    start = time.perf_counter()
    items = synthetic_items(count)
    check_models(spec, items)
    built = time.perf_counter()
    done = enqueue_generate(spec, items, queue_url=url)
    end = time.perf_counter()
    used = connection.info("memory")["used_memory"] - before
    assert done.added == count
    return {"items": count, "prepare_s": built - start, "enqueue_s": end - built, "total_s": end - start,
            "items_per_s": count / (end - start), "redis_bytes": used, "redis_bytes_per_item": used / count}


def bench_worker(jobs: int, tokens: int, url: str) -> dict:
    spec = GenerateSpec(MODEL, None, DecodingParams(max_tokens=tokens), False, "bench")
    items = [ItemInput(f"w{index:04d}", item.prompt)
             for index, item in enumerate(synthetic_items(jobs))]
    enqueue_generate(spec, items, queue_url=url)
    ends: list[float] = []
    run_worker(WorkerOptions(queues=(MODEL,), burst=True, batch=1, log_level="WARNING"),
               on_job_end=lambda: ends.append(time.perf_counter()), redis_url=url)
    engine = make_engine()
    with session_scope(engine) as session:
        rows = session.execute(select(Item.item_key, Result.timings, Result.generated_tokens)
                               .join(Result, Result.item_id == Item.id).where(Item.item_key.like("w%"))
                               .order_by(Item.finished_at)).all()
    engine.dispose()
    assert len(rows) == jobs == len(ends), (len(rows), jobs, len(ends))
    walls = [later - earlier for earlier, later in zip(ends, ends[1:], strict=False)]
    generations = [row.timings["generation_s"] for row in rows[1:]]
    overheads = [wall - generation for wall, generation in zip(walls, generations, strict=True)]
    return {"jobs": jobs, "tokens": tokens, "median_generation_s": statistics.median(generations),
            "median_overhead_s": statistics.median(overheads),
            "overhead_fraction": sum(overheads) / sum(generations),
            "median_overhead_fraction": statistics.median(o / g for o, g in zip(overheads, generations, strict=True))}


def bench_batched_worker(jobs: int, tokens: int, batches: list[int], url: str, scratch: Path) -> list[dict]:
    model = "gemma3-270m"
    params = DecodingParams(max_tokens=tokens)
    spec = GenerateSpec(model, None, params, False, "bench")
    prompts = [item.prompt for item in synthetic_items(jobs)]
    target = load_model(model)
    rows = []
    for batch in batches:
        start = time.perf_counter()
        if batch == 1:
            library = sum(len(generate(target, None, prompt, params, chat=False).token_ids) for prompt in prompts)
        else:
            library = sum(len(event.commit.tokens) for event in stream_batch(
                target, None, [(prompt, params) for prompt in prompts], max_batch=batch, chat=False) if event.commit)
        library_s = time.perf_counter() - start
        redis.Redis.from_url(url).flushall()
        os.environ["POLSPEC_DB_URL"] = f"sqlite:///{scratch / f'batch{batch}.db'}"
        enqueue_generate(spec, [ItemInput(f"b{index:04d}", prompt) for index, prompt in enumerate(prompts)],
                         queue_url=url)
        start = time.perf_counter()
        run_worker(WorkerOptions(queues=(model,), burst=True, batch=batch, log_level="WARNING"), redis_url=url)
        worker_s = time.perf_counter() - start
        engine = make_engine()
        with session_scope(engine) as session:
            results = session.execute(select(Result.generated_tokens, Result.timings, Result.batch_size)).all()
        engine.dispose()
        assert len(results) == jobs, (len(results), jobs)
        load_s = sum(row.timings["model_load_s"] for row in results)
        generated = sum(row.generated_tokens for row in results)
        assert generated == library, (generated, library)
        overhead = worker_s - load_s - library_s
        rows.append({"batch": batch, "jobs": jobs, "tokens": tokens, "worker_s": worker_s, "load_s": load_s,
                     "library_s": library_s, "tokens_per_s": generated / worker_s,
                     "mean_batch": statistics.fmean(row.batch_size for row in results),
                     "overhead_per_item_s": overhead / jobs, "overhead_fraction": overhead / library_s})
        print(f"batched worker B={batch}: {rows[-1]}", file=sys.stderr)
    return rows


def markdown(machine: dict, enqueue: dict, worker: dict, batched: list[dict]) -> str:
    lines = ["| machine | |", "|---|---|", *(f"| {key} | {value} |" for key, value in machine.items()), "",
             "### Enqueueing", "",
             "| items | prepare (validate) | database + Redis | total | items/s | Redis memory | per item |",
             "|---|---|---|---|---|---|---|",
             f"| {enqueue['items']:,} | {enqueue['prepare_s']:.2f} s | {enqueue['enqueue_s']:.2f} s | "
             f"{enqueue['total_s']:.2f} s | {enqueue['items_per_s']:,.0f} | {enqueue['redis_bytes'] / 1e6:.1f} MB | "
             f"{enqueue['redis_bytes_per_item']:,.0f} B |", "",
             "### Worker overhead per item", "",
             "| jobs | tokens | median generation | median overhead | overhead / generation (sum) | (median) |",
             "|---|---|---|---|---|---|",
             f"| {worker['jobs']} | {worker['tokens']} | {worker['median_generation_s'] * 1e3:.0f} ms | "
             f"{worker['median_overhead_s'] * 1e3:.1f} ms | {worker['overhead_fraction']:.2%} | "
             f"{worker['median_overhead_fraction']:.2%} |"]
    if batched:
        single = batched[0]["tokens_per_s"]
        lines += ["", "### The batched worker", "",
                  "| B | items x tokens | worker wall (incl. load) | model load | library alone | aggregate tok/s "
                  "| vs first row | mean batch | overhead per item | overhead / library time |",
                  "|---|---|---|---|---|---|---|---|---|---|",
                  *(f"| {row['batch']} | {row['jobs']} x {row['tokens']} | {row['worker_s']:.1f} s | {row['load_s']:.1f} s "
                    f"| {row['library_s']:.1f} s | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / single:.2f}x "
                    f"| {row['mean_batch']:.1f} | {row['overhead_per_item_s'] * 1e3:.0f} ms | {row['overhead_fraction']:.1%} |"
                    for row in batched)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--batches", default="", help="Batch sizes for the batched worker, e.g. 1,4,8 (default: skip).")
    parser.add_argument("--batch-jobs", type=int, default=16)
    parser.add_argument("--batch-tokens", type=int, default=32)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        # The real model cache stays where it is; the database and Redis data are private (a
        # server started on the cache's Redis data would load every queue left there).
        url = f"redis://127.0.0.1:{free_port()}/0"
        with redis_available(url, data=Path(scratch) / "redis"):
            os.environ["POLSPEC_DB_URL"] = f"sqlite:///{Path(scratch) / 'enqueue.db'}"
            enqueue = bench_enqueue(args.items, url)
            # A fresh database and queue: the worker would otherwise (rightly) recover and run
            # the items enqueued above.
            redis.Redis.from_url(url).flushall()
            os.environ["POLSPEC_DB_URL"] = f"sqlite:///{Path(scratch) / 'worker.db'}"
            worker = bench_worker(args.jobs, args.tokens, url)
            batches = [int(size) for size in args.batches.split(",") if size]
            batched = bench_batched_worker(args.batch_jobs, args.batch_tokens, batches, url, Path(scratch))
    if args.markdown:
        print(markdown(machine_description(), enqueue, worker, batched))
    else:
        print(json.dumps({"machine": machine_description(), "enqueue": enqueue, "worker": worker,
                          "batched_worker": batched}, indent=1))


if __name__ == "__main__":
    main()
