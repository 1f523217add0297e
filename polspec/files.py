"""Files: paths as users type them, and files several processes share, written whole or not at
all and locked while one of them builds what the others need."""

from __future__ import annotations

import fcntl
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from polspec.errors import PolspecError


def user_path(text: str | Path) -> Path:
    """``text`` with a leading ``~`` or ``~user`` expanded as a shell would; a file named so
    (``~draft.jsonl``) where there is no such user. Raises :class:`PolspecError` naming it where
    neither is (:meth:`Path.expanduser` raises a bare RuntimeError there)."""
    path = os.path.expanduser(text)
    if str(path).startswith("~") and not Path(path).exists():
        raise PolspecError(f"{text}: no user {str(path)[1:].partition('/')[0]!r} for its '~'")
    return Path(path)


def write_file_atomically(path: Path, write: Callable[[IO], None], binary: bool = False) -> None:
    """Call ``write`` on a temporary UTF-8 text file (``binary``: a bytes one) beside ``path``,
    then move it into place, so a reader never sees half a file and a failure leaves nothing
    behind. The file gets the mode a plain write would give it (the existing file's, else what
    the umask allows). Raises
    :class:`PolspecError` naming ``path`` when it cannot be written. A symbolic link is written
    through, as a shell's ``>`` would, not replaced; so is a device or a pipe (``/dev/null``,
    ``/dev/stdout``, a FIFO), which a file put in its place would break for every program, and
    anything under ``/dev`` or ``/proc`` (``/dev/stdout`` may lead to a file the shell opened
    for appending)."""
    try:
        special = path.absolute().parts[1:2] in (("dev",), ("proc",)) or (
            path.exists() and not path.is_file() and not path.is_dir())
        if special:  # appending: a shell's `>> file` behind /dev/stdout keeps what it holds
            with _open(path, "a", binary) as handle:
                write(handle)
            return
    except OSError as error:
        raise PolspecError(f"{path}: cannot write there: {error.strerror}") from None
    destination = path.resolve()
    directory = destination.parent
    if not directory.is_dir():
        problem = "is not a directory" if directory.exists() else "does not exist"
        raise PolspecError(f"{path}: {directory} {problem}")
    # A unique name (two processes may write one cache file at once), created the way a plain
    # open() creates a file, so that the kernel applies the umask: reading the umask means
    # setting it, which would race with the worker's other threads.
    temporary = directory / f".{destination.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        mode = path.stat().st_mode & 0o7777 if path.exists() else None
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as error:
        raise PolspecError(f"{path}: cannot write there: {error.strerror}") from None
    try:
        with _open(descriptor, "w", binary) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())  # on disk before it replaces the old file: a power cut keeps one whole
        if mode is not None:
            os.chmod(temporary, mode)
        os.replace(temporary, destination)
    except BaseException as error:
        os.unlink(temporary)
        if isinstance(error, OSError):
            raise PolspecError(f"{path}: cannot write there: {error.strerror}") from None
        raise


def _open(file: Path | int, mode: str, binary: bool) -> IO:
    return open(file, mode + "b") if binary else open(file, mode, encoding="utf-8", newline="")


@contextmanager
def file_lock(path: Path, what: str, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` for the block: one process at a time gets
    past it, and the kernel frees it when its holder dies. ``on_wait`` is called once where
    another process holds it. The file is created where missing and stays: unlinking it would
    let two holders in. Raises :class:`PolspecError` naming the ``what`` when it cannot be made."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")  # writable: NFS emulates flock with fcntl locks, which need that
    except OSError as error:
        raise PolspecError(f"cannot create the {what} {path}: {error.strerror}") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
