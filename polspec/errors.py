"""The one exception type that reaches users as a one-line message."""

import sys


class PolspecError(Exception):
    """A user-facing failure: bad input, a missing file, an unreachable service.

    The CLI prints ``str(error)`` on one line and exits non-zero, with no traceback.
    Everything else is a bug and keeps its traceback.
    """


class DatabaseProblem(PolspecError):
    """Something is wrong with the database at a URL (shown with its password hidden);
    ``reason`` says what, without the URL, for reports that name the URL already."""

    def __init__(self, shown_url: str, reason: str):
        super().__init__(f"database {shown_url}: {reason}")
        self.reason = reason


class DatabaseFailure(DatabaseProblem):
    """The database failed an operation (PEP 249 OperationalError): unreachable, restarted, locked
    past the busy timeout; on SQLite also bad SQL. The worker lets RQ retry the job on these
    rather than fail the item: the item is not at fault."""


def past_parser_limits(where: str, error: ValueError | RecursionError) -> PolspecError:
    """A user's JSON or TOML that Python's parser refuses for its size, not its syntax: a
    number of thousands of digits (:func:`sys.get_int_max_str_digits`) or nesting thousands deep."""
    what = "nesting too deep" if isinstance(error, RecursionError) else \
        f"a number of over {sys.get_int_max_str_digits()} digits"
    return PolspecError(f"{where}: cannot be read: {what}")


def not_utf8(where: str, error: UnicodeDecodeError) -> PolspecError:
    """A file that is not UTF-8, named with the line and column of its first bad byte."""
    data, at = error.object, error.start
    line, column = data.count(b"\n", 0, at) + 1, at - (data.rfind(b"\n", 0, at) + 1) + 1
    return PolspecError(f"{where}:{line}: not UTF-8 (byte 0x{data[at]:02x} at column {column})")
