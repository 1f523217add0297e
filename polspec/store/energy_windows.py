"""Energy windows: the measured energy of a batch of items that decoded together.

A worker opens a window at a continuous batch's first round (before any of its items finishes,
so that each result can name it) and closes it when the batch ends. See
:class:`~polspec.store.schema.EnergyWindow` for what a window holds and what an unclosed one
means.
"""

from __future__ import annotations

from sqlalchemy import Engine

from polspec.store.engine import session_scope
from polspec.store.items import Worker
from polspec.store.schema import EnergyWindow, utcnow


def open_energy_window(engine: Engine, me: Worker) -> int:
    """A new, open window of this worker; its id."""
    with session_scope(engine) as session:
        window = EnergyWindow(worker_host=me.host, worker_pid=me.pid)
        session.add(window)
        session.flush()
        return window.id


def close_energy_window(engine: Engine, window_id: int, *, sequences: int, generated_tokens: int,
                        joules: float | None, source: str | None, unavailable_reason: str | None) -> None:
    """Record what the window measured: joules and their source, or None and the reason."""
    with session_scope(engine) as session:
        window = session.get(EnergyWindow, window_id)
        if window is None:  # deleted meanwhile (a user pruning the database): nothing to record
            return
        window.ended_at = utcnow()
        window.sequences, window.generated_tokens = sequences, generated_tokens
        window.energy_joules, window.energy_source = joules, source
        window.energy_unavailable_reason = unavailable_reason
