"""Stop a sweep's worker between two prompts, so that no prompt's cells are split across runs.

A sweep's speedups pair every result with the baseline of its prompt; a prompt whose cells ran
partly before a stop and partly after it (in another session, maybe on another machine)
compares two runs. This polls a sweep's SQLite database and, while the running item is the
last of its prompt (the next item in enqueue order is a baseline), sends that item's worker
SIGTERM: the worker finishes the item and stops.

    python bench/stop_between_prompts.py docs/results/sweep-offline.db
"""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
import time

LAST_OF_ITS_PROMPT = """
    select running.id, running.item_key, running.worker_pid from items running
    left join items following on following.id = running.id + 1
    left join cells on cells.id = following.cell_id
    where running.status = 'running' and (following.id is null or cells.baseline)
"""


def main(path: str) -> None:
    if not os.path.isfile(path):
        sys.exit(f"stop_between_prompts: no SQLite database at {path}")
    database = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    while True:
        row = database.execute(LAST_OF_ITS_PROMPT).fetchone()
        if row is not None and row[2] is not None:
            os.kill(row[2], signal.SIGTERM)
            print(f"SIGTERM to worker {row[2]} while it runs {row[1]}, the last item of its prompt", flush=True)
            return
        time.sleep(2)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
