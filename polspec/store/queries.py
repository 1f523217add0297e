"""Read-side queries over the results database: progress per batch, results, exports, raw SQL.

Everything here reads; ``polspec status`` and ``polspec results`` are thin layers over it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import groupby
from typing import Any

from sqlalchemy import ColumnElement, Engine, func, literal_column, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from polspec.errors import DatabaseFailure, PolspecError
from polspec.store.engine import session_scope
from polspec.store.items import UNFINISHED, item_spec
from polspec.store.schema import Batch, Cell, EnergyWindow, Item, Result, Status


ENDED = (Status.DONE.value, Status.FAILED.value)  # a batch in either has no item left to change


@dataclass
class BatchProgress:
    """Where a batch stands: item counts per status, speed so far and the time left."""

    id: int
    name: str | None
    kind: str
    status: str
    target: str
    drafts: list[str]  # a generation's draft (or none), a sweep's every draft
    created_at: datetime
    counts: dict[str, int] = field(default_factory=dict)
    generated_tokens: int = 0
    generation_s: float = 0.0
    busy_s: float = 0.0  # wall time during which some worker decoded one of its items that ended done

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def completed(self) -> int:
        """Items that ran to an end, done or failed (a cancelled item never ran: no progress)."""
        return self.counts.get(Status.DONE, 0) + self.counts.get(Status.FAILED, 0)

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed of one sequence, over the batch's generations."""
        return self.generated_tokens / self.generation_s if self.generation_s > 0 else None

    @property
    def aggregate_tokens_per_s(self) -> float | None:
        """Tokens per second of the whole run: every token over the wall time some worker was
        decoding the batch's items (model loads left out), so items decoding together (or
        parallel workers) add up."""
        return self.generated_tokens / self.busy_s if self.busy_s > 0 else None

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the pace of the batch so far.

        The pace is wall time while any worker decoded the batch's items, per item done: it counts
        parallel workers once and leaves out the hours a resumed sweep sat idle. Failed items
        are left out, since one that fails at once would make the pace look fast.
        """
        done = self.counts.get(Status.DONE, 0)
        left = self.counts.get(Status.QUEUED, 0) + self.counts.get(Status.RUNNING, 0)
        if not done or not left or not self.busy_s:
            return None
        return self.busy_s / done * left

    def as_dict(self) -> dict[str, Any]:
        # "draft" is a generation's one draft, as it was before sweeps listed theirs in "drafts".
        return {"batch": self.id, "name": self.name, "kind": self.kind, "status": self.status,
                "target": self.target, "draft": self.drafts[0] if self.kind == "generate" and self.drafts else None,
                "drafts": self.drafts, "created_at": self.created_at.isoformat(),
                "total": self.total, **{status.value: self.counts.get(status.value, 0) for status in Status},
                "generated_tokens": self.generated_tokens, "tokens_per_s": self.tokens_per_s,
                "aggregate_tokens_per_s": self.aggregate_tokens_per_s, "eta_s": self.eta_s}


def _drafts(spec: dict[str, Any]) -> list[str]:
    if spec.get("kind") == "sweep":
        return list(spec.get("config", {}).get("drafts", []))
    return [spec["draft"]] if spec.get("draft") else []


def find_batch(session: Session, batch_id: int) -> Batch:
    """The batch ``batch_id``, or a :class:`PolspecError` saying there is none."""
    batch = session.get(Batch, batch_id)
    if batch is None:
        raise PolspecError(f"no batch {batch_id} (polspec status lists the batches)")
    return batch


def require_batch(engine: Engine, batch_id: int) -> None:
    """Refuse an unknown batch id before a command reads or changes anything of it."""
    with session_scope(engine, reads_only=True) as session:
        find_batch(session, batch_id)


def batch_progress(engine: Engine, batch_id: int | None = None,
                   before: Iterable[BatchProgress] = ()) -> list[BatchProgress]:
    """Progress of one batch, or of every batch (newest first). ``before``: an earlier read, whose
    batches done or failed then and now, with the same items per status, are taken from it rather
    than read again (a watch every few seconds read every result of every batch ever run)."""
    ended = {batch.id: batch for batch in before if batch.status in ENDED}
    with session_scope(engine, reads_only=True) as session:
        query = select(Batch).order_by(Batch.id.desc())
        if batch_id is not None:
            query = query.where(Batch.id == batch_id)
        batches = {batch.id: BatchProgress(batch.id, batch.name, batch.kind, batch.status, batch.spec.get("target", ""),
                                           _drafts(batch.spec), batch.created_at)
                   for batch in session.scalars(query)}
        if batch_id is not None and not batches:
            find_batch(session, batch_id)
        for batch, status, count in session.execute(
                select(Item.batch_id, Item.status, func.count()).where(Item.batch_id.in_(list(batches)))
                .group_by(Item.batch_id, Item.status)):
            batches[batch].counts[status] = count
        for id_, progress in batches.items():
            earlier = ended.get(id_)
            if earlier is not None and (earlier.status, earlier.counts) == (progress.status, progress.counts):
                batches[id_] = earlier
        ids = [id_ for id_, progress in batches.items() if ended.get(id_) is not progress]
        for batch, tokens, decode_s in session.execute(
                select(Item.batch_id, func.sum(Result.generated_tokens),
                       func.sum(Result.generated_tokens / func.nullif(Result.decode_tokens_per_s, 0)))
                .join(Result, Result.item_id == Item.id).where(Item.batch_id.in_(ids)).group_by(Item.batch_id)):
            batches[batch].generated_tokens, batches[batch].generation_s = int(tokens or 0), float(decode_s or 0.0)
        runs = session.execute(
            select(Item.batch_id, Item.started_at, Item.finished_at, seconds_before_decoding().label("waited_s"))
            .join(Result, Result.item_id == Item.id)
            .where(Item.batch_id.in_(ids), Item.status == Status.DONE,
                   Item.started_at.is_not(None), Item.finished_at.is_not(None))
            .order_by(Item.batch_id))
        for batch, spans in groupby(runs, key=lambda run: run.batch_id):
            batches[batch].busy_s = busy_seconds(sorted(
                (decoding_start(run.started_at, run.finished_at, run.waited_s), run.finished_at) for run in spans))
        return list(batches.values())


@dataclass
class WorkProgress:
    """Some batches' items per status and the tokens each batch's results hold: what a
    worker's progress bar shows (see :func:`work_progress`)."""

    batches: set[int]
    counts: dict[str, int]
    tokens: dict[int, int]


