"""Work for the queue: what a batch asks for and how it gets to a worker.

- ``spec``: a generation request and its prompt lines, validated at the edge;
- ``datasets``: the built-in Polish sets, JSONL files and Hugging Face datasets;
- ``sweep``: a sweep file expanded into cells and items;
- ``enqueue``: batches and sweeps written to the database, then enqueued;
- ``queue``: Redis and RQ as polspec uses them (queue names, job ids, timeouts);
- ``control``: recover, cancel and retry, bringing Redis in line with the database;
- ``local_redis``: a private redis-server when none is running (for the demo).
"""
