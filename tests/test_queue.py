"""The job system end to end, in this process: enqueue, a burst worker, status, results, export.

Real redis-server, real SQLite (and PostgreSQL where there is one: conftest's pg_url), real models.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from sqlalchemy import select

from polspec.cli import main
from polspec.decoding import DecodingParams, generate
from polspec.decoding.costmodel import UNPROBED_BATCH_SIZE, Probe
from polspec.decoding.probe_files import save_probe
from polspec.errors import DatabaseFailure, PolspecError
from polspec.jobs.control import _requeue_abandoned, recover
from polspec.jobs.queue import JOB_FUNCTION, job_id, queue_name
from polspec.report.summary import Window, joules_per_token
from polspec.store.engine import make_engine, session_scope
from polspec.processes import this_host_and_boot
from polspec.store.items import Worker, claim_item, database_id, fail_item
from polspec.store.queries import work_progress
from polspec.store.migrate import upgrade
from polspec.store.schema import EnergyWindow, Item, Result
from polspec.worker import batching, context, tasks
from polspec.worker import run as worker_run
from polspec.worker.model_cache import ModelCache
from polspec.worker.worker import PolspecWorker
from conftest import sqlite_url
from helpers import resident_worker_models, wait_for, work, worker_in_process

PROMPTS = [
    "Jaka jest stolica Czech?", "Ile nóg ma pająk?", "Kto napisał „Pana Tadeusza”?", "Gdzie leży Zakopane?",
    "Jak nazywa się najdłuższa rzeka w Polsce?", "Ile dni ma przestępny rok?", "Co to jest fotosynteza?",
    "Jakiego koloru jest chlorofil?", "Kiedy zaczęła się druga wojna światowa?", "Czym jest źdźbło trawy?",
]


@pytest.fixture
def env(sqlite_env: dict[str, str]) -> dict[str, str]:
    return sqlite_env


def cli(env: dict[str, str], *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env=env)
    return result.exit_code, result.output


def write_prompts(path: Path) -> Path:
    rows = [{"id": f"q{i:02d}", "prompt": prompt} for i, prompt in enumerate(PROMPTS)]
    rows.append({"id": "q10", "prompt": "Napisz zdanie o Krakowie."})
    rows.append({"id": "short", "prompt": "Wisła to", "max_tokens": 3})
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def results_by_key(env: dict[str, str]) -> dict[str, tuple[Item, Result | None]]:
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        rows = session.execute(select(Item, Result).outerjoin(Result, Result.item_id == Item.id)).all()
    engine.dispose()
    return {item.item_key: (item, result) for item, result in rows}


@pytest.mark.slow
def test_twelve_prompts_end_to_end_with_exports(any_db_env, tmp_path, gemma3):
    env = any_db_env
    source = write_prompts(tmp_path / "prompts.jsonl")
    code, output = cli(env, "enqueue", "generate", "--input", str(source), "--target", "gemma3-270m",
                       "--draft", "smollm2-135m", "--max-tokens", "5", "--name", "e2e", "--json")
    assert code == 0, output
    batch = json.loads(output)["batch"]
    assert work(env)

    stored = results_by_key(env)
    assert len(stored) == 12
    for key, (item, result) in stored.items():
        assert item.status == "done" and item.attempts == 1 and result is not None, (key, item.last_error)
        assert result.generated_tokens == (3 if key == "short" else 5) or result.metrics["finish_reason"] == "stop"
        assert result.metrics["rounds"] > 0 and result.metrics["draft_tokens"] > 0
        assert result.acceptance_rate is not None and 0 <= result.acceptance_rate <= 1
        assert result.energy_joules is None and result.energy_unavailable_reason
        assert result.versions["target"]["alias"] == "gemma3-270m" and result.versions["draft"]["alias"] == "smollm2-135m"
        assert result.timings["decode_s"] > 0
    # The worker's output is the decoder library's: greedy speculative equals greedy target-only.
    alone = generate(gemma3, None, PROMPTS[0], DecodingParams(max_tokens=5))
    assert stored["q00"][1].token_ids == alone.token_ids

    code, output = cli(env, "status", str(batch), "--json")
    progress = json.loads(output)
    assert progress["status"] == "done" and progress["done"] == 12 and progress["queued"] == 0
    assert (progress["target"], progress["drafts"]) == ("gemma3-270m", ["smollm2-135m"])
    assert progress["tokens_per_s"] > 0 and progress["aggregate_tokens_per_s"] > 0
    code, output = cli(env, "status", "--watch", "--interval", "0.1")  # returns once nothing is left to run
    assert code == 0 and "e2e" in output and "100%" in output

    csv_file, jsonl_file = tmp_path / "out.csv", tmp_path / "out.jsonl"
    assert cli(env, "results", "export", str(batch), "--format", "csv", "--output", str(csv_file))[0] == 0
    assert cli(env, "results", "export", str(batch), "--format", "jsonl", "--output", str(jsonl_file))[0] == 0
    assert csv_file.read_bytes().startswith(b"\xef\xbb\xbf")  # spreadsheets read it as UTF-8
    with open(csv_file, encoding="utf-8-sig", newline="") as handle:
        from_csv = {row["id"]: row for row in csv.DictReader(handle)}
    from_jsonl = {row["id"]: row for row in map(json.loads, jsonl_file.read_text(encoding="utf-8").splitlines())}
    assert set(from_csv) == set(from_jsonl) == set(stored)
    for key, (item, result) in stored.items():
        assert from_jsonl[key]["text"] == from_csv[key]["text"] == result.text
        assert from_jsonl[key]["prompt"] == item.prompt and from_jsonl[key]["messages"] == item.messages
        assert float(from_csv[key]["acceptance_rate"]) == pytest.approx(result.acceptance_rate)
        # What decoded it: greedy, so the requested verify=auto ran as exact match.
        assert (from_jsonl[key]["draft"], from_jsonl[key]["k"], from_jsonl[key]["verify"]) == ("smollm2-135m", 2, "exact")
        assert from_jsonl[key]["finish_reason"] == result.metrics["finish_reason"]
        # Enough to rerun and analyse it alone: the weights, every setting, what its rounds did.
        assert (from_jsonl[key]["target_sha256"], from_jsonl[key]["draft_sha256"]) == (
            result.versions["target"]["sha256"], result.versions["draft"]["sha256"])
        assert (from_jsonl[key]["prefix"], from_jsonl[key]["partial_word"]) == (item.params["prefix"], "verify")
        assert (from_jsonl[key]["rounds"], from_jsonl[key]["draft_tokens"]) == (
            result.metrics["rounds"], result.metrics["draft_tokens"])
        assert int(from_csv[key]["rounds"]) == result.metrics["rounds"]
    assert from_csv["q02"]["prompt"] == "Kto napisał „Pana Tadeusza”?"

    code, output = cli(env, "results", "sql", "SELECT count(*) AS n FROM results", "--json")
    assert code == 0 and json.loads(output) == {"n": 12}
    code, output = cli(env, "results", "sql", "DELETE FROM results")
    assert code == 1 and output.startswith("polspec: error:") and output.count("\n") == 1
    code, output = cli(env, "results", "show", str(batch), "q01", "--json")
    assert json.loads(output)["text"] == stored["q01"][1].text


@pytest.mark.slow
def test_failed_items_keep_their_reason_and_retry_runs_them_again(env, tmp_path):
    source = tmp_path / "p.jsonl"
    source.write_text('{"id": "ok", "messages": [{"role": "user", "content": "Co to jest Wisła?"}]}\n'
                      '{"id": "too-long", "prompt": "Wisła to", "max_tokens": 100000}\n', encoding="utf-8")
    # Queued from a machine without the model's files, which cannot count the prompt's tokens:
    # where it can, enqueue refuses the item at once (test_enqueue.py).
    queue_machine = {**env, "POLSPEC_HOME": str(tmp_path / "queue-machine")}
    code, output = cli(queue_machine, "enqueue", "generate", "--input", str(source), "--target", "smollm2-135m",
                       "--max-tokens", "4", "--json")
    batch = json.loads(output)["batch"]
    work(env)
    stored = results_by_key(env)
    assert stored["ok"][0].status == "done" and stored["ok"][1].prompt_tokens > 10  # the chat template applied
    failed = stored["too-long"][0]
    assert failed.status == "failed" and failed.attempts == 1 and stored["too-long"][1] is None
    assert "100000 more were asked for" in failed.last_error  # decided once: not retried by RQ
    code, output = cli(env, "status", str(batch), "--json")
    assert json.loads(output)["status"] == "failed"
    code, output = cli(env, "results", "list", "--status", "failed", "--json")
    assert [json.loads(line)["id"] for line in output.splitlines()] == ["too-long"]

    code, output = cli(env, "retry", str(batch), "--failed")
    assert code == 0 and "1 failed item queued again" in output
    work(env)
    again = results_by_key(env)["too-long"][0]
    assert again.status == "failed" and again.attempts == 2


@pytest.mark.slow
def test_cancel_drops_queued_items_and_their_jobs(env, tmp_path):
    code, output = cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "4", "--target",
                       "smollm2-135m", "--max-tokens", "4", "--json")
    batch = json.loads(output)["batch"]
    connection = redis.Redis.from_url(env["POLSPEC_REDIS_URL"])
    queue = Queue(queue_name("smollm2-135m"), connection=connection, serializer=JSONSerializer)
    assert queue.count == 4
    code, output = cli(env, "cancel", str(batch))
    assert code == 0 and "4 queued items dropped" in output
    assert queue.count == 0
    code, output = cli(env, "cancel", str(batch))
    assert code == 0 and output == f"batch {batch} was cancelled already; polspec retry {batch} --cancelled resumes it\n"
    assert not work(env)
    assert {item.status for item, _ in results_by_key(env).values()} == {"cancelled"}
    code, output = cli(env, "recover")
    assert "nothing to recover" in output
    code, output = cli(env, "retry", str(batch), "--failed")
    assert code == 1 and output == (f"polspec: error: batch {batch} is cancelled; polspec retry {batch} --cancelled "
                                    "resumes it (with --failed, its failed items too)\n")
    assert json.loads(cli(env, "status", str(batch), "--json")[1])["status"] == "cancelled"
    code, output = cli(env, "status", str(batch))
    row = next(line for line in output.splitlines() if "│ generate " in line)
    cells = [cell.strip() for cell in row.strip("│").split("│")]
    assert cells[3:11] == ["cancelled", "smollm2-135m", "░" * 12 + "   0%", "0", "0", "4", "0", "0"], output

    code, output = cli(env, "retry", str(batch), "--cancelled")  # resume the cancelled batch
    assert code == 0 and "4 cancelled items queued again" in output
    assert queue.count == 4
    assert json.loads(cli(env, "status", str(batch), "--json")[1])["status"] == "queued"  # no worker yet
    assert work(env)
    assert {item.status for item, result in results_by_key(env).values() if result} == {"done"}
    assert json.loads(cli(env, "status", str(batch), "--json")[1])["status"] == "done"
    code, output = cli(env, "cancel", str(batch))
    assert code == 1 and f"batch {batch} has finished (done); there is nothing to cancel" in output
    assert json.loads(cli(env, "status", str(batch), "--json")[1])["status"] == "done"


def test_status_watch_into_a_pipe_prints_each_change_as_it_comes(env):
    cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "2", "--target", "smollm2-135m")
    watch = subprocess.Popen([sys.executable, "-c", "from polspec.cli import main; main()", "status", "--watch",
                              "--interval", "0.2"], env=os.environ | env, stdout=subprocess.PIPE, text=True)
    deadline = threading.Timer(60, watch.kill)  # should the table never come, the test fails, not hangs
    deadline.start()
    seen = []
    for line in watch.stdout:  # the first table arrives while the watch goes on, not at its end
        seen.append(line)
        if "queued" in line and "smollm2-135m" in line:
            break
    assert watch.poll() is None, "".join(seen)
    assert cli(env, "cancel", "1")[0] == 0
    rest, _ = watch.communicate(timeout=30)
    deadline.cancel()
    assert watch.returncode == 0 and "cancelled" in rest and rest.count("polspec batches") == 1


def test_status_interval_without_watch_says_it_changes_nothing(env):
    cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "1", "--target", "smollm2-135m")
    once = CliRunner().invoke(main, ["status", "--json", "--interval", "5"], env=env)
    assert once.exit_code == 0 and once.stderr == "note: --interval has no effect without --watch\n"
    assert json.loads(once.stdout)["status"] == "queued"


def test_status_watch_json_gives_every_batch_again_on_each_change(env):
    cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "2", "--target", "smollm2-135m")
    watch = subprocess.Popen([sys.executable, "-c", "from polspec.cli import main; main()", "status", "--watch",
                              "--json", "--interval", "0.2"], env=os.environ | env, stdout=subprocess.PIPE, text=True)
    deadline = threading.Timer(60, watch.kill)
    deadline.start()
    first = json.loads(watch.stdout.readline())  # out while the watch goes on
    assert (first["batch"], first["status"]) == (1, "queued") and watch.poll() is None
    assert cli(env, "cancel", "1")[0] == 0
    rest, _ = watch.communicate(timeout=30)
    deadline.cancel()
    assert watch.returncode == 0 and [json.loads(line)["status"] for line in rest.splitlines()] == ["cancelled"]


def test_recover_leaves_an_item_claimed_after_it_read_it(env):
    cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "1", "--target", "smollm2-135m")
    engine = make_engine(env["POLSPEC_DB_URL"])
    item_id = next(iter(results_by_key(env).values()))[0].id
    claim_item(engine, item_id, Worker("elsewhere", 1))
    with session_scope(engine) as session:
        seen = session.get(Item, item_id)  # what recover read: running, its worker since gone
    claim_item(engine, item_id, Worker("elsewhere", 2), lease_s=0)  # a worker takes it over meanwhile
    assert not _requeue_abandoned(engine, seen)
    with session_scope(engine) as session:
        item = session.get(Item, item_id)
        assert (item.status, item.worker_pid, item.attempts) == ("running", 2, 2)
    assert _requeue_abandoned(engine, item)
    engine.dispose()


def test_a_worker_s_own_recover_requeues_what_it_left_behind_without_waiting_for_the_lease(env):
    """A database that failed as a worker finished an item left it running under that worker,
    its lease fresh, while RQ retried its job, and another worker skipped the job (running
    elsewhere): only a recover after the lease ran out gave it a job, in a long sweep often at
    its end. A worker's own recover knows what it decodes: its other running items are left
    behind, and go back to the queue at once, with no stop counted against them."""
    cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "2", "--target", "smollm2-135m")
    engine = make_engine(env["POLSPEC_DB_URL"])
    connection = redis.Redis.from_url(env["POLSPEC_REDIS_URL"])
    queue = Queue(queue_name("smollm2-135m"), connection=connection, serializer=JSONSerializer)
    me = Worker.this_process()
    left, decoding = sorted(item.id for item, _ in results_by_key(env).values())
    for item_id in (left, decoding):
        claim_item(engine, item_id, me)
        queue.remove(job_id(database_id(engine), item_id))  # taken by the worker
    assert recover(engine, connection, me=me).total == 0  # polspec recover sees a live worker's fresh lease
    assert recover(engine, connection, me=me, holding={decoding}).reasons == {"left behind by this worker": 1}
    with session_scope(engine) as session:
        item = session.get(Item, left)
        assert (item.status, item.stops, item.last_error) == (
            "queued", 0, "left behind by its worker (the database failed as it finished)")
        assert session.get(Item, decoding).status == "running"
    assert queue.get_job_ids() == [job_id(database_id(engine), left)]
    engine.dispose()


def test_an_item_whose_worker_stopped_on_every_try_fails_instead_of_running_again(env):
    """A prompt that gets its worker killed (out of memory) is tried three times, as one whose
    error repeats is: recover used to requeue it for ever, taking worker after worker down. An
    item retried after ordinary errors whose worker then stopped once runs again; so does the
    failed one after polspec retry (which gave it one try, not three)."""
    cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "2", "--target", "smollm2-135m")
    engine = make_engine(env["POLSPEC_DB_URL"])
    connection = redis.Redis.from_url(env["POLSPEC_REDIS_URL"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    killed_worker, me = Worker(this_host_and_boot(), gone.pid), Worker.this_process()  # a pid no process has
    retried, killing = sorted(item.id for item, _ in results_by_key(env).values())
    for _ in range(2):
        claim_item(engine, killing, killed_worker)
        assert recover(engine, connection).reasons == {"worker gone": 1}
    claim_item(engine, killing, killed_worker)
    for _ in range(2):  # two errors, each retried
        claim_item(engine, retried, me)
        fail_item(engine, retried, me, "MemoryError: out of memory", final=False)
    claim_item(engine, retried, killed_worker)
    code, output = cli(env, "recover")
    assert (code, output) == (0, "re-enqueued 1 item (1 worker gone); failed 1 item whose worker stopped while "
                                 "running it, 3 times (killed for memory?); run polspec worker to finish them\n")
    with session_scope(engine) as session:
        again = session.get(Item, retried)
        assert (again.status, again.attempts, again.stops) == ("queued", 3, 1)
        failed = session.get(Item, killing)
        assert (failed.status, failed.stops, failed.last_error) == \
            ("failed", 3, "its worker stopped while running it, 3 times (killed for memory?)")
        assert failed.batch.status == "running" and failed.finished_at is not None
        batch_id = failed.batch_id
    assert cli(env, "retry", str(batch_id), "--failed") == (0, f"batch {batch_id}: 1 failed item queued again\n")
    claim_item(engine, killing, killed_worker)  # retried, it has its three tries again: a stop requeues it
    assert recover(engine, connection).reasons == {"worker gone": 1}
    engine.dispose()


def test_recover_marks_cancelled_a_running_item_of_a_cancelled_batch_whose_worker_stopped(env):
    """A worker killed mid-item, then polspec cancel: the item read running for ever (cancel
    drops queued items only, and recover left cancelled batches alone); now it is cancelled,
    and retry --cancelled runs it again with the rest."""
    cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "2", "--target", "smollm2-135m")
    engine = make_engine(env["POLSPEC_DB_URL"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    running, _ = sorted(item.id for item, _ in results_by_key(env).values())
    claim_item(engine, running, Worker(this_host_and_boot(), gone.pid))
    with session_scope(engine) as session:
        batch_id = session.get(Item, running).batch_id
    assert cli(env, "cancel", str(batch_id)) == (0, f"batch {batch_id} cancelled (1 queued item dropped)\n")
    assert cli(env, "recover") == (0, "marked 1 item of cancelled batches cancelled, whose worker stopped while "
                                      "running it\n")
    with session_scope(engine) as session:
        item = session.get(Item, running)
        assert (item.status, item.stops, item.batch.status) == ("cancelled", 1, "cancelled")
        assert item.finished_at is not None
    assert cli(env, "recover") == (0, "nothing to recover: every unfinished item has a job\n")
    assert cli(env, "retry", str(batch_id), "--cancelled") == (0, f"batch {batch_id}: 2 cancelled items queued again\n")
    engine.dispose()


def test_an_idle_worker_gives_a_job_to_items_redis_lost_at_its_maintenance(env):
    """Redis restarted without its data while a worker waited for work: the items waited for
    someone to type polspec recover. Maintenance (every 10-15 minutes) recovers them once the
    worker's queues are empty; not while they hold work, nor at the start, which recovered."""
    cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "3", "--target", "smollm2-135m")
    connection = redis.Redis.from_url(env["POLSPEC_REDIS_URL"])
    queue = Queue(queue_name("smollm2-135m"), connection=connection, serializer=JSONSerializer)
    engine = make_engine(env["POLSPEC_DB_URL"])
    context.install(context.WorkerContext(engine, database_id(engine), ModelCache(), Worker.this_process(), None,
                                          "no meter in this test"))
    try:
        worker = PolspecWorker([queue.name], connection=connection)
        worker.run_maintenance_tasks()  # the first, at the start: run_worker recovered just before
        lost = queue.get_job_ids()[0]
        connection.lrem(queue.key, 1, lost)
        connection.delete(f"rq:job:{lost}")
        worker.run_maintenance_tasks()  # its queue holds jobs: workers are busy, and recover would be slow
        assert queue.count == 2
        connection.flushdb()
        worker.run_maintenance_tasks()
        assert sorted(queue.get_job_ids()) == sorted(job_id(database_id(engine), item.id)
                                                     for item, _ in results_by_key(env).values())
    finally:
        context.install(None)
        engine.dispose()