def work_progress(engine: Engine, watched: set[int]) -> WorkProgress:
    """The batches ``watched`` and every unfinished one, in three aggregate queries: a worker
    redraws this after each item, so it must not grow with the items already done, as
    :func:`batch_progress`'s pace does (a sweep's every run is read)."""
    with session_scope(engine, reads_only=True) as session:
        ids = watched | set(session.scalars(select(Batch.id).where(Batch.status.in_(UNFINISHED))))
        counts = {status: count for status, count in session.execute(
            select(Item.status, func.count()).where(Item.batch_id.in_(ids)).group_by(Item.status))}
        tokens = {batch: int(total or 0) for batch, total in session.execute(
            select(Item.batch_id, func.sum(Result.generated_tokens)).join(Result, Result.item_id == Item.id)
            .where(Item.batch_id.in_(ids)).group_by(Item.batch_id))}
    return WorkProgress(ids, counts, tokens)


def seconds_before_decoding() -> ColumnElement[float]:
    """A result's seconds between its item's claim and its first round: the models' load and
    the probe it waited for (its ``timings``). Only the first item of a run pays those, and
    counting them as decoding made a short run's throughput look several times slower than it
    decodes. Read in SQL: a sweep's hundreds of thousands of timings need not be parsed."""
    none = literal_column("0.0")  # a constant, not one more of the statement's bound parameters
    return (func.coalesce(Result.timings["model_load_s"].as_float(), none)
            + func.coalesce(Result.timings["probe_s"].as_float(), none))


def decoding_start(started_at: datetime, finished_at: datetime, waited_s: float) -> datetime:
    """When an item began decoding: its claim plus :func:`seconds_before_decoding`."""
    return min(started_at + timedelta(seconds=waited_s), finished_at)


def busy_seconds(spans: Iterable[tuple[datetime, datetime]]) -> float:
    """Length of the union of (start, end) spans given in order of start."""
    busy, covered_to = 0.0, None
    for start, end in spans:
        if covered_to is not None and start < covered_to:
            start = covered_to
        if end > start:
            busy += (end - start).total_seconds()
            covered_to = end
    return busy


# What decoded each item, so that an export can be analysed (and rerun) on its own: its
# settings, a sweep item's place in its sweep, what the models were, what the decoding did, and
# the energy of the batch it decoded in where it has none of its own.
ITEM_SETTINGS = ("k", "strategy", "verify", "prefix", "partial_word", "draft_vocab", "confidence", "k_max",
                 "temperature", "top_p", "top_k", "seed", "max_tokens")
