"""Writing a file whole or not at all: command output, and the caches several processes share."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from polspec.errors import PolspecError


def write_file_atomically(path: Path, write: Callable[[TextIO], None]) -> None:
    """Call ``write`` on a temporary UTF-8 text file beside ``path``, then move it into place, so
    a reader never sees half a file and a failure leaves nothing behind. The file gets the mode
    a plain write would give it (the existing file's, else what the umask allows), not the
    temporary file's private 0600. Raises :class:`PolspecError` naming ``path`` when it cannot
    be written. A symbolic link is written through, as a shell's ``>`` would, not replaced."""
    destination = path.resolve()
    directory = destination.parent
    if not directory.is_dir():
        problem = "is not a directory" if directory.exists() else "does not exist"
        raise PolspecError(f"{path}: {directory} {problem}")
    try:
        mode = path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_umask()
        handle = tempfile.NamedTemporaryFile("w", encoding="utf-8", newline="", dir=directory,
                                             prefix=f".{destination.name}.", delete=False)
    except OSError as error:
        raise PolspecError(f"{path}: cannot write there: {error.strerror}") from None
    try:
        with handle:
            write(handle)
        os.chmod(handle.name, mode)
        os.replace(handle.name, destination)
    except BaseException as error:
        os.unlink(handle.name)
        if isinstance(error, OSError):
            raise PolspecError(f"{path}: cannot write there: {error.strerror}") from None
        raise


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current
