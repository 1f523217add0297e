"""Where command output goes: the console, a terminal's width or wide when redirected, and
standard output as UTF-8 for JSON and exports.

Rich assumes 80 columns off a terminal, which squeezes the tables of ``status``, ``results`` and
``models`` into truncated cells in a log file or a pipe; there they get room to print whole.
Markup and emoji codes are off: the cells are users' ids, names and generated text, and Rich
would read their square brackets (``[b]``, ``[/]``) as styles, or fail on them, and print
``:fire:`` as an emoji.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TextIO

from rich.console import Console

from polspec.settings import columns_set

REDIRECTED_WIDTH = 200


def output_console() -> Console:
    """A console on stdout; ``COLUMNS`` still wins when set."""
    console = Console(markup=False, emoji=False)
    if not console.is_terminal and not columns_set():
        console = Console(markup=False, emoji=False, width=REDIRECTED_WIDTH)
    return console


def json_lines(objects: Iterable[dict]) -> None:
    """One JSON object a line on standard output, in UTF-8 (:func:`utf8_stdout`), for scripts."""
    with utf8_stdout() as stdout:
        for value in objects:
            stdout.write(json.dumps(value, ensure_ascii=False, default=str) + "\n")


@contextmanager
def utf8_stdout() -> Iterator[TextIO]:
    """Standard output as UTF-8 text without newline translation, whatever the locale: JSON and
    exports promise UTF-8, and a Polish ISO-8859-2 terminal has no en dash (where the console
    itself shows it as ``?``)."""
    sys.stdout.flush()
    stream = io.TextIOWrapper(sys.stdout.buffer, encoding="utf-8", newline="")
    try:
        yield stream
    finally:
        stream.flush()
        stream.detach()