DRAFT_SETTINGS = ("k", "strategy", "verify", "prefix", "partial_word", "draft_vocab", "confidence", "k_max")
SWEEP_COLUMNS = ("dataset", "prompt_key", "repeat", "baseline", "requested_batch")
METRIC_COLUMNS = ("finish_reason", "rounds", "tokens_per_round", "draft_tokens", "draft_tokens_accepted",
                  "acceptance_per_draft_token", "candidates", "candidates_accepted", "rejections", "boundary_misses",
                  "plain_rounds", "k_policy_note", "draft_vocab_used", "prefill_s", "decode_s", "draft_s",
                  "translate_s", "verify_s", "resync_s", "peak_memory_gb")
WINDOW_COLUMNS = ("window_ended", "window_sequences", "window_generated_tokens", "window_energy_joules",
                  "window_energy_source", "window_energy_unavailable_reason")
EXPORT_COLUMNS = ("batch", "id", "status", "target", "draft", "target_sha256", "draft_sha256", *ITEM_SETTINGS, "chat",
                  *SWEEP_COLUMNS, "prompt", "messages", "text", "prompt_tokens", "generated_tokens",
                  "decode_tokens_per_s", "batch_size", "acceptance_rate", *METRIC_COLUMNS, "energy_joules",
                  "energy_source", "energy_unavailable_reason", "energy_window_id", *WINDOW_COLUMNS, "attempts",
                  "error", "worker_host", "backend", "device", "polspec_version", "mlx_version", "finished_at")
_ROWS_AT_ONCE = 500  # items (with their texts and token ids) held in memory at a time while rows stream out


def item_rows(engine: Engine, batch_id: int | None = None, status: str | None = None,
              limit: int | None = None) -> Iterator[dict[str, Any]]:
    """One flat row per item (with its result when it has one), in item order, the newest batch
    first (as ``status`` lists them: one looks for the run just done), read a few hundred at a
    time: a sweep may have hundreds of thousands."""
    query = (select(Item, Result, Batch.spec, Cell.config, Cell.baseline).join(Batch, Batch.id == Item.batch_id)
             .outerjoin(Cell, Cell.id == Item.cell_id).outerjoin(Result, Result.item_id == Item.id)
             .order_by(Item.batch_id.desc(), Item.id).execution_options(yield_per=_ROWS_AT_ONCE))
    if batch_id is not None:
        query = query.where(Item.batch_id == batch_id)
    if status is not None:
        query = query.where(Item.status == status)
    if limit is not None:
        query = query.limit(limit)
    windows: dict[int, dict[str, Any]] = {}
    with session_scope(engine, reads_only=True) as session:
        for item, result, spec, cell, baseline in session.execute(query):
            draft = cell["draft"] if cell is not None else spec.get("draft")
            metrics = result.metrics if result is not None else {}
            versions = result.versions if result is not None else {}
            settings = applied_settings(item.params, draft, metrics)
            window_id = result.energy_window_id if result is not None else None
            if window_id is not None and window_id not in windows:
                window = _batch_energy(session, window_id) or {}
                windows[window_id] = {column: window.get(column.removeprefix("window_")) for column in WINDOW_COLUMNS}
            yield {
                "batch": item.batch_id, "id": item.item_key, "status": item.status, "target": spec.get("target"),
                "draft": draft, "target_sha256": (versions.get("target") or {}).get("sha256"),
                "draft_sha256": (versions.get("draft") or {}).get("sha256"), **settings, "chat": spec.get("chat"),
                "dataset": cell.get("dataset") if cell is not None else None, "prompt_key": item.prompt_key,
                "repeat": item.repeat, "baseline": baseline,
                "requested_batch": cell.get("batch", 1) if cell is not None else None,  # older sweeps: 1
                "prompt": item.prompt, "messages": item.messages, "text": result.text if result else None,
                "prompt_tokens": result.prompt_tokens if result else None,
                "generated_tokens": result.generated_tokens if result else None,
                "decode_tokens_per_s": result.decode_tokens_per_s if result else None,
                "batch_size": result.batch_size if result else None,
                "acceptance_rate": result.acceptance_rate if result else None,
                **{name: metrics.get("draft_vocab" if name == "draft_vocab_used" else name) for name in METRIC_COLUMNS},
                "energy_joules": result.energy_joules if result else None,
                "energy_source": result.energy_source if result else None,
                "energy_unavailable_reason": result.energy_unavailable_reason if result else None,
                "energy_window_id": window_id, **windows.get(window_id, dict.fromkeys(WINDOW_COLUMNS)),
                "attempts": item.attempts, "error": item.last_error, "worker_host": item.worker_host,
                "backend": result.backend if result else None, "device": result.device if result else None,
                "polspec_version": versions.get("polspec"), "mlx_version": versions.get("mlx"),
                "finished_at": item.finished_at.isoformat() if item.finished_at else None,
            }


