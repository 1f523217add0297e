"""The CPU's cores shared among the polspec processes decoding on one machine at once.

On a Linux CPU each process's OpenBLAS (the BLAS fix, :mod:`polspec.backend`) runs a product
on a thread per core, and its threads spin while they wait for the next one. Two processes
decoding at once (two workers, a worker and ``polspec generate``) so fight over every core:
on a 2-core VM each ran about ten times slower than alone (BENCHMARKS.md, "Two processes
decoding on one machine"). A decoding process calls :func:`share_cores` between rounds: it
marks itself as decoding (a file of its own under ``locks_dir()/decoding``, touched at most
once a second), counts the processes of this machine that marked themselves within
:data:`DECODING_WITHIN_S` and still run, and gives its BLAS an equal share of the threads it
started with (at least one). One that stops decoding (a worker waiting for jobs) stops
counting once its generation or batch ends (:func:`release_cores`), or, killed or stuck, after
:data:`DECODING_WITHIN_S`, and the others take their threads back. Prefill and the probe's
measurements take their share between forwards too.

Nothing changes where the user set the BLAS's threads (``OPENBLAS_NUM_THREADS`` and the like),
where there is no BLAS fix (macOS, whose Accelerate has no such pool), or in a process that
decodes on a GPU (it leaves the cores to the others).
"""

from __future__ import annotations

import atexit
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from polspec import backend
from polspec.errors import PolspecError
from polspec.processes import pid_alive, this_host_and_boot
from polspec.settings import blas_threads_set, locks_dir

# A process counts as decoding this long after its last round: longer than any one forward (a
# large target's batched round or a prefill chunk on a slow CPU takes many seconds), so that no
# process takes back threads from one in the middle of it. A share too small for a while costs
# a process alone about 13% of its speed here; one too large costs the machine tenfold.
DECODING_WITHIN_S = 60.0
# The window while a probe measures (:func:`measuring`): its figures stand for the machine for
# good, so it shares only with processes that decoded a moment ago, not with a worker that has
# just gone idle.
MEASURING_WITHIN_S = 10.0
# How often a process looks again: marking and counting costs a directory listing.
CHECK_EVERY_S = 1.0
# A mark this old is a process that is gone without tidying up (killed): anyone removes it.
FORGOTTEN_AFTER_S = 3600.0

_started_with: int | None = None  # the threads this process's BLAS started with
_last_check = -CHECK_EVERY_S
_within_s = DECODING_WITHIN_S  # who counts as decoding: MEASURING_WITHIN_S while a probe measures


def share_cores() -> None:
    """Mark this process as decoding and give its BLAS its share of the cores; at most once a
    :data:`CHECK_EVERY_S` (a call in between returns at once). Decoders call it between rounds."""
    global _last_check
    now = time.monotonic()
    if now - _last_check < CHECK_EVERY_S:
        return
    _last_check = now
    balance_blas_threads()


@contextmanager
def measuring() -> Iterator[None]:
    """While a probe measures: share only with the processes that decoded within
    :data:`MEASURING_WITHIN_S`, from the start."""
    global _within_s
    _within_s = MEASURING_WITHIN_S
    try:
        balance_blas_threads()
        yield
    finally:
        _within_s = DECODING_WITHIN_S
        release_cores()


def why_not_shared() -> str | None:
    """Why polspec leaves this process's BLAS threads alone, or None where it shares them."""
    if backend.blas_threads() is None:
        return "no OpenBLAS of the BLAS fix here"
    if blas_threads_set():
        return "set by OPENBLAS_NUM_THREADS or OMP_NUM_THREADS"
    if backend.setup().device != "cpu":
        return "decoding runs on the GPU"
    return None


def balance_blas_threads() -> int | None:
    """Mark this process as decoding now, count the processes of this machine that decode (see
    :func:`decoding_processes`), and set this one's BLAS threads to its share; returns them (None
    where polspec leaves the BLAS alone: :func:`why_not_shared`)."""
    global _started_with
    if why_not_shared() is not None:
        return None
    current = backend.blas_threads()
    if _started_with is None:
        _started_with = current
        atexit.register(release_cores)
    try:
        mark = mark_path()
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()
        sharing = decoding_processes(_within_s)
    except (OSError, PolspecError):  # an unwritable POLSPEC_HOME: decoding goes on with the threads it has
        return current
    share = max(1, _started_with // max(1, sharing))
    if share != current:
        backend.set_blas_threads(share)
    return share


def decoding_processes(within_s: float = DECODING_WITHIN_S) -> int:
    """The processes of this machine that decoded within ``within_s`` and still run, this one
    included once it has marked itself; tidies away the marks of processes long gone."""
    prefix = _host_prefix()
    now = time.time()
    count = 0
    marks = _marks_dir()
    if not marks.is_dir():  # nothing has decoded with this home yet
        return 0
    for mark in marks.iterdir():
        try:
            age = now - mark.stat().st_mtime
        except FileNotFoundError:  # its process tidied it away meanwhile
            continue
        pid = mark.name[len(prefix):]
        if not mark.name.startswith(prefix) or not pid.isdigit():  # another machine's, on a shared home
            if age > FORGOTTEN_AFTER_S:  # a machine that was switched off cannot tidy its own
                _remove(mark)
            continue
        if not pid_alive(int(pid)) or age > FORGOTTEN_AFTER_S:
            _remove(mark)
        elif age <= within_s:
            count += 1
    return count


def _remove(mark: Path) -> None:
    """Tidy a mark away where this process may (on a home several users share, another user's
    stays, and counts no more than its age and pid say)."""
    try:
        mark.unlink(missing_ok=True)
    except OSError:
        pass


def _marks_dir() -> Path:
    return locks_dir() / "decoding"


def _host_prefix() -> str:
    """This machine's part of a mark's name: a home shared between machines holds theirs too."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", this_host_and_boot()) + "-"


def mark_path(pid: int | None = None) -> Path:
    """The mark of process ``pid`` of this machine (default: this process)."""
    return _marks_dir() / f"{_host_prefix()}{os.getpid() if pid is None else pid}"


def release_cores() -> None:
    """This process stops decoding (a generation or a batch has ended): its mark goes, so the
    others take its threads back at their next look, not :data:`DECODING_WITHIN_S` later; and
    its own next round looks again at once."""
    global _last_check
    _last_check = -CHECK_EVERY_S
    try:
        _remove(mark_path())
    except PolspecError:  # POLSPEC_HOME went away
        pass
