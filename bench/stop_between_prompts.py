"""Stop a sweep's worker between two prompts, so that no prompt's cells are split across runs.

A sweep's speedups pair every result with the baseline of its prompt; a prompt whose cells ran
partly before a stop and partly after it (in another session, maybe on another machine)
compares two runs. This polls the sweep's database and, while a worker on this host runs the
last item of its prompt (the next item in enqueue order is a baseline), sends that worker
SIGTERM: the worker finishes the item and stops.

    python bench/stop_between_prompts.py [DATABASE_URL]    (default: POLSPEC_DB_URL)
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

from sqlalchemy import text

from polspec.errors import PolspecError
from polspec.store.engine import make_engine

LAST_OF_ITS_PROMPT = text("""
    select running.item_key, running.worker_pid from items running
    left join items following on following.id = running.id + 1
    left join cells on cells.id = following.cell_id
    where running.status = 'running' and running.worker_host = :host
      and (following.id is null or cells.baseline)
""")


def main(url: str | None) -> None:
    engine = make_engine(url, readonly=True)
    host = socket.gethostname()
    while True:
        with engine.connect() as connection:
            row = connection.execute(LAST_OF_ITS_PROMPT, {"host": host}).first()
        if row is not None and row.worker_pid is not None:
            try:
                os.kill(row.worker_pid, signal.SIGTERM)
            except ProcessLookupError:
                sys.exit(f"stop_between_prompts: worker {row.worker_pid} that ran {row.item_key} is gone "
                         "(polspec worker recovers its item)")
            print(f"SIGTERM to worker {row.worker_pid} while it runs {row.item_key}, the last item of its prompt",
                  flush=True)
            return
        time.sleep(2)


if __name__ == "__main__":
    if len(sys.argv) > 2 or sys.argv[1:] in (["-h"], ["--help"]):
        sys.exit(__doc__)
    try:
        main(sys.argv[1] if len(sys.argv) == 2 else None)
    except PolspecError as error:
        sys.exit(f"stop_between_prompts: {error}")
