"""What the store tests' spawned processes run.

A spawned child imports the module of the function it is handed: from ``test_store`` that
was conftest and helpers too, with transformers, torch and MLX, about 10 s of each test that
spawns them on two cores. This module imports only what the work needs.
"""

from __future__ import annotations

import time

from sqlalchemy import func, select

from polspec.store.engine import make_engine, session_scope
from polspec.store.migrate import current_revision, ensure_schema
from polspec.store.schema import Item


def ensure_then_read_revision(url: str) -> str | None:
    ensure_schema(url)
    return current_revision(url)


def read_then_write(url: str, rounds: int) -> None:
    engine = make_engine(url)
    for _ in range(rounds):
        with session_scope(engine) as session:
            count = session.scalar(select(func.count()).select_from(Item))
            time.sleep(0.005)  # widen the window in which another writer could step in
            session.add(Item(batch_id=1, item_key=str(count), prompt="x", params={}))
    engine.dispose()