# A worker that RQ has given a job, killed before it claims the job's item.
STARTED_THEN_KILLED = """
import os, sys, redis
from polspec.worker.worker import PolspecWorker
worker = PolspecWorker([sys.argv[2]], connection=redis.Redis.from_url(sys.argv[1]))
worker.register_birth()
job, queue = worker.dequeue_job_and_maintain_ttl(timeout=1)
worker.prepare_execution(job)
worker.prepare_job_execution(job)
os._exit(0)
"""


def test_recover_gives_a_job_whose_worker_was_killed_before_its_claim_to_another(env):
    """RQ retries such a job once its registry entry expires and a worker's maintenance comes
    by: a burst run ended without the item. A job started by a live worker is left to it."""
    cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "2", "--target", "smollm2-135m")
    connection = redis.Redis.from_url(env["POLSPEC_REDIS_URL"])
    queue = Queue(queue_name("smollm2-135m"), connection=connection, serializer=JSONSerializer)
    killed, taken = queue.get_job_ids()
    subprocess.run([sys.executable, "-c", STARTED_THEN_KILLED, env["POLSPEC_REDIS_URL"], queue.name], check=True)
    live = PolspecWorker([queue.name], connection=connection)
    live.register_birth()
    job = live.dequeue_job_and_maintain_ttl(timeout=1)[0]
    live.prepare_execution(job)
    live.prepare_job_execution(job)
    assert {Job.fetch(id_, connection=connection).get_status() for id_ in (killed, taken)} == {JobStatus.STARTED}
    code, output = cli(env, "recover")
    assert (code, output) == (0, "re-enqueued 1 item (1 job's worker gone); run polspec worker to finish them\n")
    assert queue.get_job_ids() == [killed]
    connection.delete(live.key)  # expired while Redis was away, say: a heartbeat rebuilds it without host and pid
    live.heartbeat()
    assert "nothing to recover" in cli(env, "recover")[1]
    connection.delete(live.key)  # RQ's record of a worker on another host expired: it stopped minutes ago
    assert cli(env, "recover")[1].startswith("re-enqueued 1 item (1 job's worker gone)")
    assert queue.get_job_ids() == [killed, taken]


