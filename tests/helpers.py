"""Helpers for tests that run a worker, as a real ``polspec worker`` process or in this one, and
watch the database."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from polspec.cli import main
from polspec.store.engine import make_engine, session_scope
from polspec.store.schema import Item, Result, Status
from polspec.worker import run as worker_run
from polspec.worker.model_cache import ModelCache
from conftest import resident_or_load


# A worker process as users install it: without torch, which only the tests' GGUF reference
# needs; transformers imports it wherever it is installed, 2 s of every worker's start here.
WORKER_WITHOUT_TORCH = "import sys; sys.modules['torch'] = None; from polspec.cli import main; main()"


def start_worker(env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WORKER_WITHOUT_TORCH, "worker", *args],
                            env=os.environ | env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@contextlib.contextmanager
def resident_worker_models() -> Iterator[None]:
    """Workers started in this process meanwhile take the session's loaded models: what
    loading them in a worker does is the subprocess workers' part."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker_run, "ModelCache", lambda: ModelCache(loader=resident_or_load))
        yield


def work(env: dict[str, str], **options) -> bool:
    """A burst worker in this process (``options`` as in ``WorkerOptions``)."""
    with resident_worker_models():
        return worker_run.run_worker(worker_run.WorkerOptions(burst=True, log_level="WARNING", **options),
                                     db_url=env["POLSPEC_DB_URL"], redis_url=env["POLSPEC_REDIS_URL"])


def worker_in_process(env: dict[str, str], *args: str) -> str:
    """``polspec worker ARGS`` in this process, to its end; its output. A restart after a fault
    needs no new process: what it must show is the recovery, and the worker's start-up and
    model loads are 5-10 s of a test."""
    with resident_worker_models():
        result = CliRunner().invoke(main, ["worker", *args], env=env)
    assert result.exit_code == 0, result.output
    return result.output


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


def shorten_unfinished(env: dict[str, str], max_tokens: int) -> None:
    """Every item not yet done asks for ``max_tokens`` from now on: a test-only write that makes
    the run after a fault cheap. Its items were enqueued long, to be surely decoding when the
    fault came, and a worker reads an item's parameters from its row as it claims it."""
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        for item in session.scalars(select(Item).where(Item.status.in_([Status.QUEUED, Status.RUNNING]))):
            item.params = item.params | {"max_tokens": max_tokens}
    engine.dispose()


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def new_result(item: Item, **energy: object) -> Result:
    """A result for ``item`` as a worker stores one (its energy unavailable unless ``energy`` says)."""
    energy = energy or {"energy_joules": None, "energy_unavailable_reason": "no power meter on Linux CPU"}
    return Result(
        item_id=item.id,
        text="Płynie Wisła płynie…",
        token_ids=[1, 2, 3],
        metrics={"acceptance_rate": 0.5, "rounds": 3},
        prompt_tokens=7,
        generated_tokens=3,
        decode_tokens_per_s=12.5,
        acceptance_rate=0.5,
        backend="mlx-cpu",
        device="cpu",
        versions={"polspec": "0.1.0"},
        timings={"decode_s": 0.24},
        **energy,
    )
