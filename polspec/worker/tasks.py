"""The RQ job function: generate one item and store its result.

``run_item`` is the only function polspec enqueues (the worker refuses any other). It claims
the item in the database (see :mod:`polspec.store.items`), runs the decoder library on the
worker's resident models, and writes the result and the item's status in one transaction.

Failures are sorted by whether trying again can help. A :class:`PolspecError` (the prompt is
too long for the model, a model cannot load) fails the item at once with its one-line reason
and the job ends normally: retrying would fail the same way. The database failing
(:class:`DatabaseFailure`) as the item is claimed is raised again untouched, so that RQ
retries the job; failing as its result is stored, the result waits in the worker until the
database answers (:func:`store_result`): the decoding was the costly part. Anything else (out
of memory, the job timeout) is recorded on the item and raised again so that RQ retries the
job; on the last attempt the item is marked failed with the reason.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import signal
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import mlx.core as mx
import redis
from rq import get_current_job

from polspec import __version__
from polspec.backend import setup as backend_setup
from polspec.decoding.costmodel import Probe
from polspec.decoding.metrics import DecodeMetrics
from polspec.decoding.params import DecodingParams
from polspec.decoding.probe_files import load_probe
from polspec.decoding.run import GenerationResult, generate, stored_probe
from polspec.errors import DatabaseFailure, PolspecError
from polspec.jobs.spec import GenerateSpec
from polspec.models.loader import LoadedModel
from polspec.store.engine import display_url
from polspec.store.items import Claim, cancelled_items, claim_item, fail_item, finish_item
from polspec.store.schema import Result, Status
from polspec.worker import FIRST_PAUSE_S, WAIT_MAX_S, context
from polspec.worker.energy import EnergyReading, measure_energy

PROGRESS_INTERVAL_S = 1.0
T = TypeVar("T")
log = logging.getLogger("polspec.worker")


class Cancelled(Exception):
    """The item's batch was cancelled while it ran."""


def run_item(database_id: str, item_id: int) -> dict[str, Any]:
    """Generate item ``item_id`` of database ``database_id``; returns a short summary for RQ."""
    ctx = context.current()
    if database_id != ctx.database_id:
        # The user's setup, not the item, is wrong: one line says so (a failed job's traceback
        # would bury it), and the item stays queued in its own database for `polspec recover`.
        reason = (f"job for database {database_id}, but this worker writes to {display_url(ctx.engine.url)} "
                  f"(database {ctx.database_id}): run the worker with the enqueuer's POLSPEC_DB_URL")
        log.error("skipped item %d: %s", item_id, reason)
        return {"item": item_id, "skipped": reason}
    claim = claim_item(ctx.engine, item_id, ctx.me, ctx.lease_s)
    if isinstance(claim, str):
        return {"item": item_id, "skipped": claim}
    ctx.current_items.add(item_id)
    try:
        result = _generate(ctx, claim)
        # Inside: a result the database refuses (not one it fails to take) fails the item like
        # an error of its own, with the reason, rather than leave it running after RQ's retries.
        stored = store_result(ctx, item_id, result)
    except Cancelled:
        fail_item(ctx.engine, item_id, ctx.me, "cancelled while running", final=True, status=Status.CANCELLED)
        return {"item": item_id, "cancelled": True}
    except DatabaseFailure:
        raise  # the database's fault, not the item's: RQ tries the job again
    except PolspecError as error:
        fail_item(ctx.engine, item_id, ctx.me, str(error), final=True)
        return {"item": item_id, "failed": str(error)}
    except Exception as error:
        job = get_current_job()
        final = job is None or not job.retries_left
        fail_item(ctx.engine, item_id, ctx.me, f"{type(error).__name__}: {error}", final=final)
        raise
    finally:
        ctx.current_items.discard(item_id)
        mx.clear_cache()
    return {"item": item_id, "stored": stored, "tokens": result.generated_tokens}


def store_result(ctx: context.WorkerContext, item_id: int, result: Result) -> bool:
    """Store a finished item's result (:func:`~polspec.store.items.finish_item`), waiting for
    the database as long as it takes (:func:`when_the_database_answers`): the result is kept,
    not decoded again. Returns whether the item has it (False: another worker claimed the item
    while the database was away)."""
    return when_the_database_answers(lambda: finish_item(ctx.engine, item_id, ctx.me, result),
                                     f"the result of item {item_id}")


def when_the_database_answers(write: Callable[[], T], what: str) -> T:
    """``write()``, tried again with a growing pause while the database fails (a restart, SQLite
    locked past its busy timeout by a long writer) for as long as it takes; ``what`` names what
    it records, for the log. Only a forced stop (a second Ctrl+C) gives it up. RQ's job timeout
    bounds the decoding, not this wait, and is switched off first: it would end the wait and
    lose what was decoded (a write that waits on a busy SQLite past it was rolled back, and the
    item failed on its last try)."""
    if threading.current_thread() is threading.main_thread():
        signal.alarm(0)  # RQ's UnixSignalDeathPenalty: its alarm, where a job runs alone
    pause = FIRST_PAUSE_S
    while True:
        try:
            answer = write()
        except DatabaseFailure as error:
            if pause == FIRST_PAUSE_S:
                log.warning("the database failed (%s): %s waits in this worker until it answers", error, what)
            time.sleep(pause)
            pause = min(pause * 2, WAIT_MAX_S)
            continue
        if pause != FIRST_PAUSE_S:
            log.warning("the database answers again: %s is recorded", what)
        return answer


def known_cancelled(ctx: context.WorkerContext, item_ids: list[int]) -> set[int]:
    """Which of these items are cancelled (:func:`~polspec.store.items.cancelled_items`); none
    while the database fails: decoding goes on, and a cancel is seen once it answers."""
    try:
        return cancelled_items(ctx.engine, item_ids)
    except DatabaseFailure as error:
        log.debug("no cancel check: %s", error)
        return set()