@pytest.mark.slow
def test_flushed_redis_is_rebuilt_from_the_database_by_recover(env):
    code, output = cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "5", "--target",
                       "smollm2-135m", "--max-tokens", "4", "--json")
    assert code == 0
    redis.Redis.from_url(env["POLSPEC_REDIS_URL"]).flushall()
    code, output = cli(env, "recover")
    assert code == 0 and "re-enqueued 5 items (5 job missing)" in output
    code, output = cli(env, "recover")
    assert "nothing to recover" in output  # a second run finds every item with its job
    assert work(env, queues=("smollm2-135m",))
    stored = results_by_key(env)
    assert len(stored) == 5 and all(item.status == "done" and result for item, result in stored.values())


@pytest.mark.slow
def test_a_model_that_fails_to_load_fails_its_items_and_the_worker_goes_on(env, home_with_models):
    (home_with_models / "models.toml").write_text(
        '[models.broken]\nsource = "dir:/nonexistent/model"\narchitecture = "llama"\ntokenizer_family = "x"\n')
    cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "2", "--target", "broken")
    cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "1", "--target", "smollm2-135m",
        "--max-tokens", "4")
    assert work(env)
    by_batch = {}
    for item, result in results_by_key(env).values():
        by_batch.setdefault(item.batch_id, []).append(item)
    broken, fine = by_batch[1], by_batch[2]
    assert all(item.status == "failed" and "broken failed to load" in item.last_error for item in broken)
    assert fine[0].status == "done"