def applied_settings(params: dict[str, Any], draft: str | None, metrics: dict[str, Any]) -> dict[str, Any]:
    """The decoding settings an item ran with, from its parameters and its result's metrics."""
    settings = {name: params.get(name) for name in ITEM_SETTINGS}
    if draft is None:  # target-only: no draft length, translation or verification applied
        settings |= dict.fromkeys(DRAFT_SETTINGS)
    elif metrics.get("verify"):
        settings["verify"] = metrics["verify"]  # what ran: auto is exact when greedy
    if metrics.get("seed") is not None:
        settings["seed"] = metrics["seed"]  # drawn when none was asked for: reruns it
    return settings


def item_detail(engine: Engine, batch_id: int, key: str) -> dict[str, Any]:
    """Everything stored about one item: input, parameters, status, and its full result."""
    with session_scope(engine, reads_only=True) as session:
        item = session.scalar(select(Item).where(Item.batch_id == batch_id, Item.item_key == key))
        if item is None:
            find_batch(session, batch_id)
            raise PolspecError(f"batch {batch_id} has no item {key!r}")
        result = item.result
        spec = item_spec(item)
        settings = applied_settings(item.params, spec.get("draft"), result.metrics if result is not None else {})
        detail = {"batch": batch_id, "id": item.item_key, "status": item.status, "target": spec["target"],
                  "draft": spec.get("draft"), "settings": settings, "prompt": item.prompt,
                  "messages": item.messages, "params": item.params, "attempts": item.attempts,
                  "error": item.last_error, "worker_host": item.worker_host,
                  "started_at": item.started_at.isoformat() if item.started_at else None,
                  "finished_at": item.finished_at.isoformat() if item.finished_at else None}
        if result is not None:
            detail |= {"text": result.text, "token_ids": result.token_ids, "metrics": result.metrics,
                       "energy_joules": result.energy_joules, "energy_source": result.energy_source,
                       "energy_unavailable_reason": result.energy_unavailable_reason,
                       "batch_energy": _batch_energy(session, result.energy_window_id),
                       "backend": result.backend, "device": result.device, "versions": result.versions,
                       "timings": result.timings}
        return detail


def _batch_energy(session: Session, window_id: int | None) -> dict[str, Any] | None:
    """The energy window a result's item decoded in, as ``results show`` gives it."""
    window = session.get(EnergyWindow, window_id) if window_id is not None else None
    if window is None:
        return None
    return {"id": window.id, "ended": window.ended_at is not None, "sequences": window.sequences,
            "generated_tokens": window.generated_tokens, "energy_joules": window.energy_joules,
            "energy_source": window.energy_source, "energy_unavailable_reason": window.energy_unavailable_reason}


def run_sql(engine: Engine, sql: str) -> tuple[list[str], list[tuple]]:
    """Run one statement on a read-only engine and return its column names and rows.

    Whatever the database refuses (syntax, unknown table, a write) is a one-line error.
    """
    if not sql.strip():
        raise PolspecError("the query is empty")
    try:
        with engine.connect() as connection:
            # As written: text() would read ":name" as a parameter, even inside a string. Drivers
            # of the format styles (psycopg) read "%" as one too, unless doubled.
            escaped = sql.replace("%", "%%") if engine.dialect.paramstyle in ("format", "pyformat") else sql
            result = connection.exec_driver_sql(escaped)
            if not result.returns_rows:  # a setting or a temporary table: nothing to show, and no query
                raise PolspecError(f"{NOT_A_QUERY}: {' '.join(sql.split())[:60]!r}")
            return list(result.keys()), [tuple(row) for row in result]
    except DatabaseFailure as error:  # SQLite's refusals come as the engine's DatabaseFailure
        if _refused_write(error.reason):
            raise PolspecError(f"{ONLY_READS} ({error.reason})") from None
        raise
    except DBAPIError as error:
        reason = " ".join(str(error.orig).split())
        if _refused_write(reason):
            raise PolspecError(f"{ONLY_READS} ({reason})") from None
        raise PolspecError(f"the database refused the query: {reason}") from None


# SQLite's words for a write on a read-only connection, which read as if the file were
# read-only, and PostgreSQL's. Their own words follow in brackets.
_WRITE_REFUSALS = ("attempt to write a readonly database", "in a read-only transaction")
ONLY_READS = "results sql only reads: the query would change the database"
NOT_A_QUERY = "results sql shows what a query selects, and this statement selects nothing"


def _refused_write(reason: str) -> bool:
    return any(refusal in reason for refusal in _WRITE_REFUSALS)