def load_models(ctx: context.WorkerContext, spec: GenerateSpec) -> tuple[LoadedModel, LoadedModel | None]:
    """The spec's target and draft from the worker's model cache, each keeping the other loaded."""
    target = ctx.models.get(spec.target, keep=(spec.draft,) if spec.draft else ())
    draft = ctx.models.get(spec.draft, keep=(spec.target,)) if spec.draft else None
    return target, draft


def item_probe(target: LoadedModel, draft: LoadedModel | None, params: DecodingParams,
               batched: bool = False) -> Probe | None:
    """The pair's probe for an item: measured first if an ``auto`` item needs it (outside the
    item's timings). Every speculative result records it, so that a report predicts the
    speedup with its own machine's costs."""
    if draft is None:
        return None
    if params.k == "auto":
        return stored_probe(target, draft, batched, params.draft_vocab)
    return load_probe(target.entry.alias, draft.entry.alias)


def prompt_of(claim: Claim) -> str | list[dict[str, Any]]:
    return claim.prompt if claim.prompt is not None else claim.messages


def _generate(ctx: context.WorkerContext, claim: Claim) -> Result:
    spec = GenerateSpec.from_dict(claim.spec)
    params = DecodingParams(**claim.params)
    load_start = time.perf_counter()
    target, draft = load_models(ctx, spec)
    load_s = time.perf_counter() - load_start
    probe_start = time.perf_counter()
    probe = item_probe(target, draft, params)
    probe_s = time.perf_counter() - probe_start
    prompt = prompt_of(claim)
    mx.reset_peak_memory()
    with measure_energy(ctx.meter, ctx.meter_reason, mx.synchronize) as (energy, renew_energy):
        report = _Progress(ctx, claim.item_id, params.max_tokens, renew_energy)
        start = time.perf_counter()
        generation = generate(target, draft, prompt, params, spec.chat, on_commit=report)
        generation_s = time.perf_counter() - start
    return result_row(target, draft, generation, energy, probe, {
        "model_load_s": load_s, "probe_s": probe_s, "generation_s": generation_s, "attempt": claim.attempt,
    })


class _Progress:
    """Called after every round: checks for cancellation and publishes progress, once a second,
    and keeps the energy meter read (``renew_energy``)."""

    def __init__(self, ctx: context.WorkerContext, item_id: int, max_tokens: int, renew_energy: Callable[[], None]):
        self.ctx, self.item_id, self.max_tokens, self.renew_energy = ctx, item_id, max_tokens, renew_energy
        self.job = get_current_job()
        self.next_check = time.monotonic() + PROGRESS_INTERVAL_S

    def __call__(self, tokens: int, metrics: DecodeMetrics) -> None:
        if time.monotonic() < self.next_check:
            return
        self.next_check = time.monotonic() + PROGRESS_INTERVAL_S
        self.renew_energy()
        if known_cancelled(self.ctx, [self.item_id]):
            raise Cancelled
        if self.job is not None:
            self.job.meta.update(tokens=tokens, max_tokens=self.max_tokens, rounds=metrics.rounds)
            try:
                self.job.save_meta()
            except redis.RedisError:  # progress is a courtesy; the result does not depend on Redis
                pass


def result_row(target: LoadedModel, draft: LoadedModel | None, generation: GenerationResult,
               energy: EnergyReading, probe: Probe | None, timings: dict[str, Any],
               energy_window_id: int | None = None) -> Result:
    """The result row of a finished generation, with its provenance; ``energy_window_id`` names
    the window that measured the batch it decoded in, where its own energy could not be."""
    metrics = generation.metrics
    chosen = backend_setup()
    joules_per_token = (energy.joules / metrics.generated_tokens
                        if energy.joules is not None and metrics.generated_tokens else None)
    return Result(
        text=generation.text,
        token_ids=generation.token_ids,
        metrics=metrics.as_dict() | {"spans": generation.spans, "joules_per_token": joules_per_token,
                                     "energy_window": "prefill and decode" if energy_window_id is None
                                     else "the whole batch (energy_window_id)",
                                     "probe": probe.as_dict() if probe is not None else None},
        prompt_tokens=metrics.prompt_tokens,
        generated_tokens=metrics.generated_tokens,
        decode_tokens_per_s=metrics.decode_tokens_per_s or 0.0,
        acceptance_rate=metrics.acceptance_per_candidate,
        batch_size=metrics.batch_size,
        energy_joules=energy.joules,
        energy_source=energy.source,
        energy_unavailable_reason=energy.unavailable_reason,
        energy_window_id=energy_window_id,
        backend=chosen.kind,
        device=chosen.device,
        versions=_versions(target, draft),
        timings=timings | {"prefill_s": metrics.prefill_s, "decode_s": metrics.decode_s,
                           "finished_at": datetime.now(UTC).isoformat()},
    )


def _versions(target: LoadedModel, draft: LoadedModel | None) -> dict[str, Any]:
    def model(loaded: LoadedModel | None) -> dict[str, Any] | None:
        if loaded is None:
            return None
        return {"alias": loaded.entry.alias, "source": loaded.entry.source, "sha256": loaded.entry.sha256,
                "path": str(loaded.path), "dtype": loaded.dtype}

    return {"polspec": __version__, **_package_versions(), "target": model(target), "draft": model(draft)}


@functools.cache
def _package_versions() -> dict[str, str]:
    # Read once per process: a lookup scans the installed distributions, and a batch writes
    # many results a second.
    return {name: importlib.metadata.version(name) for name in ("mlx", "mlx-lm", "transformers", "rq")}