OLD_JOB_FUNCTION = "polspec.jobs.tasks.run_item"  # where the job function lived until it moved into worker/


def requeue_as_an_older_polspec_did(env: dict[str, str], target: str) -> list[str]:
    """Replace every queued job of ``target`` by one naming the job function's old path."""
    connection = redis.Redis.from_url(env["POLSPEC_REDIS_URL"])
    queue = Queue(queue_name(target), connection=connection, serializer=JSONSerializer)
    ids = queue.get_job_ids()
    for job in Job.fetch_many(ids, connection=connection, serializer=JSONSerializer):
        job.delete()
        queue.enqueue(OLD_JOB_FUNCTION, *job.args, job_id=job.id)
    return ids


def test_recover_gives_jobs_queued_under_the_old_function_path_a_current_one(env):
    cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "2", "--target", "smollm2-135m")
    ids = requeue_as_an_older_polspec_did(env, "smollm2-135m")
    code, output = cli(env, "recover")
    assert code == 0 and "re-enqueued 2 items (2 job of an older polspec)" in output
    connection = redis.Redis.from_url(env["POLSPEC_REDIS_URL"])
    queue = Queue(queue_name("smollm2-135m"), connection=connection, serializer=JSONSerializer)
    assert queue.get_job_ids() == ids
    assert {job.func_name for job in queue.get_jobs()} == {JOB_FUNCTION}
    assert "nothing to recover" in cli(env, "recover")[1]


