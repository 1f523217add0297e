"""The CPU's cores shared among processes decoding on one machine (polspec.cpu_share): the real
OpenBLAS of the BLAS fix, real processes marking themselves in a real POLSPEC_HOME."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from polspec import backend, cpu_share
from polspec.decoding.batch import stream_batch
from polspec.decoding.params import DecodingParams
from polspec.decoding.run import generate
from polspec.models.loader import LoadedModel
from polspec.settings import BLAS_THREAD_VARIABLES

STARTING_THREADS = backend.blas_threads()

pytestmark = pytest.mark.skipif(STARTING_THREADS is None or STARTING_THREADS < 2,
                                reason="needs the BLAS fix's OpenBLAS on at least two cores")

# A process that marks itself as decoding, says its share, and runs until its stdin closes.
DECODING_PROCESS = """
import sys
from polspec.cpu_share import balance_blas_threads
print(balance_blas_threads(), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def alone(isolated_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """This process's share with no other process decoding: every thread it started with."""
    for name in BLAS_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    threads = cpu_share.balance_blas_threads()
    assert threads == backend.blas_threads() == STARTING_THREADS
    yield threads
    backend.set_blas_threads(STARTING_THREADS)  # the tests after these decode at full speed


def start_decoding_process(home: Path) -> tuple[subprocess.Popen, int]:
    """Another process decoding on this machine, and the share it took."""
    process = subprocess.Popen([sys.executable, "-c", DECODING_PROCESS], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True,
                               env={key: value for key, value in os.environ.items()
                                    if key not in BLAS_THREAD_VARIABLES} | {"POLSPEC_HOME": str(home)})
    return process, int(process.stdout.readline())


def end(process: subprocess.Popen) -> None:
    process.stdin.close()
    assert process.wait(timeout=30) == 0


def test_two_decoding_processes_take_half_the_threads_each_and_one_alone_takes_them_back(alone: int,
                                                                                           isolated_home: Path):
    other, its_share = start_decoding_process(isolated_home)
    assert its_share == alone // 2
    assert cpu_share.balance_blas_threads() == alone // 2
    assert backend.blas_threads() == alone // 2
    end(other)
    assert list(cpu_share.mark_path().parent.iterdir()) == [cpu_share.mark_path()]  # it tidied its own away
    assert cpu_share.balance_blas_threads() == alone
    assert backend.blas_threads() == alone


def test_a_killed_process_no_longer_counts_and_its_mark_is_tidied_away(alone: int, isolated_home: Path):
    other, _ = start_decoding_process(isolated_home)
    marks = cpu_share.mark_path().parent
    other.send_signal(signal.SIGKILL)
    other.wait(timeout=30)
    assert len(list(marks.iterdir())) == 2  # it had no time to tidy up
    assert cpu_share.balance_blas_threads() == alone
    assert list(marks.iterdir()) == [cpu_share.mark_path()]


def test_a_process_that_stopped_decoding_no_longer_counts(alone: int, isolated_home: Path):
    other, _ = start_decoding_process(isolated_home)
    try:
        its_mark = cpu_share.mark_path(other.pid)
        assert cpu_share.balance_blas_threads() == alone // 2
        last_round = time.time() - cpu_share.DECODING_WITHIN_S - 1  # e.g. a worker waiting for jobs since
        os.utime(its_mark, (last_round, last_round))
        assert cpu_share.balance_blas_threads() == alone
        assert its_mark.exists()  # it still runs: its mark is its own to remove
    finally:
        end(other)


def test_a_probe_shares_only_with_processes_decoding_a_moment_ago(alone: int, isolated_home: Path):
    """A probe's figures stand for good: one taken on half the threads beside a worker that had
    just gone idle would price every round at half the machine."""
    other, _ = start_decoding_process(isolated_home)
    try:
        between_two_jobs = time.time() - cpu_share.MEASURING_WITHIN_S - 5
        os.utime(cpu_share.mark_path(other.pid), (between_two_jobs, between_two_jobs))
        with cpu_share.measuring():
            assert backend.blas_threads() == alone
            os.utime(cpu_share.mark_path(other.pid))  # it decodes again
            assert cpu_share.balance_blas_threads() == alone // 2
        os.utime(cpu_share.mark_path(other.pid), (between_two_jobs, between_two_jobs))
        assert cpu_share.balance_blas_threads() == alone // 2  # decoding, it still counts
    finally:
        end(other)


def test_another_machine_s_marks_on_a_shared_home_do_not_count_until_they_are_tidied_away(alone: int):
    marks = cpu_share.mark_path().parent
    recent, forgotten = marks / "laptop_boot_0a1b2c3d4e5f-4242", marks / "laptop_boot_0a1b2c3d4e5f-4343"
    recent.touch()
    forgotten.touch()
    long_ago = time.time() - cpu_share.FORGOTTEN_AFTER_S - 1
    os.utime(forgotten, (long_ago, long_ago))
    assert cpu_share.balance_blas_threads() == alone
    assert sorted(marks.iterdir()) == sorted([recent, cpu_share.mark_path()])


def test_threads_the_user_chose_are_left_alone(alone: int, isolated_home: Path, monkeypatch: pytest.MonkeyPatch):
    other, _ = start_decoding_process(isolated_home)
    try:
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", str(alone))
        assert cpu_share.balance_blas_threads() is None
        assert backend.blas_threads() == alone
    finally:
        end(other)


@pytest.mark.slow
@pytest.mark.parametrize("batched", [False, True], ids=["one-sequence", "batched"])
def test_decoding_takes_its_share_of_the_cores(alone: int, isolated_home: Path, smollm2: LoadedModel,
                                               monkeypatch: pytest.MonkeyPatch, batched: bool):
    other, _ = start_decoding_process(isolated_home)
    try:
        monkeypatch.setattr(cpu_share, "_last_check", -cpu_share.CHECK_EVERY_S)  # as if a second had passed
        params = DecodingParams(max_tokens=2)
        if batched:
            assert len(list(stream_batch(smollm2, None, [("Kraków jest", params)] * 2, max_batch=2))) == 4
        else:
            assert len(generate(smollm2, None, "Kraków jest", params).token_ids) == 2
        assert backend.blas_threads() == alone // 2
        # Done decoding, it gives the cores back at once: a process waiting for the next job (or
        # a test waiting for a worker) held half of them for a minute.
        assert not cpu_share.mark_path().exists()
    finally:
        end(other)
