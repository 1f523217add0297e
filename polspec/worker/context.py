"""What a running worker shares with the job functions it runs: database, models, identity.

RQ calls job functions with their JSON arguments only; the resident state (the engine, the
model cache, which item is running for the heartbeat thread) lives here, installed by the
worker before it takes its first job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Engine

from polspec.errors import PolspecError
from polspec.store.items import DEFAULT_LEASE_S, Worker
from polspec.worker.energy import Meter
from polspec.worker.model_cache import ModelCache


@dataclass
class WorkerContext:
    engine: Engine
    database_id: str
    models: ModelCache
    me: Worker
    meter: Meter | None
    meter_reason: str  # what the meter measures, or why there is none
    lease_s: float = DEFAULT_LEASE_S
    current_items: set[int] = field(default_factory=set)  # items being generated: their leases are renewed


_current: WorkerContext | None = None


def install(context: WorkerContext | None) -> None:
    global _current
    _current = context


def current() -> WorkerContext:
    if _current is None:
        raise PolspecError("polspec jobs run inside `polspec worker`, which sets up the database and models")
    return _current