def test_recover_tells_a_job_out_of_its_queue_an_unreadable_one_and_an_ended_one_from_a_waiting_one(env):
    cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "4", "--target", "smollm2-135m")
    connection = redis.Redis.from_url(env["POLSPEC_REDIS_URL"])
    queue = Queue(queue_name("smollm2-135m"), connection=connection, serializer=JSONSerializer)
    out_of_queue, unreadable, ended, waiting = queue.get_job_ids()
    connection.lrem(queue.key, 0, out_of_queue)
    connection.hset(Job.key_for(unreadable), "data", b"not a job")
    connection.lrem(queue.key, 0, ended)
    connection.hset(Job.key_for(ended), "status", JobStatus.FINISHED.value)
    code, output = cli(env, "recover")
    assert code == 0 and ("re-enqueued 3 items (1 job not in its queue, 1 job unreadable, 1 job finished)"
                          in output), output
    # each item once, the one left waiting where it was, the rest after it in enqueue order
    assert queue.get_job_ids() == [waiting, out_of_queue, unreadable, ended]
    assert {job.func_name for job in queue.get_jobs()} == {JOB_FUNCTION}
    assert "nothing to recover" in cli(env, "recover")[1]


@pytest.mark.slow
def test_a_job_queued_under_the_old_function_path_still_runs(env):
    cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "1", "--target", "smollm2-135m",
        "--max-tokens", "2")
    requeue_as_an_older_polspec_did(env, "smollm2-135m")
    assert work(env)  # a worker recovers before it takes jobs
    assert [item.status for item, result in results_by_key(env).values() if result] == ["done"]


@pytest.mark.slow
def test_the_workers_own_steps_show_at_log_level_info_and_not_by_default(env, monkeypatch):
    enqueue = ["enqueue", "generate", "--dataset", "pl-short", "--limit", "1", "--target", "smollm2-135m",
               "--max-tokens", "2"]
    cli(env, *enqueue)
    said = worker_in_process(env, "--burst", "--log-level", "INFO")  # --batch auto: target-only work has no probe
    assert re.search(rf"^\d\d:\d\d:\d\d decoding smollm2-135m in batches of up to {UNPROBED_BATCH_SIZE}$", said,
                     re.MULTILINE), said
    cli(env, *enqueue)
    said = worker_in_process(env, "--burst", "--batch", "2")
    assert "serving" in said and "decoding" not in said, said
    # The batch's step must leave an item its job's time: no step fits in a trillionth of it.
    monkeypatch.setattr(batching, "STEP_SHARE_OF_TIMEOUT", 1e-12)
    cli(env, *enqueue)
    said = worker_in_process(env, "--burst", "--log-level", "INFO")
    assert re.search(r"^\d\d:\d\d:\d\d decoding smollm2-135m in batches of up to 1$", said, re.MULTILINE), said


@pytest.mark.slow
def test_enqueue_and_the_worker_agree_on_chat_mode(env, home_with_models, smollm2):
    # A model directory registered by hand with no chat_template key: the registry says it has
    # no template, its tokenizer has one. Enqueue went by the registry (raw mode, so a draft
    # without a template will do) and the decoder by the tokenizer (chat mode, so every item
    # failed on the draft's missing template); both go by the registry now.
    (home_with_models / "models.toml").write_text(
        f'[models.smol-dir]\nsource = "dir:{smollm2.path}"\narchitecture = "llama"\neos_tokens = ["<|im_end|>"]\n')
    code, output = cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "1", "--target", "smol-dir",
                       "--draft", "gemma3-270m", "--max-tokens", "4")
    assert code == 0, output
    assert work(env)
    [(item, result)] = results_by_key(env).values()
    assert item.status == "done", item.last_error
    raw = generate(smollm2, None, item.prompt, DecodingParams(max_tokens=4), chat=False)
    assert result.token_ids == raw.token_ids


def test_worker_on_a_misspelled_queue_is_a_one_line_error(env):
    upgrade(env["POLSPEC_DB_URL"])
    code, output = cli(env, "worker", "--burst", "--queue", "gema3-270m")
    assert code == 1
    assert output == ("polspec: error: unknown model alias 'gema3-270m'; did you mean gemma3-270m? "
                      "(polspec models list shows them all)\n")
    assert work(env, queues=("polspec-gemma3-270m",)) is False  # a queue name is taken as it is: nothing queued


def test_a_misspelled_queue_fails_before_the_worker_recovers_anything(env):
    cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "1", "--target", "smollm2-135m")
    queue = Queue(queue_name("smollm2-135m"), connection=redis.Redis.from_url(env["POLSPEC_REDIS_URL"]),
                  serializer=JSONSerializer)
    queue.empty()  # Redis lost the item's job: a worker's recover would queue it again
    code, output = cli(env, "worker", "--burst", "--queue", "smol")
    assert code == 1 and output.startswith("polspec: error: unknown model alias 'smol'")
    assert queue.count == 0  # the failed start wrote nothing


