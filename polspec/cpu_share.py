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
counting after :data:`DECODING_WITHIN_S`, and the others take their threads back.

Nothing changes where the user set the BLAS's threads (``OPENBLAS_NUM_THREADS`` and the like)
or where there is no BLAS fix (macOS, whose Accelerate has no such pool; a GPU).
"""

from __future__ import annotations

import atexit
import os
import re
import time
from pathlib import Path

from polspec import backend
from polspec.errors import PolspecError
from polspec.processes import pid_alive, this_host_and_boot
from polspec.settings import blas_threads_set, locks_dir

# A process counts as decoding this long after its last round: longer than any one round or
# prefill (a large target's batched round on a slow CPU takes seconds), so that no process
# takes back threads from one in the middle of a round. A share too small for a while costs
# a process alone about 13% of its speed here; one too large costs the machine tenfold.
DECODING_WITHIN_S = 30.0
# How often a process looks again: marking and counting costs a directory listing.
CHECK_EVERY_S = 1.0
# A mark this old is a process that is gone without tidying up (killed): anyone removes it.
FORGOTTEN_AFTER_S = 3600.0

_full: int | None = None  # the threads this process's BLAS started with
_last_check = -CHECK_EVERY_S


def share_cores() -> None:
    """Mark this process as decoding and give its BLAS its share of the cores; at most once a
    :data:`CHECK_EVERY_S` (a call in between returns at once). Decoders call it between rounds."""
    global _last_check
    now = time.monotonic()
    if now - _last_check < CHECK_EVERY_S:
        return
    _last_check = now
    balance_blas_threads()


def balance_blas_threads() -> int | None:
    """Mark this process as decoding now, count the decoding processes of this machine, and set
    this one's BLAS threads to its share; returns them (None where polspec leaves the BLAS alone)."""
    global _full
    if blas_threads_set() or backend.blas_threads() is None:
        return None
    if _full is None:
        _full = backend.blas_threads()
        atexit.register(_unmark)
    try:
        _mark()
        sharing = decoding_processes()
    except (OSError, PolspecError):  # an unwritable POLSPEC_HOME: decoding goes on with the threads it has
        return backend.blas_threads()
    share = max(1, _full // max(1, sharing))
    if share != backend.blas_threads():
        backend.set_blas_threads(share)
    return share


def decoding_processes() -> int:
    """The processes of this machine that decoded within :data:`DECODING_WITHIN_S` and still run,
    this one included once it has marked itself; tidies away the marks of processes long gone."""
    prefix = _host_prefix()
    now = time.time()
    count = 0
    for mark in _marks_dir().iterdir():
        try:
            age = now - mark.stat().st_mtime
        except FileNotFoundError:  # its process tidied it away meanwhile
            continue
        pid = mark.name[len(prefix):]
        if not mark.name.startswith(prefix) or not pid.isdigit():
            if age > FORGOTTEN_AFTER_S:  # another machine's on a shared home: it tidies its own
                mark.unlink(missing_ok=True)
            continue
        if not pid_alive(int(pid)) or age > FORGOTTEN_AFTER_S:
            mark.unlink(missing_ok=True)
        elif age <= DECODING_WITHIN_S:
            count += 1
    return count


def _marks_dir() -> Path:
    return locks_dir() / "decoding"


def _host_prefix() -> str:
    """This machine's part of a mark's name: a home shared between machines holds theirs too."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", this_host_and_boot()) + "-"


def _mark() -> None:
    directory = _marks_dir()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{_host_prefix()}{os.getpid()}").touch()


def _unmark() -> None:
    try:
        (_marks_dir() / f"{_host_prefix()}{os.getpid()}").unlink(missing_ok=True)
    except OSError:
        pass
