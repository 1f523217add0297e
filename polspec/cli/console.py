"""The console that command output goes to: a terminal's width, or wide when redirected.

Rich assumes 80 columns off a terminal, which squeezes the tables of ``status``, ``results`` and
``models`` into truncated cells in a log file or a pipe; there they get room to print whole.
Markup and emoji codes are off: the cells are users' ids, names and generated text, and Rich
would read their square brackets (``[b]``, ``[/]``) as styles, or fail on them, and print
``:fire:`` as an emoji.
"""

from __future__ import annotations

from rich.console import Console

from polspec.settings import columns_set

REDIRECTED_WIDTH = 200


def output_console() -> Console:
    """A console on stdout; ``COLUMNS`` still wins when set."""
    console = Console(markup=False, emoji=False)
    if not console.is_terminal and not columns_set():
        console = Console(markup=False, emoji=False, width=REDIRECTED_WIDTH)
    return console