def test_a_worker_stops_listening_for_commands_at_once(env):
    # RQ's command thread polls once a minute, and a worker's teardown waits for it: after the
    # UNSUBSCRIBE the thread sleeps a whole poll before it sees the stop. Under the suite's
    # load that cost a minute per worker exit (the end of every burst, Ctrl+C).
    connection = redis.Redis.from_url(env["POLSPEC_REDIS_URL"])
    worker = PolspecWorker([queue_name("smollm2-135m")], connection=connection)
    worker.subscribe()
    worker.pubsub.unsubscribe()
    wait_for(lambda: not worker.pubsub.subscribed, 10, "the command channel to be left")
    time.sleep(0.2)  # the thread is back in its poll, not subscribed: what teardown meets
    worker.unsubscribe()
    # RQ's unsubscribe waits a second for the thread: under RQ's own poll (60 s) it is still alive.
    assert not worker.pubsub_thread.is_alive()


def test_a_second_signal_during_the_first_one_s_handler_still_stops_the_worker(env):
    """The first SIGTERM's handler says it stops, then marks the stop; a second SIGTERM sent on
    seeing the line ran in between: its SystemExit, swallowed by RQ's job runner, left no
    stop marked, and the worker went on to the next item (RQ's loop ends on the mark)."""
    worker = PolspecWorker([queue_name("smollm2-135m")], connection=redis.Redis.from_url(env["POLSPEC_REDIS_URL"]))
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    worker.handle_warm_shutdown_request = lambda: worker.request_force_stop(signal.SIGTERM, None)  # the second lands
    try:
        with pytest.raises(SystemExit):
            worker.request_stop(signal.SIGTERM, None)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert worker._stop_requested


def test_worker_refuses_an_out_of_date_schema(env):
    with pytest.raises(PolspecError, match="no such file"):  # run db upgrade there? it may be a typo
        work(env)
    Path(env["POLSPEC_DB_URL"].removeprefix("sqlite:///")).parent.mkdir(parents=True)
    Path(env["POLSPEC_DB_URL"].removeprefix("sqlite:///")).touch()  # an empty database
    with pytest.raises(PolspecError, match="run polspec db upgrade"):
        work(env)
    code, output = cli(env, "worker", "--burst")
    assert code == 1 and "polspec db upgrade" in output and output.count("\n") == 1


def test_worker_refuses_functions_that_are_not_polspec_jobs(env):
    upgrade(env["POLSPEC_DB_URL"])
    connection = redis.Redis.from_url(env["POLSPEC_REDIS_URL"])
    queue = Queue(queue_name("smollm2-135m"), connection=connection, serializer=JSONSerializer)
    job = queue.enqueue("shutil.rmtree", "/nonexistent-polspec-test")
    work(env)
    job = Job.fetch(job.id, connection=connection, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.FAILED
    assert "'shutil.rmtree' is not a polspec job function" in job.latest_result().exc_string


@pytest.mark.slow
def test_a_job_from_another_database_is_not_run_against_this_one(env, tmp_path, caplog):
    other = dict(env, POLSPEC_DB_URL=f"sqlite:///{tmp_path / 'other.db'}")
    code, output = cli(other, "enqueue", "generate", "--dataset", "pl-short",
                       "--limit", "1", "--target", "smollm2-135m", "--max-tokens", "2", "--json")
    assert code == 0, output
    upgrade(env["POLSPEC_DB_URL"])
    work(env)
    # One line says what is wrong, with no traceback (it is the setup's fault, not the item's).
    said = [record for record in caplog.records if record.levelname in ("ERROR", "WARNING")]
    assert len(said) == 1 and said[0].exc_info is None
    assert said[0].getMessage().startswith("skipped item ") and "run the worker with the enqueuer's POLSPEC_DB_URL" in said[0].getMessage()
    assert results_by_key(env) == {}
    assert results_by_key(other)["short-001"][0].status == "queued"
    code, output = cli(other, "recover")  # its own database's recover gives it a new job
    assert code == 0 and "re-enqueued 1 item (1 job finished)" in output


@pytest.mark.slow
def test_demo_runs_the_main_job_with_a_private_redis(home_with_models, tmp_path, closed_port):
    env = {"POLSPEC_DB_URL": f"sqlite:///{tmp_path / 'demo.db'}", "POLSPEC_REDIS_URL": f"redis://127.0.0.1:{closed_port}/0"}
    with resident_worker_models():  # its two workers run in this process; loading is not what it shows
        code, output = cli(env, "demo", "--limit", "2", "--max-tokens", "4", "--batch", "2")
    assert code == 0, output
    assert "started a private redis-server" in output and "wiki-001" in output and "wiki-002" in output
    assert "batched, 2 at a time:" in output and "one at a time:" in output and "2 of 2 texts are identical" in output
    assert f"results are in sqlite:///{tmp_path / 'demo.db'}" in output
    assert (home_with_models / "redis" / "appendonlydir").is_dir()  # AOF on, data under POLSPEC_HOME
    with pytest.raises(redis.ConnectionError):  # and stopped afterwards
        redis.Redis.from_url(env["POLSPEC_REDIS_URL"]).ping()
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        done = session.execute(select(Item.batch_id, Item.item_key, Item.status, Result.batch_size).join(Result)).all()
    engine.dispose()
    assert sorted(done) == [(1, "wiki-001", "done", 2.0), (1, "wiki-002", "done", 2.0),
                            (2, "wiki-001", "done", 1.0), (2, "wiki-002", "done", 1.0)]


def test_the_demo_refuses_a_queue_that_holds_other_jobs(sqlite_env, isolated_home):
    """Its burst workers take every job on gemma3-270m's queue: on the user's Redis, hours of
    someone's work before its own. Refused before anything is fetched or queued."""
    code, output = cli(sqlite_env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "2")
    assert code == 0, output
    code, output = cli(sqlite_env, "demo", "--limit", "1")
    assert code == 1 and output == (
        f"polspec: error: the polspec-gemma3-270m queue at {sqlite_env['POLSPEC_REDIS_URL']} holds 2 job(s) already, "
        "which the demo's workers would run before its own: run the demo when it is empty, or on another Redis "
        "database (POLSPEC_REDIS_URL=redis://127.0.0.1:6379/1)\n")
    queue = Queue(queue_name("gemma3-270m"), connection=redis.Redis.from_url(sqlite_env["POLSPEC_REDIS_URL"]))
    assert queue.count == 2 and not (isolated_home / "models").exists()
    code, output = cli(sqlite_env, "status", "--json")
    assert code == 0 and len(output.splitlines()) == 1


class ClockMeter:
    """A stand-in for a power meter where none can be read (this machine has none): 10 W."""

    name = "clock"

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, started: float) -> float:
        return 10 * (time.perf_counter() - started)


