"""Helpers for tests that run ``polspec worker`` as a real process and watch the database."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from sqlalchemy import func, select

from polspec.store.engine import make_engine, session_scope
from polspec.store.schema import Item


def start_worker(env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "from polspec.cli import main; main()", "worker", *args],
                            env=os.environ | env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_line(worker: subprocess.Popen, text: str) -> str:
    """Read the worker's output until a line containing ``text``; fail if it ends first."""
    seen = []
    for line in worker.stdout:
        seen.append(line)
        if text in line:
            return line
    pytest.fail(f"the worker ended without printing {text!r}:\n{''.join(seen)}")


def statuses(env: dict[str, str]) -> dict[str, int]:
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        rows = session.execute(select(Item.status, func.count()).group_by(Item.status)).all()
    engine.dispose()
    return dict(rows)


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)
