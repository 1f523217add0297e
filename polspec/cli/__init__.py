"""The ``polspec`` command line: one module per command group, each a thin layer over the library."""

from __future__ import annotations

import errno
import io
import os
import signal
import sys
import threading

import click

from polspec import __version__
from polspec.backend import INSTALL_HINT
from polspec.errors import PolspecError


class PolspecGroup(click.Group):
    """A click group that turns :class:`PolspecError` into one line on stderr and exit code 1.

    A missing MLX backend surfaces wherever ``mlx.core`` is first imported; it becomes the
    same one-line hint as :func:`polspec.backend.setup` gives. A full disk or a failing device
    under stdout (``> /dev/full``) is one line too; click already quiets a closed pipe (``| head``).
    So is a file system that refuses a path (a cache folder left to root by a ``sudo`` run, a
    file where polspec keeps a folder, a read-only mount), naming the path.
    """

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except PolspecError as error:
            click.echo(f"polspec: error: {error}", err=True)
            sys.exit(1)
        except ModuleNotFoundError as error:
            if (error.name or "").split(".")[0] != "mlx":
                raise
            click.echo(f"polspec: error: {INSTALL_HINT} ({error})", err=True)
            sys.exit(1)
        except OSError as error:
            if error.errno not in _PATH_REFUSED or error.filename is None:
                raise
            click.echo(f"polspec: error: {error.filename}: {error.strerror}", err=True)
            sys.exit(1)

    def main(self, args=None, *rest, **kwargs):
        # SIGTERM (kill, timeout, systemd) ends a command through its cleanups, as Ctrl+C does:
        # an import or fetch cut short removes its work folder (gigabytes for a large model)
        # instead of leaving it in the cache. The worker installs its own handlers over this.
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _terminated)
        if isinstance(sys.stdout, io.TextIOWrapper) and sys.stdout.isatty():
            # A terminal in a locale without „ or a table's lines (Latin-2) shows them as ?; a file
            # or a pipe is told so below, not silently changed. JSON and exports write UTF-8
            # whatever the locale (cli/console.utf8_stdout).
            sys.stdout.reconfigure(errors="replace")
        try:
            _check_arguments(sys.argv[1:] if args is None else args)
        except PolspecError as error:
            click.echo(f"polspec: error: {error}", err=True)
            sys.exit(1)
        try:
            return super().main(args, *rest, **kwargs)
        except UnicodeEncodeError as error:
            unwritable = error.object[error.start:error.end]
            if _encodes(unwritable, sys.stdout.encoding or "utf-8"):
                raise  # not standard output's: a fault of polspec's own
            click.echo(f"polspec: error: standard output's encoding ({sys.stdout.encoding}) has no {unwritable!r}: "
                       "use a UTF-8 locale (LC_ALL=C.UTF-8), or --json, which is UTF-8 whatever the locale", err=True)
            sys.exit(1)
        except OSError as error:  # raised outside invoke too: --help writes while parsing
            if error.errno not in _CANNOT_WRITE:
                raise
            # What stdout still buffers would fail again at exit, as a second traceback.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            where = f" {error.filename}" if error.filename else " the output"
            click.echo(f"polspec: error: cannot write{where}: {error.strerror}", err=True)
            sys.exit(1)


def _check_arguments(arguments) -> None:
    """Refuse an argument that is not UTF-8 (a Latin-2 name from an old script) before anything
    runs: names, prompts and queries end up in the database or the queue, which store text
    alone, and a path is held to the same rule rather than to one of its own."""
    from polspec.decoding.prompts import check_text

    for argument in arguments:
        try:
            argument.encode("utf-8")
        except UnicodeEncodeError:
            # Python hands on a byte that is not UTF-8 as a surrogate U+DC80-U+DCFF: shown as the byte
            shown = "".join(f"\\x{ord(char) - 0xdc00:02x}" if "\udc80" <= char <= "\udcff" else char
                            for char in argument[:40])
            check_text(argument, f"the argument '{shown}{'...' if len(argument) > 40 else ''}'")


def _encodes(text: str, encoding: str) -> bool:
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        return False
    return True


def _terminated(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


_CANNOT_WRITE = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG}
_PATH_REFUSED = {errno.EACCES, errno.EPERM, errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.EROFS}


@click.group(cls=PolspecGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="polspec")
def main() -> None:
    """Fast Polish generation with cross-tokenizer speculative decoding on MLX.

    \b
    Start with:
      polspec doctor                      is the backend fast and the queue reachable?
      polspec models list                 which models are known, which are cached
      polspec models fetch gemma3-270m    fetch and import an offline model

    Environment: POLSPEC_HOME (caches and data, default ~/.cache/polspec),
    POLSPEC_DEVICE (cpu|gpu), POLSPEC_DTYPE (float32|float16|bfloat16|native),
    POLSPEC_REDIS_URL, POLSPEC_DB_URL, POLSPEC_DB_BUSY_TIMEOUT_MS, POLSPEC_MODEL_CACHE_GB,
    POLSPEC_BLAS (Linux); README.md's Configuration table says what each does.
    """


def _register() -> None:
    from polspec.cli import control, db, demo, doctor, enqueue, generate, models, report, results, status, worker

    main.add_command(generate.generate)
    main.add_command(enqueue.enqueue)
    main.add_command(worker.worker)
    main.add_command(status.status)
    main.add_command(results.results)
    main.add_command(report.report)
    main.add_command(control.recover)
    main.add_command(control.cancel)
    main.add_command(control.retry)
    main.add_command(models.models)
    main.add_command(db.db)
    main.add_command(doctor.doctor)
    main.add_command(demo.demo)


_register()