class StretchClockMeter(ClockMeter):
    """A clock meter that keeps each stretch it was read over, as (began, ended) perf_counter times."""

    def __init__(self):
        self.stretches: list[tuple[float, float]] = []

    def stop(self, started: float) -> float:
        ended = time.perf_counter()
        self.stretches.append((started, ended))
        return 10 * (ended - started)


@pytest.mark.slow
def test_a_batch_that_decoded_an_item_it_did_not_keep_is_no_cell_energy(env, monkeypatch):
    """An item past its job's timeout leaves the batch without a result; the energy window
    still counts its tokens, so the kept result's share of the joules is not a measurement."""
    monkeypatch.setattr(worker_run, "open_meter", lambda device: (ClockMeter(), "a clock at 10 W"))
    for max_tokens in ("2000", "40"):  # the first one cannot finish within its timeout, at any speed
        code, output = cli(env, "enqueue", "generate", "--dataset", "pl-instruct", "--limit", "1", "--target",
                           "smollm2-135m", "--max-tokens", max_tokens, "--raw", "--json")
        assert code == 0, output
    jobs = Queue(queue_name("smollm2-135m"), connection=redis.Redis.from_url(env["POLSPEC_REDIS_URL"]),
                 serializer=JSONSerializer).get_jobs()
    jobs[0].timeout, jobs[0].retries_left = 1, 0  # fails for good when it times out: one batch holds both
    jobs[0].save()
    work(env, batch=2)
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        items = {item.id: item for item in session.scalars(select(Item))}
        kept = session.scalars(select(Result)).all()
        windows = {window.id: window for window in session.scalars(select(EnergyWindow))}
    engine.dispose()
    assert [items[job.args[1]].status for job in jobs] == ["failed", "done"] and len(kept) == 1
    shared = windows[kept[0].energy_window_id]  # the batch both decoded in, the timed-out item's first attempt
    assert shared.ended_at is not None and shared.energy_joules > 0 and shared.sequences == 2
    assert shared.generated_tokens > kept[0].generated_tokens and len(windows) == 1
    window = Window(shared.energy_joules, shared.generated_tokens, shared.sequences)
    assert joules_per_token(kept, {shared.id: window}) is None


@pytest.mark.slow
def test_a_batch_s_energy_leaves_out_its_waits_for_the_database(env, monkeypatch):
    """The meter ran on while a result waited for the database (for as long as it is down): the
    machine's idle joules were counted as the batch's decoding, and over an hour RAPL's counter
    could wrap unseen. Here each result's write waits; a clock meter counts 10 W and keeps the
    stretches it was read over, and none of them may hold a wait."""
    meter, waits = StretchClockMeter(), []
    monkeypatch.setattr(worker_run, "open_meter", lambda device: (meter, "a clock at 10 W"))
    store = batching.store_result

    def slow_store(*args, **kwargs):
        began = time.perf_counter()
        time.sleep(0.5)
        waits.append((began, time.perf_counter()))
        return store(*args, **kwargs)

    monkeypatch.setattr(batching, "store_result", slow_store)
    code, output = cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "2", "--target",
                       "smollm2-135m", "--max-tokens", "4", "--raw")
    assert code == 0, output
    assert work(env, batch=2)
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        window = session.scalars(select(EnergyWindow)).one()
    engine.dispose()
    assert window.sequences == 2 and window.energy_joules > 0
    assert len(waits) == 2 and meter.stretches
    assert window.energy_joules == pytest.approx(10 * sum(end - began for began, end in meter.stretches))
    overlapping = [(stretch, wait) for stretch in meter.stretches for wait in waits
                   if stretch[0] < wait[1] and wait[0] < stretch[1]]
    assert not overlapping


@pytest.mark.slow
def test_a_result_stored_past_the_job_s_timeout_is_kept(env, monkeypatch):
    """Alone (--batch 1) a job runs under RQ's timeout alarm, which was switched off only once a
    write had failed: a write that waited on a busy database past the timeout was rolled back by
    the alarm, and on the job's last try the decoded item failed. Here the write takes the whole
    timeout."""
    timeout_s = 6  # what a resident small model's 4 tokens take, many times over
    finish = tasks.finish_item

    def busy_database(*args, **kwargs):
        time.sleep(timeout_s)
        return finish(*args, **kwargs)

    monkeypatch.setattr(tasks, "finish_item", busy_database)
    code, output = cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "1", "--target",
                       "smollm2-135m", "--max-tokens", "4", "--raw")
    assert code == 0, output
    (job,) = Queue(queue_name("smollm2-135m"), connection=redis.Redis.from_url(env["POLSPEC_REDIS_URL"]),
                   serializer=JSONSerializer).get_jobs()
    job.timeout, job.retries_left = timeout_s, 0
    job.save()
    work(env, batch=1)
    ((item, result),) = results_by_key(env).values()
    assert (item.status, item.attempts, result is not None) == ("done", 1, True), item.last_error


