"""The one exception type that reaches users as a one-line message."""


class PolspecError(Exception):
    """A user-facing failure: bad input, a missing file, an unreachable service.

    The CLI prints ``str(error)`` on one line and exits non-zero, with no traceback.
    Everything else is a bug and keeps its traceback.
    """


class DatabaseFailure(PolspecError):
    """The database failed an operation (PEP 249 OperationalError): unreachable, restarted, locked
    past the busy timeout; on SQLite also bad SQL. The worker lets RQ retry the job on these
    rather than fail the item: the item is not at fault."""
