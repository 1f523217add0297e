"""``polspec demo``: the main job end to end on the offline default, in one command."""

from __future__ import annotations

import click

DEMO_TARGET = "gemma3-270m"
DEMO_DRAFT = "smollm2-135m"
DEMO_DATASET = "pl-wiki"


@click.command()
@click.option("--limit", default=6, show_default=True, type=click.IntRange(1), help="Prompts from the dataset.")
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(1), help="Tokens per prompt.")
def demo(limit: int, max_tokens: int) -> None:
    """Fetch the offline models, queue Polish prompts, run a worker, show the results.

    Queues the first --limit prompts of the built-in pl-wiki set for gemma3-270m with the
    smollm2-135m draft (k=2, aligned translation), runs a burst worker with a progress
    bar, and prints the results and where the database is. Starts a private redis-server when
    none is reachable at POLSPEC_REDIS_URL, and stops it afterwards.
    """
    from polspec.cli.progress import batch_bar, progress_bar
    from polspec.cli.results import list_command
    from polspec.decoding.params import DecodingParams
    from polspec.jobs.datasets import load_dataset
    from polspec.jobs.enqueue import enqueue_generate
    from polspec.jobs.local_redis import redis_available
    from polspec.jobs.spec import GenerateSpec
    from polspec.models.loader import fetch_model
    from polspec.models.registry import load_registry
    from polspec.store.engine import display_url
    from polspec.store.migrate import ensure_schema
    from polspec.worker.run import WorkerOptions, run_worker

    registry = load_registry()
    for alias in (DEMO_TARGET, DEMO_DRAFT):
        with progress_bar(f"fetching {alias}") as report:
            fetch_model(registry.model(alias), report)
    ensure_schema()
    with redis_available() as started:
        if started:
            click.echo("no Redis was running: started a private redis-server for this demo", err=True)
        params = DecodingParams(max_tokens=max_tokens, k=2)
        spec = GenerateSpec(DEMO_TARGET, DEMO_DRAFT, params, None, f"dataset:{DEMO_DATASET}")
        done = enqueue_generate(spec, load_dataset(DEMO_DATASET, params, limit))
        click.echo(f"batch {done.batch_id}: {done.added} Polish prompts queued for {DEMO_TARGET} "
                   f"with the {DEMO_DRAFT} draft", err=True)
        with batch_bar() as redraw:
            run_worker(WorkerOptions(queues=(DEMO_TARGET,), burst=True, log_level="WARNING"), on_job_end=redraw)
    click.get_current_context().invoke(list_command, batch_id=done.batch_id, status=None, limit=0, as_json=False)
    click.echo(f"results are in {display_url()}")
    click.echo(f"next: polspec results show {done.batch_id} wiki-001 | polspec results export {done.batch_id} "
               "--format csv --output wyniki.csv | polspec status")