@pytest.mark.slow
def test_a_second_delivery_of_an_item_decoding_in_the_batch_is_dropped(env):
    """A recover that read an item's job as queued while a batch took it queued it again, and
    the batch took it again: the claim passed (this worker held the item), the decoder refused
    it, and the item, decoding fine, was failed and its result dropped."""
    code, output = cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "2", "--target",
                       "smollm2-135m", "--max-tokens", "4", "--json")
    assert code == 0, output
    queue = Queue(queue_name("smollm2-135m"), connection=redis.Redis.from_url(env["POLSPEC_REDIS_URL"]))
    first = queue.get_job_ids()[0]
    queue.push_job_id(first)  # the first item: in the batch by the time the batch takes this
    assert work(env, batch=4)
    stored = results_by_key(env)
    assert [(item.status, item.attempts, result is not None) for item, result in stored.values()] == \
        [("done", 1, True)] * 2


@pytest.mark.slow
def test_a_failing_job_end_callback_fails_no_item_of_the_batch(env, tmp_path):
    """The worker's progress bar redraws from the database after every item, inside a batch's
    loop; when that read failed, the failure escaped the loop and every item still decoding
    was failed back to RQ (its work lost, a retry spent). What the bar reads
    (:func:`work_progress`) follows the items as they end."""
    rows = [{"id": "short", "prompt": PROMPTS[0], "max_tokens": 2}, {"id": "long", "prompt": PROMPTS[1], "max_tokens": 8}]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    code, output = cli(env, "enqueue", "generate", "--input", str(source), "--target", "smollm2-135m", "--raw")
    assert code == 0, output
    engine = make_engine(env["POLSPEC_DB_URL"])
    seen = [work_progress(engine, set())]

    def job_ended() -> None:
        seen.append(work_progress(engine, seen[0].batches))
        if len(seen) == 2:
            raise DatabaseFailure("the database went away for a moment")

    with resident_worker_models():
        assert worker_run.run_worker(worker_run.WorkerOptions(burst=True, batch=2, log_level="WARNING"),
                                     on_job_end=job_ended, db_url=env["POLSPEC_DB_URL"],
                                     redis_url=env["POLSPEC_REDIS_URL"])
    stored = results_by_key(env)
    assert {key: (item.status, item.attempts) for key, (item, _) in stored.items()} == \
        {"short": ("done", 1), "long": ("done", 1)}
    assert [progress.counts for progress in seen] == [{"queued": 2}, {"done": 1, "running": 1}, {"done": 2}]
    batch = stored["short"][0].batch_id
    assert seen[0].batches == {batch} and work_progress(engine, set()).batches == set()  # done: watched no more
    assert seen[-1].tokens == {batch: sum(result.generated_tokens for _, result in stored.values())} == {batch: 10}
    engine.dispose()


@pytest.mark.slow
def test_batched_worker_gives_the_texts_of_one_at_a_time(tmp_path, redis_url, home_with_models, monkeypatch):
    """Target-only and speculative items in one queue, finishing at different rounds (their own
    max_tokens), decoded by --batch 4 and by --batch 1 into two databases: the same texts.
    With a meter, --batch 1 measures each item and --batch 4 each batch as a whole."""
    monkeypatch.setattr(worker_run, "open_meter", lambda device: (ClockMeter(), "a clock at 10 W"))
    # The probe a single `generate --k auto` stores has no batch table: it once failed every
    # fixed-k item of a batched worker, which needs none.
    save_probe(Probe("gemma3-270m", "smollm2-135m", c=0.5, rho=(1.0,) * 9, tau=0.0))
    rows = [{"id": f"q{i}", "prompt": prompt, "max_tokens": 2 + i % 3} for i, prompt in enumerate(PROMPTS[:6])]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    texts = {}
    for batch in (4, 1):
        redis.Redis.from_url(redis_url).flushall()
        env = {"POLSPEC_DB_URL": sqlite_url(tmp_path / f"batch{batch}"), "POLSPEC_REDIS_URL": redis_url}
        for draft in ("none", "smollm2-135m"):
            code, output = cli(env, "enqueue", "generate", "--input", str(source), "--target", "gemma3-270m",
                               "--draft", draft, "--raw", "--name", f"draft-{draft}")
            assert code == 0, output
        assert work(env, batch=batch)
        engine = make_engine(env["POLSPEC_DB_URL"])
        with session_scope(engine) as session:
            stored = session.execute(select(Item, Result).join(Result, Result.item_id == Item.id)).all()
        engine.dispose()
        assert len(stored) == 12 and all(item.attempts == 1 for item, _ in stored)
        texts[batch] = {(item.batch_id, item.item_key): result.token_ids for item, result in stored}
        max_tokens = {row["id"]: row["max_tokens"] for row in rows}
        assert all(result.generated_tokens == max_tokens[item.item_key] for item, result in stored)  # no early EOS
        sizes = [result.batch_size for _, result in stored]
        if batch == 1:
            assert sizes == [1.0] * 12
            assert all(result.energy_joules > 0 and result.energy_window_id is None for _, result in stored)
        else:  # six items per pairing, four at a time: every item shared forwards, none with the other pairing
            assert all(1 < size <= 4 for size in sizes), sizes
            # One window per pairing's batch, holding its six items' tokens; no item has joules of its own.
            with session_scope(engine) as session:
                windows = {window.id: window for window in session.scalars(select(EnergyWindow))}
            by_window = {}
            for item, result in stored:
                assert result.energy_joules is None and result.energy_window_id in windows
                assert f"energy window {result.energy_window_id} holds the whole batch's joules" \
                    in result.energy_unavailable_reason
                by_window.setdefault(result.energy_window_id, set()).add(item.batch_id)
                assert result.energy_unavailable_reason.startswith("decoded in a batch of ")
            assert len(windows) == 2 and all(len(batches) == 1 for batches in by_window.values())
            for window in windows.values():
                kept = [result for _, result in stored if result.energy_window_id == window.id]
                assert (window.sequences, window.generated_tokens) == (6, sum(r.generated_tokens for r in kept))
                assert window.energy_source == "clock" and 0 < window.energy_joules
                assert window.energy_joules <= 10 * (window.ended_at - window.started_at).total_seconds()
            item, result = stored[0]
            window = windows[result.energy_window_id]
            code, output = cli(env, "results", "show", str(item.batch_id), item.item_key)
            assert code == 0 and (f"energy of its batch: window {window.id}, {window.energy_joules:.3g} J (clock) over "
                                  f"{window.generated_tokens} tokens of 6 sequences\n") in output
    assert texts[4] == texts[1]
