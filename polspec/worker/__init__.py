"""The RQ worker that keeps models resident, the job function it runs (``tasks``), and the energy
meters it measures with."""

# Here rather than in ``worker.py`` so that the command line shows them without importing MLX,
# and the job function shares the pauses without importing the worker.
HEARTBEAT_INTERVAL_S = 10  # seconds between heartbeats while a job runs
HEARTBEAT_GRACE_S = 60  # how late a heartbeat may be before RQ counts the job as abandoned
FIRST_PAUSE_S = 0.5  # before the first try of Redis, or of the database, after an outage
WAIT_MAX_S = 30.0  # the longest pause between two tries
