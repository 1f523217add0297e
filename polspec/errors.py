"""The one exception type that reaches users as a one-line message."""


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
