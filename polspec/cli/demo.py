"""``polspec demo``: the main job end to end on the offline default, in one command."""

from __future__ import annotations

import click

DEMO_TARGET = "gemma3-270m"
DEMO_DATASET = "pl-wiki"


@click.command()
@click.option("--limit", default=8, show_default=True, type=click.IntRange(1), help="Prompts from the dataset.")
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(1), help="Tokens per prompt.")
@click.option("--batch", default=8, show_default=True, type=click.IntRange(2),
              help="Items the bulk worker decodes together.")
def demo(limit: int, max_tokens: int, batch: int) -> None:
    """Fetch the offline model, run a small bulk job batched and one at a time, compare.

    Queues the first --limit prompts of the built-in pl-wiki set for gemma3-270m twice: once
    for a worker that decodes --batch items together, once for a worker that decodes one at a
    time (what a plain generate loop does). Runs both, prints the aggregate tokens/s of each,
    measured side by side in this run over the time the workers decoded (model loading left
    out, as polspec status counts it), then the bulk job's results and where the database is.
    Starts a private redis-server when none is reachable
    at POLSPEC_REDIS_URL, and stops it afterwards. Refuses a running Redis whose gemma3-270m
    queue already holds jobs: the demo's workers would run them before its own.
    """
    from polspec.cli.progress import batch_bar, progress_bar
    from polspec.cli.results import list_command
    from polspec.decoding.params import DecodingParams
    from polspec.jobs.datasets import load_dataset
    from polspec.jobs.enqueue import enqueue_generate
    from polspec.jobs.local_redis import redis_available
    from polspec.jobs.spec import GenerateSpec
    from polspec.models.files import fetch_model
    from polspec.models.registry import load_registry
    from polspec.store.engine import display_url, make_engine
    from polspec.store.migrate import ensure_schema
    from polspec.store.queries import batch_progress, item_rows
    from polspec.worker.run import WorkerOptions, run_worker

    params = DecodingParams(max_tokens=max_tokens)
    prompts = load_dataset(DEMO_DATASET, params, limit)
    runs = {}
    with redis_available() as started:
        if started:
            click.echo("no Redis was running: started a private redis-server for this demo", err=True)
        _check_the_queue(started)
        with progress_bar(f"fetching {DEMO_TARGET}") as report:
            fetch_model(load_registry().model(DEMO_TARGET), report)
        ensure_schema()
        for size, name in ((batch, f"batched, {batch} at a time"), (1, "one at a time")):
            spec = GenerateSpec(DEMO_TARGET, None, params, None, f"dataset:{DEMO_DATASET}")
            queued = enqueue_generate(spec, prompts)
            click.echo(f"batch {queued.batch_id}: {queued.added} Polish prompts for {DEMO_TARGET}, "
                       f"decoded {name}", err=True)
            with batch_bar() as redraw:
                run_worker(WorkerOptions(queues=(DEMO_TARGET,), burst=True, batch=size, log_level="WARNING"),
                           on_job_end=redraw)
            runs[name] = queued.batch_id
    engine = make_engine()
    try:
        rates = {name: batch_progress(engine, batch_id)[0].aggregate_tokens_per_s for name, batch_id in runs.items()}
        texts = [[row["text"] for row in item_rows(engine, batch_id)] for batch_id in runs.values()]
    finally:
        engine.dispose()
    bulk, single = rates.values()
    click.echo("\naggregate throughput, same prompts, same weights, this run (model loading left out):")
    for name, rate in rates.items():
        click.echo(f"  {name:>22}: {rate or 0:6.1f} tokens/s")
    if bulk and single:
        click.echo(f"  batching is {bulk / single:.1f}x faster; "
                   f"{sum(a == b for a, b in zip(*texts))} of {len(texts[0])} texts are identical")
    bulk_batch = next(iter(runs.values()))
    click.get_current_context().invoke(list_command, batch_id=bulk_batch, status=None, limit=0, as_json=False)
    click.echo(f"results are in {display_url()}")
    click.echo("next:")
    for command, what in ((f"polspec results show {bulk_batch} wiki-001", "one item in full"),
                          (f"polspec results export {bulk_batch} --format csv --output wyniki.csv", "a spreadsheet"),
                          ("polspec status", "every batch"),
                          ("polspec generate --help", "speculative decoding")):
        click.echo(f"  {command:<62} # {what}")


def _check_the_queue(private: bool) -> None:
    """The demo's workers take every job on the target's queue. On the user's Redis those may be
    anyone's, hours of them: refused. On the demo's private one they are an interrupted demo's,
    which this run finishes first: said."""
    from polspec.errors import PolspecError
    from polspec.jobs.queue import connect, display_redis_url, make_queue, queue_name
    from polspec.settings import redis_url

    waiting = make_queue(connect(), queue_name(DEMO_TARGET)).count
    if waiting and private:
        click.echo(f"note: {waiting} job(s) of an earlier demo are still queued: its workers run them first", err=True)
    elif waiting:
        raise PolspecError(f"the {queue_name(DEMO_TARGET)} queue at {display_redis_url(redis_url())} holds {waiting} "
                           "job(s) already, which the demo's workers would run before its own: run the demo when "
                           "it is empty, or on another Redis database (POLSPEC_REDIS_URL=redis://127.0.0.1:6379/1)")
