"""The one exception type that reaches users as a one-line message."""


class PolspecError(Exception):
    """A user-facing failure: bad input, a missing file, an unreachable service.

    The CLI prints ``str(error)`` on one line and exits non-zero, with no traceback.
    Everything else is a bug and keeps its traceback.
    """
