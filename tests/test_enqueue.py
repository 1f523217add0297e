"""``polspec enqueue generate``: what it writes, and every bad input refused with nothing written.

Real redis-server (our own, flushed per test) and real SQLite; no models are loaded here.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner
from rq import Queue
from sqlalchemy import event, func, select

from polspec.cli import main
from polspec.decoding import DecodingParams
from polspec.decoding.prompts import encode_request
from polspec.errors import PolspecError
from polspec.jobs.control import cancel, retry
from polspec.jobs import enqueue as enqueue_module
from polspec.jobs.queue import (JOB_TIMEOUT_BASE_S, JOB_TIMEOUT_PER_TOKEN_S, delete_jobs, enqueue_items, fetch_jobs,
                                job_id)
from polspec.store.engine import make_engine, session_scope
from polspec.store.items import Worker, claim_item, database_id, finish_item
from polspec.store.migrate import upgrade
from polspec.store.schema import Batch, Item, Result, Status
from helpers import new_result, wait_for

GOOD = [
    {"id": "a", "prompt": "Jaka jest stolica Czech?"},
    {"id": "b", "messages": [{"role": "system", "content": "Odpowiadaj krótko."},
                             {"role": "user", "content": "Napisz haiku."}, {"role": "assistant", "content": "O czym?"},
                             {"role": "user", "content": "O Wiśle."}], "max_tokens": 5},
    {"id": 3, "prompt": "Ile nóg ma pająk?", "temperature": 0.7, "seed": 1},
]


@pytest.fixture
def env(tmp_path: Path, redis_url: str) -> dict[str, str]:
    redis.Redis.from_url(redis_url).flushall()
    return {"POLSPEC_DB_URL": f"sqlite:///{tmp_path / 'db' / 'polspec.db'}", "POLSPEC_REDIS_URL": redis_url}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n"
                            for row in rows), encoding="utf-8")
    return path


def invoke(env: dict[str, str], *args: str, input: bytes | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["enqueue", "generate", *args], env=env, input=input)
    return result.exit_code, result.output


def counts(env: dict[str, str]) -> tuple[int, int, int]:
    """Batches and items in the database, and jobs in Redis."""
    engine = make_engine(env["POLSPEC_DB_URL"])
    upgrade(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        batches = session.scalar(select(func.count()).select_from(Batch))
        items = session.scalar(select(func.count()).select_from(Item))
    engine.dispose()
    jobs = len(redis.Redis.from_url(env["POLSPEC_REDIS_URL"]).keys("rq:job:*"))
    return batches, items, jobs


def test_enqueue_writes_batch_items_and_one_job_each(env, tmp_path):
    source = write_jsonl(tmp_path / "prompts.jsonl", GOOD)
    code, output = invoke(env, "--input", str(source), "--target", "smollm2-135m", "--max-tokens", "7", "--json")
    assert code == 0, output
    reply = json.loads(output)
    assert reply["added"] == 3 and reply["existing"] == 0 and reply["queue"] == "polspec-smollm2-135m"

    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        batch = session.get(Batch, reply["batch"])
        items = {item.item_key: item for item in batch.items}
        assert batch.spec["draft"] is None and batch.spec["source"] == str(source)
        assert set(items) == {"a", "b", "3"} and {item.status for item in items.values()} == {"queued"}
        assert items["a"].params["max_tokens"] == 7 and items["b"].params["max_tokens"] == 5
        assert items["3"].params["temperature"] == 0.7 and items["a"].params["temperature"] == 0.0
        assert items["b"].messages == GOOD[1]["messages"] and items["b"].prompt is None
        ids = {key: item.id for key, item in items.items()}
    jobs = fetch_jobs(redis.Redis.from_url(env["POLSPEC_REDIS_URL"]),
                      [job_id(database_id(engine), item_id) for item_id in ids.values()])
    engine.dispose()
    assert all(job is not None for job in jobs.values())
    job_b = jobs[job_id(database_id(make_engine(env["POLSPEC_DB_URL"])), ids["b"])]
    assert job_b.func_name == "polspec.worker.tasks.run_item" and job_b.retries_left == 2
    assert job_b.timeout == JOB_TIMEOUT_BASE_S + 5 * JOB_TIMEOUT_PER_TOKEN_S
    # JSON on the wire (RQ zlib-compresses it), never pickle.
    raw = redis.Redis.from_url(env["POLSPEC_REDIS_URL"]).hget(f"rq:job:{job_b.id}", "data")
    assert json.loads(zlib.decompress(raw))[2] == [database_id(make_engine(env["POLSPEC_DB_URL"])), ids["b"]]


def test_policy_and_choice_names_are_read_in_any_case(env):
    code, output = invoke(env, "--dataset", "pl-short", "--limit", "1", "--draft", "smollm2-135m", "--k", "AUTO",
                          "--strategy", "Aligned", "--verify", "TLI", "--partial-word", "HOLD", "--draft-vocab", "Full",
                          "--temperature", "0.7", "--json")
    assert code == 0, output
    assert output.startswith("note: --strategy, --partial-word have no effect under --verify tli")  # then the JSON
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        params = session.get(Batch, json.loads(output.splitlines()[-1])["batch"]).spec["params"]
    engine.dispose()
    assert (params["k"], params["strategy"], params["verify"], params["partial_word"], params["draft_vocab"]) == (
        "auto", "aligned", "tli", "hold", "full")
    code, output = invoke(env, "--dataset", "pl-short", "--limit", "1", "--draft", "NONE", "--json")
    assert code == 0, output
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        assert session.get(Batch, json.loads(output)["batch"]).spec["draft"] is None
    engine.dispose()


def test_same_name_adds_only_new_ids(env, tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", GOOD)
    assert invoke(env, "--input", str(source), "--name", "nightly", "--target", "smollm2-135m")[0] == 0
    code, output = invoke(env, "--input", str(source), "--name", "nightly", "--target", "smollm2-135m", "--json")
    assert code == 0 and json.loads(output)["added"] == 0 and json.loads(output)["existing"] == 3
    more = write_jsonl(tmp_path / "more.jsonl", [*GOOD, {"id": "d", "prompt": "Kto napisał Lalkę?"}])
    code, output = invoke(env, "--input", str(more), "--name", "nightly", "--target", "smollm2-135m", "--json")
    assert json.loads(output)["added"] == 1 and json.loads(output)["batch"] == 1
    assert counts(env) == (1, 4, 4)
    even_more = write_jsonl(tmp_path / "even-more.jsonl", [*GOOD, {"id": "f", "prompt": "Kto napisał Potop?"}])
    code, output = invoke(env, "--input", str(even_more), "--name", "nightly", "--target", "smollm2-135m")
    assert code == 0 and output.startswith("batch 1 (nightly): 1 item queued on polspec-smollm2-135m, 3 already there\n")
    assert counts(env) == (1, 5, 5)
    code, output = invoke(env, "--input", str(more), "--name", "nightly", "--target", "smollm2-135m", "--k", "3")
    assert code == 1 and output.count("\n") == 1
    assert "batch 'nightly' (id 1) exists with different parameters: k (2, not 3); choose another --name" in output
    edited = write_jsonl(tmp_path / "edited.jsonl", [{**GOOD[0], "prompt": "Jaka jest stolica Słowacji?"}, GOOD[1],
                                                     {**GOOD[2], "prompt": "Ile nóg ma mucha?"}])
    code, output = invoke(env, "--input", str(edited), "--name", "nightly", "--target", "smollm2-135m")
    assert code == 1 and output == ("polspec: error: batch 'nightly' (id 1) has id 'a' and 1 more with another "
                                    "prompt; choose another --name (the batch keeps the text it was enqueued with)\n")
    assert counts(env) == (1, 5, 5)
    # A line's own setting edited since: never run, unseen, as an edited prompt would be.
    longer = write_jsonl(tmp_path / "longer.jsonl", [{**GOOD[0], "max_tokens": 99}, *GOOD[1:]])
    code, output = invoke(env, "--input", str(longer), "--name", "nightly", "--target", "smollm2-135m")
    assert code == 1 and output == ("polspec: error: batch 'nightly' (id 1) has id 'a' with other settings of its "
                                    "own; choose another --name (the batch keeps the settings it was enqueued with)\n")
    assert counts(env) == (1, 5, 5)
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"id": "e", "prompt": "Kto napisał Lalkę?"}])
    code, output = invoke(env, "--input", str(plain), "--name", "nightly", "--target", "smollm2-135m", "--raw")
    assert code == 1 and output == ("polspec: error: batch 'nightly' (id 1) was queued as chat where the target has "
                                    "a template (the default), not raw text (--raw); choose another --name\n")


def test_a_cancelled_batch_is_not_extended_by_name_until_it_is_resumed(env, tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", GOOD)
    assert invoke(env, "--input", str(source), "--name", "nightly", "--target", "smollm2-135m")[0] == 0
    assert CliRunner().invoke(main, ["cancel", "1"], env=env).exit_code == 0
    more = write_jsonl(tmp_path / "more.jsonl", [*GOOD, {"id": "d", "prompt": "Kto napisał Lalkę?"}])
    for again in (source, more):
        code, output = invoke(env, "--input", str(again), "--name", "nightly", "--target", "smollm2-135m")
        assert code == 1 and output == ("polspec: error: batch 'nightly' (id 1) is cancelled; resume it with "
                                        "polspec retry 1 --cancelled, or choose another --name\n")
    assert counts(env) == (1, 3, 0)
    status = CliRunner().invoke(main, ["status", "1", "--json"], env=env)
    assert json.loads(status.stdout)["status"] == "cancelled"
    assert CliRunner().invoke(main, ["retry", "1", "--cancelled"], env=env).exit_code == 0
    code, output = invoke(env, "--input", str(more), "--name", "nightly", "--target", "smollm2-135m", "--json")
    assert code == 0 and json.loads(output)["added"] == 1
    assert counts(env) == (1, 4, 4)


def test_a_draft_that_is_the_target_itself_is_queued_with_a_note(env, tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", GOOD)
    same = CliRunner().invoke(main, ["enqueue", "generate", "--input", str(source), "--target", "smollm2-135m",
                                     "--draft", "smollm2-135m", "--json"], env=env)
    assert same.exit_code == 0 and json.loads(same.stdout)["added"] == 3
    assert same.stderr == ("note: the draft smollm2-135m is the target's own model: its guesses cost as much as "
                           "the target's steps, so --draft none is faster\n")
    other = CliRunner().invoke(main, ["enqueue", "generate", "--input", str(source), "--target", "qwen2.5-coder-1.5b",
                                      "--draft", "smollm2-135m", "--json"], env=env)
    assert other.exit_code == 0 and other.stderr == ""


def test_options_that_change_nothing_are_queued_with_a_note(env, tmp_path):
    """A --seed at temperature 0 or a --k without a draft would otherwise be taken for used."""
    greedy = [row for row in GOOD if "temperature" not in row]
    source = write_jsonl(tmp_path / "greedy.jsonl", greedy)
    queued = CliRunner().invoke(main, ["enqueue", "generate", "--input", str(source), "--target", "smollm2-135m",
                                       "--k", "3", "--verify", "exact", "--seed", "7", "--top-p", "0.9", "--json"],
                                env=env)
    assert queued.exit_code == 0 and json.loads(queued.stdout)["added"] == len(greedy)
    assert queued.stderr == ("note: --k, --verify have no effect without a --draft\n"
                             "note: --seed, --top-p have no effect at --temperature 0 (greedy decoding)\n")
    sampled = CliRunner().invoke(main, ["enqueue", "generate", "--input", str(write_jsonl(tmp_path / "p.jsonl", GOOD)),
                                        "--target", "qwen2.5-coder-1.5b", "--draft", "smollm2-135m",
                                        "--k", "3", "--seed", "7", "--json"], env=env)
    assert sampled.exit_code == 0 and sampled.stderr == ""  # one line samples: the seed is used
    # --partial-word is aligned's alone, --prefix aligned's and context's; an item's own strategy counts.
    rows = [{"id": "a", "prompt": "Kraków jest"}, {"id": "b", "prompt": "Wisła to", "strategy": "context"}]
    for given, note in ((rows[:1], "note: --prefix, --partial-word have no effect with --strategy naive\n"),
                        (rows, "note: --partial-word has no effect with --strategy context, naive\n")):
        queued = CliRunner().invoke(main, ["enqueue", "generate", "--input", str(write_jsonl(tmp_path / "s.jsonl", given)),
                                           "--target", "qwen2.5-coder-1.5b", "--draft", "smollm2-135m", "--strategy",
                                           "naive", "--prefix", "3", "--partial-word", "hold", "--json"], env=env)
        assert queued.exit_code == 0 and queued.stderr == note
    # Sampled with speculative sampling (auto's choice), no round translates; a line that verifies
    # by exact match does.
    for given, note in ((rows[:1], "note: --strategy has no effect under --verify tli (auto's choice when sampling): "
                                   "speculative sampling maps tokens, it translates none\n"),
                        ([*rows[:1], {"id": "c", "prompt": "Gdańsk", "verify": "exact"}], "")):
        queued = CliRunner().invoke(main, ["enqueue", "generate", "--input", str(write_jsonl(tmp_path / "t.jsonl", given)),
                                           "--target", "qwen2.5-coder-1.5b", "--draft", "smollm2-135m", "--strategy",
                                           "naive", "--temperature", "0.7", "--json"], env=env)
        assert queued.exit_code == 0 and queued.stderr == note, queued.stderr


def test_stdin_and_dataset_inputs(env):
    lines = "\n".join(json.dumps(row, ensure_ascii=False) for row in GOOD).encode()
    code, output = invoke(env, "--input", "-", "--target", "smollm2-135m", "--json", input=lines)
    assert code == 0 and json.loads(output)["added"] == 3
    code, output = invoke(env, "--dataset", "pl-short", "--limit", "5", "--json")
    assert code == 0 and json.loads(output)["added"] == 5
    assert counts(env) == (2, 8, 8)
    run = f"'{sys.executable}' -c 'from polspec.cli import main; main()' enqueue generate --input -"
    for shell, message in ((f"exec {run} <&-", "standard input is closed: give --input a file, or pipe the lines in"),
                           (f"exec {run} <&- 0>/dev/null", "standard input: Bad file descriptor")):  # write-only
        closed = subprocess.run(["sh", "-c", shell], env=env, capture_output=True, text=True)
        assert (closed.returncode, closed.stdout + closed.stderr) == (1, f"polspec: error: {message}\n")
    assert counts(env) == (2, 8, 8)


@pytest.mark.parametrize("dataset", ["pl-wiki", "pl-instruct", "pl-short", "pl-struct"])
def test_built_in_datasets_are_valid_polish_sets_of_at_least_60(dataset):
    from polspec.decoding.params import DecodingParams
    from polspec.jobs.datasets import load_dataset

    items = load_dataset(dataset, DecodingParams())
    assert len(items) >= 60 and len({item.key for item in items}) == len(items)
    polish = sum(any(letter in item.prompt for letter in "ąćęłńóśźż") for item in items)
    assert polish > len(items) / 2


BAD_LINES = [
    ('{"id": "a", "prompt": "x"', "p.jsonl:2: malformed JSON"),
    ('{', "p.jsonl:2: malformed JSON: Expecting property name enclosed in double quotes at column 2; the line ends "
          "inside a JSON value, and each line must hold one whole JSON object (JSON Lines)\n"),  # pretty-printed JSON
    ('{"id": "a" "prompt": "x"}', "p.jsonl:2: malformed JSON: Expecting ',' delimiter at column 12\n"),
    ('{"id": "a", "prompt": "Ala ma', "p.jsonl:2: malformed JSON: Unterminated string starting at column 23; the line "
                                     "ends inside a JSON value, and each line must hold one whole JSON object"),
    ('{"id": "a"}', "p.jsonl:2: give exactly one of 'prompt' or 'messages'"),
    ('{"id": "a", "prompt": "   "}', "p.jsonl:2: the prompt is empty"),
    ('{"id": "a", "promt": "x"}', "p.jsonl:2: unknown key 'promt'"),
    ('{"id": "first", "prompt": "x"}', "p.jsonl:2: duplicate id 'first' (first on line 1)"),
    ('{"prompt": "x"}', "p.jsonl:2: every line needs an 'id'"),
    ('{"id": 1.5, "prompt": "x"}', "p.jsonl:2: 'id' must be a non-empty string or a whole number, got 1.5"),
    ('{"id": " ", "prompt": "x"}', "p.jsonl:2: 'id' must be a non-empty string or a whole number, got \" \""),
    ('{"id": null, "prompt": "x"}', "p.jsonl:2: 'id' must be a non-empty string or a whole number, got null"),
    ('{"id": "a", "prompt": "x", "k": 0}', "p.jsonl:2: k must be between 1 and 16, got 0"),
    ('{"id": "a", "prompt": "x", "top_p": 1.5}', "p.jsonl:2: top_p must be from 1e-06 to 1 (1: off), got 1.5"),
    ('{"id": "a", "prompt": "x", "temperature": "hot"}', "p.jsonl:2: temperature must be a number, got 'hot'"),
    ('{"id": "a", "prompt": "x", "max_tokens": true}', "p.jsonl:2: max_tokens must be a whole number, got true"),
    ('{"id": "a", "prompt": "x", "max_tokens": 8, "max_tokens": 80}', "p.jsonl:2: key 'max_tokens' is given twice"),
    ('{"id": "a", "messages": [{"role": "user", "content": "x", "role": "system"}]}',
     "p.jsonl:2: key 'role' is given twice"),
    ('{"id": "a", "messages": [{"role": "user"}]}',
     "p.jsonl:2: messages[0].content must be a string, and messages[0] has none"),
    ('{"id": "a", "messages": [{"role": "user", "content": 7}]}', "p.jsonl:2: messages[0].content must be a string"),
    ('{"id": "a", "messages": ["Cześć"]}', "p.jsonl:2: messages[0] must be an object with a string 'role' and 'content'"),
    # OpenAI-style data often names the speaker: it was told it needed the role and content it had.
    ('{"id": "a", "messages": [{"role": "user", "content": "x", "name": "Ola"}]}',
     "p.jsonl:2: messages[0] has 'name' besides 'role' and 'content'; polspec takes only those two"),
    ('["a", "x"]', "p.jsonl:2: expected a JSON object, got an array"),
    ("null", "p.jsonl:2: expected a JSON object, got null"),
    ('{"id": "a", "prompt": "x", "temperature": NaN}', "p.jsonl:2: temperature must be a finite number"),
    ('{"id": "a", "prompt": "x", "temperature": Infinity}', "p.jsonl:2: temperature must be a finite number"),
    ('{"id": "a", "prompt": "x", "seed": -1}', "p.jsonl:2: seed must be between 0 and"),
    # A half-filled column exported as null: it replaced the batch's --seed with a drawn one.
    ('{"id": "a", "prompt": "x", "seed": null}', "p.jsonl:2: 'seed' is null; leave it out to take the batch's setting"),
    ('{"id": "a", "prompt": "x", "seed": 9223372036854775808}', "p.jsonl:2: seed must be between 0 and"),
    ('{"id": "a", "prompt": "Krak\\ud800w"}', "p.jsonl:2: the prompt holds a lone surrogate '\\ud800' at character 5"),
    ('{"id": "\\udfff", "prompt": "x"}', "p.jsonl:2: the id holds a lone surrogate"),
    ('{"id": "a", "messages": [{"role": "user", "content": "\\ud83d"}]}',
     "p.jsonl:2: messages[0].content holds a lone surrogate"),
    # PostgreSQL stores no NUL in text: it was a DataError traceback there.
    ('{"id": "a", "prompt": "Ala\\u0000ma"}', "p.jsonl:2: the prompt holds a NUL character (\\u0000) at character 4"),
    ('{"id": "a\\u0000", "prompt": "x"}', "p.jsonl:2: the id holds a NUL character"),
    ('{"id": "a", "messages": [{"role": "user", "content": "\\u0000"}]}',
     "p.jsonl:2: messages[0].content holds a NUL character"),
    # A line break in an id split its row of the results list in two.
    ('{"id": "a\\nb", "prompt": "x"}', "p.jsonl:2: the id may not hold a line break or other control character"),
    ('{"id": "a", "messages": [{"role": "robot", "content": "Cześć"}]}',
     "p.jsonl:2: messages[0].role is 'robot'; it must be one of system, user, assistant"),
    ('{"id": "a", "messages": [{"role": "system", "content": "Mów po polsku."}, '
     '{"role": "assistant", "content": "Dobrze."}]}', "p.jsonl:2: the messages have no 'user' message to answer"),
    ('{"id": "a", "prompt": "x", "max_tokens": 100000000000000000000}',
     "p.jsonl:2: max_tokens must be at least 1 and at most 1,048,576, got 100000000000000000000"),
    ('{"id": "a", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}",
     f"p.jsonl:2: cannot be read: a number of over {sys.get_int_max_str_digits()} digits"),
    ('{"id": "a", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "p.jsonl:2: cannot be read: nesting too deep"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_a_bad_line_names_file_and_line_and_writes_nothing(env, tmp_path, line, message):
    source = write_jsonl(tmp_path / "p.jsonl", ['{"id": "first", "prompt": "Dzień dobry"}', line])
    code, output = invoke(env, "--input", str(source))
    assert code == 1 and output.startswith(f"polspec: error: {source.parent}/{message}") and output.count("\n") == 1
    assert counts(env) == (0, 0, 0)


def test_a_byte_order_mark_at_the_start_is_not_part_of_the_first_line(env, tmp_path):
    source = tmp_path / "p.jsonl"
    source.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD[0]).encode() + b"\n")
    code, output = invoke(env, "--input", str(source), "--target", "smollm2-135m", "--json")
    assert code == 0 and json.loads(output)["added"] == 1, output
    source.write_bytes(json.dumps(GOOD[0]).encode() + b"\n\xef\xbb\xbf" + json.dumps(GOOD[2]).encode() + b"\n")
    code, output = invoke(env, "--input", str(source), "--target", "smollm2-135m")  # only a file starts with one
    assert code == 1 and f"{source}:2: malformed JSON" in output


def test_non_utf8_input_names_the_line(env, tmp_path):
    source = tmp_path / "p.jsonl"
    source.write_bytes(b'{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": "Krak\xf3w"}\n')
    code, output = invoke(env, "--input", str(source))
    assert code == 1 and f"{source}:2: not UTF-8 (byte 0xf3" in output and output.count("\n") == 1
    assert counts(env) == (0, 0, 0)


@pytest.mark.parametrize(("args", "message"), [
    (["--target", "gemma-270m"], "unknown model alias 'gemma-270m'; did you mean gemma3-270m"),
    (["--draft", "smollm"], "unknown model alias 'smollm'"),
    (["--k", "0"], "--k must be between 1 and 16, got 0"),
    (["--temperature", "-1"], "temperature must be a finite number, 0 or more"),
    (["--temperature", "nan"], "temperature must be a finite number, 0 or more, got nan"),
    (["--seed", "-1", "--temperature", "0.7"], "--seed must be between 0 and 9223372036854775807"),
    (["--top-p", "0"], "--top-p must be from 1e-06 to 1 (1: off)"),
    (["--prefix", "-2"], "--prefix must be 0 or more"),
    (["--target", "qwen2.5-coder-1.5b", "--draft", "gemma3-270m"], "draft gemma3-270m has no chat template"),
])
def test_bad_models_and_options_write_nothing(env, tmp_path, args, message):
    source = write_jsonl(tmp_path / "p.jsonl", GOOD[::2])
    code, output = invoke(env, "--input", str(source), *args)
    assert code == 1 and message in output and output.count("\n") == 1, output
    assert counts(env) == (0, 0, 0)


def test_unknown_dataset_empty_file_and_missing_file(env, tmp_path):
    code, output = invoke(env, "--dataset", "pl-poezja")
    assert code == 1 and "unknown dataset 'pl-poezja'; built-in: pl-wiki" in output
    for name in ("hf:", "hf:/x", "hf:a/b/c"):  # said to need the datasets package, as if the name were right
        code, output = invoke(env, "--dataset", name)
        assert (code, output) == (1, f"polspec: error: {name}: not a dataset repository name, such as "
                                     "hf:OWNER/NAME[:SPLIT]\n")
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    code, output = invoke(env, "--input", str(empty))
    assert code == 1 and f"{empty}: no prompts in it" in output
    code, output = invoke(env, "--input", str(tmp_path / "missing.jsonl"))
    assert code == 1 and "missing.jsonl: No such file or directory" in output
    code, output = invoke(env, "--input", str(empty), "--dataset", "pl-short")
    assert code == 1 and "give exactly one of --input" in output
    assert counts(env) == (0, 0, 0)


def test_messages_need_a_chat_template(env, tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", GOOD)
    code, output = invoke(env, "--input", str(source), "--target", "gemma3-270m")
    assert code == 1 and f"{source}:2: item 'b' has messages, but gemma3-270m has no chat template" in output
    code, output = invoke(env, "--input", str(source), "--target", "smollm2-135m", "--raw")
    assert code == 1 and "item 'b' has messages, but --raw asks for raw text" in output
    assert counts(env) == (0, 0, 0)


@pytest.mark.slow
def test_a_prompt_longer_than_the_target_takes_is_refused_as_the_worker_would(env, tmp_path, smollm2):
    """With the target's files on this machine, enqueue counts the tokens of a prompt long enough
    to be in doubt, exactly as the worker will; it refuses only what does not fit."""
    too_long = "Wisła płynie przez Kraków i Warszawę. " * 1500
    source = write_jsonl(tmp_path / "p.jsonl", [GOOD[0], {"id": "long", "prompt": too_long}])
    code, output = invoke(env, "--input", str(source), "--target", "smollm2-135m", "--max-tokens", "16")
    with pytest.raises(PolspecError) as worker_says:
        encode_request(smollm2, None, too_long, DecodingParams(max_tokens=16), None)
    assert code == 1 and output == f"polspec: error: {source}:2: {worker_says.value}\n"
    assert "takes at most 8192" in output
    assert counts(env) == (0, 0, 0)

    in_doubt = "a" * 6000  # 6,000 bytes in few tokens: tokenized, and it fits
    fits = write_jsonl(tmp_path / "fits.jsonl", [{"id": "x", "prompt": in_doubt, "max_tokens": 2000}])
    code, output = invoke(env, "--input", str(fits), "--target", "smollm2-135m", "--raw")
    assert code == 0, output
    assert len(encode_request(smollm2, None, in_doubt, DecodingParams(max_tokens=2000), False)[0]) + 2000 <= 8192
    assert counts(env) == (1, 1, 1)

    # Many short messages: each adds its template's tokens beside its text, which the cheap
    # bound left out: 400 of "ok" read as 800 bytes, queued, and failed in the worker.
    chat = [{"role": role, "content": "ok"} for _ in range(200) for role in ("user", "assistant")][:-1]
    source = write_jsonl(tmp_path / "chat.jsonl", [{"id": "chat", "messages": chat, "max_tokens": 6000}])
    code, output = invoke(env, "--input", str(source), "--target", "smollm2-135m")
    with pytest.raises(PolspecError) as worker_says:
        encode_request(smollm2, None, chat, DecodingParams(max_tokens=6000), None)
    assert code == 1 and output == f"polspec: error: {source}:1: {worker_says.value}\n"


def test_unreachable_redis_names_the_url_and_creates_no_batch(env, tmp_path, closed_port):
    source = write_jsonl(tmp_path / "p.jsonl", GOOD)
    bad = dict(env, POLSPEC_REDIS_URL=f"redis://:sekret@127.0.0.1:{closed_port}/0")
    code, output = invoke(bad, "--input", str(source), "--target", "smollm2-135m")
    assert code == 1 and output.count("\n") == 1
    assert f"Redis at redis://:***@127.0.0.1:{closed_port}/0 is not reachable" in output and "sekret" not in output
    assert counts(env) == (0, 0, 0)


def test_a_redis_database_number_the_server_lacks_is_named_as_such(env, tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", GOOD)
    server = env["POLSPEC_REDIS_URL"].rsplit("/", 1)[0]
    code, output = invoke(dict(env, POLSPEC_REDIS_URL=f"{server}/99"), "--input", str(source), "--target", "smollm2-135m")
    assert code == 1 and output.count("\n") == 1
    assert "refused the connection: DB index is out of range (check the database number" in output
    # redis-py reads a database that is no number as database 0, where other work may be queued
    code, output = invoke(dict(env, POLSPEC_REDIS_URL=f"{server}/abc"), "--input", str(source), "--target", "smollm2-135m")
    assert code == 1 and output == (f"polspec: error: not a Redis URL: {server}/abc (after the port comes a database "
                                    "number, not 'abc')\n")
    assert counts(env) == (0, 0, 0)
    for accepted in (server, f"{server}/", f"{server}/0"):  # no database part, or an empty one, is database 0
        assert invoke(dict(env, POLSPEC_REDIS_URL=accepted), "--input", str(source), "--target", "smollm2-135m")[0] == 0
    assert counts(env) == (3, 9, 9)


def test_redis_failing_while_enqueueing_leaves_the_database_as_it_was(env, tmp_path, redis_server):
    """A new batch disappears; a finished one that new ids were added to keeps its items, and its
    status, as they were. Redis out of memory fails every write while it still answers a ping."""
    env = dict(env, POLSPEC_REDIS_URL=redis_server.url)
    source = write_jsonl(tmp_path / "p.jsonl", GOOD)
    assert invoke(env, "--input", str(source), "--name", "nightly", "--target", "smollm2-135m")[0] == 0
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:  # as a worker would have left it
        session.execute(Item.__table__.update().values(status="done"))
        session.scalar(select(Batch)).status = "done"
    redis.Redis.from_url(redis_server.url).config_set("maxmemory", 1)
    more = write_jsonl(tmp_path / "more.jsonl", [*GOOD, {"id": "d", "prompt": "Kto napisał Lalkę?"}])
    for args in (["--input", str(more), "--name", "nightly"], ["--input", str(source)]):
        code, output = invoke(env, *args, "--target", "smollm2-135m")
        assert code == 1 and output.count("\n") == 1
        assert "failed while enqueueing (" in output and "when used memory > 'maxmemory'" in output
        assert output.endswith("; nothing was added to the database\n")
    with session_scope(engine) as session:
        assert [(batch.name, batch.status) for batch in session.scalars(select(Batch))] == [("nightly", "done")]
        assert session.scalar(select(func.count()).select_from(Item)) == 3
    engine.dispose()


def test_an_undone_enqueue_into_a_finished_batch_settles_it_by_the_items_it_keeps(env, tmp_path, monkeypatch):
    """A worker claimed one of the new items, marking the batch running, before Redis failed on a
    later chunk of jobs: the undo deleted the new items but left the batch running, for good
    (no item was left to finish it), where it had been done. Now the claimed item stays, and the
    batch runs until it ends; the unclaimed one goes, with its job."""
    source = write_jsonl(tmp_path / "p.jsonl", GOOD)
    assert invoke(env, "--input", str(source), "--name", "nightly", "--target", "smollm2-135m")[0] == 0
    jobs_before = set(redis.Redis.from_url(env["POLSPEC_REDIS_URL"]).keys("rq:job:*"))
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:  # as a worker would have left it
        session.execute(Item.__table__.update().values(status="done"))
        session.scalar(select(Batch)).status = "done"

    def enqueue_then_fail(connection, name, db_id, items):
        enqueue_items(connection, name, db_id, items[:1])  # the first chunk's jobs went in,
        claim_item(engine, items[0][0], Worker("elsewhere", 1))  # a worker took one of them,
        raise redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")  # the next failed

    monkeypatch.setattr(enqueue_module, "enqueue_items", enqueue_then_fail)
    more = write_jsonl(tmp_path / "more.jsonl", [*GOOD, {"id": "d", "prompt": "Kto napisał Lalkę?"},
                                                 {"id": "e", "prompt": "Kto napisał Chłopów?"}])
    code, output = invoke(env, "--input", str(more), "--name", "nightly", "--target", "smollm2-135m")
    assert code == 1 and output.endswith("; of the 2 items it added, batch 1 keeps the 1 a worker had already taken "
                                         "(their results with them) and the rest were removed\n"), output
    with session_scope(engine) as session:
        assert [(batch.name, batch.status) for batch in session.scalars(select(Batch))] == [("nightly", "running")]
        assert [(item.item_key, item.status) for item in session.scalars(select(Item).order_by(Item.id))] == \
            [("a", "done"), ("b", "done"), ("3", "done"), ("d", "running")]
        claimed = session.scalar(select(Item.id).where(Item.item_key == "d"))
    kept_job = f"rq:job:{job_id(database_id(engine), claimed)}".encode()
    engine.dispose()
    assert set(redis.Redis.from_url(env["POLSPEC_REDIS_URL"]).keys("rq:job:*")) - jobs_before == {kept_job}


def test_an_undone_enqueue_keeps_the_results_workers_stored_meanwhile(env, tmp_path, monkeypatch):
    """Redis failed (or the user pressed Ctrl+C) after the first chunk of a large new batch went
    in, and a worker had decoded some of it: the undo deleted the batch, and with it the results
    it had stored and the item it was decoding (whose result was then dropped)."""
    engine = make_engine(env["POLSPEC_DB_URL"])

    def enqueue_then_fail(connection, name, db_id, items):
        enqueue_items(connection, name, db_id, items[:2])  # the first chunk's jobs went in;
        me = Worker("elsewhere", 1)
        claim_item(engine, items[0][0], me)  # a worker decoded the first item,
        assert finish_item(engine, items[0][0], me, new_result(Item(id=items[0][0])))
        claim_item(engine, items[1][0], me)  # and took the second,
        raise KeyboardInterrupt  # when the user pressed Ctrl+C

    monkeypatch.setattr(enqueue_module, "enqueue_items", enqueue_then_fail)
    code, output = invoke(env, "--input", str(write_jsonl(tmp_path / "p.jsonl", GOOD)), "--target", "smollm2-135m")
    assert code == 1 and output == ("polspec: error: interrupted; of the 3 items it added, batch 1 keeps the 2 a worker "
                                    "had already taken (their results with them) and the rest were removed\n"), output
    with session_scope(engine) as session:
        assert [(batch.id, batch.status) for batch in session.scalars(select(Batch))] == [(1, "running")]
        assert [(item.item_key, item.status) for item in session.scalars(select(Item).order_by(Item.id))] == \
            [("a", "done"), ("b", "running")]
        assert session.scalar(select(func.count()).select_from(Result)) == 1
    engine.dispose()


def test_cancel_retry_and_recover_say_what_holds_when_redis_refuses_writes(env, tmp_path, redis_server, closed_port):
    """A Redis that answers a ping but refuses writes (here a replica of a master it cannot
    reach; out of memory, or a replica after a failover) failed these commands after their
    database change with a traceback: the change had taken, and the user could not tell."""
    env = dict(env, POLSPEC_REDIS_URL=redis_server.url)
    assert invoke(env, "--input", str(write_jsonl(tmp_path / "p.jsonl", GOOD)), "--target", "smollm2-135m")[0] == 0
    connection = redis.Redis.from_url(redis_server.url)
    queue = Queue("polspec-smollm2-135m", connection=connection)
    connection.flushall()  # Redis lost its data: the items need recover
    connection.replicaof("127.0.0.1", closed_port)

    def command(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(main, list(args), env=env)
        return result.exit_code, result.output

    def statuses() -> list[str]:
        engine = make_engine(env["POLSPEC_DB_URL"])
        with session_scope(engine) as session:
            found = list(session.scalars(select(Item.status).order_by(Item.id)))
        engine.dispose()
        return found

    try:
        code, output = command("recover")
        assert code == 1 and output.count("\n") == 1 and "Redis failed part-way (" in output, output
        assert output.endswith("; the items recovered so far are queued in the database: run polspec recover again "
                               "once Redis takes writes (a worker also recovers as it starts)\n")
        assert command("cancel", "1") == (0, "batch 1 cancelled (3 queued items dropped)\n")  # jobs left are skipped
        assert statuses() == ["cancelled"] * 3
        code, output = command("retry", "1", "--cancelled")
        assert code == 1 and output.count("\n") == 1 and "Redis failed part-way (" in output, output
        assert output.endswith("; the cancelled items of batch 1 are queued again in the database: polspec recover "
                               "(or a worker, as it starts) gives them their jobs once Redis takes writes\n")
        assert statuses() == ["queued"] * 3
    finally:
        connection.replicaof("NO", "ONE")
    assert command("recover") == (0, "re-enqueued 3 items (3 job missing); run polspec worker to finish them\n")
    assert queue.count == 3


def test_redis_failing_part_way_through_a_large_batch_leaves_no_jobs_behind(env, tmp_path, redis_server):
    env = dict(env, POLSPEC_REDIS_URL=redis_server.url)
    source = write_jsonl(tmp_path / "p.jsonl", [{"id": n, "prompt": "Ile nóg ma pająk?"} for n in range(3000)])
    connection = redis.Redis.from_url(redis_server.url)
    # Jobs are enqueued a thousand at a time, about 1.8 MB each thousand: the first fits, the rest not.
    connection.config_set("maxmemory", connection.info("memory")["used_memory"] + 2_700_000)
    code, output = invoke(env, "--input", str(source), "--target", "smollm2-135m")
    assert code == 1 and "failed while enqueueing (" in output, output
    connection.config_set("maxmemory", 0)
    pushed = connection.info("commandstats").get("cmdstat_rpush", {}).get("calls", 0)
    assert pushed >= 1000  # the first thousand jobs went in before Redis failed
    assert counts(env) == (0, 0, 0)
    assert connection.keys("rq:job:*") == []


@pytest.mark.slow
def test_deleted_jobs_leave_their_queues_and_the_others_stay_in_order(env):
    """RQ's delete takes a job out of its queue with an LREM, a scan of the queue per job: a
    cancel of a sweep of 345,000 queued jobs held Redis for minutes. Now one pass per chunk."""
    connection = redis.Redis.from_url(env["POLSPEC_REDIS_URL"])
    enqueue_items(connection, "polspec-a", "db", [(item_id, 4) for item_id in range(1, 2502)])
    enqueue_items(connection, "polspec-b", "db", [(9001, 4), (9002, 4)])
    gone = [job_id("db", item_id) for item_id in (*range(1, 2502, 2), 9001, 777)]  # 777: no such job
    delete_jobs(connection, gone)
    assert Queue("polspec-a", connection=connection).job_ids == [job_id("db", i) for i in range(2, 2502, 2)]
    assert Queue("polspec-b", connection=connection).job_ids == [job_id("db", 9002)]
    assert not any(connection.exists(f"rq:job:{id_}") for id_ in gone)
    delete_jobs(connection, [job_id("db", 9002)])  # the last of its queue
    assert Queue("polspec-b", connection=connection).job_ids == []


def test_ctrl_c_while_jobs_are_enqueued_leaves_no_items_without_jobs(env, tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", [{"id": n, "prompt": "Ile nóg ma pająk?"} for n in range(10_000)])
    enqueuing = subprocess.Popen([sys.executable, "-c", "from polspec.cli import main; main()", "enqueue", "generate",
                                  "--input", str(source), "--target", "smollm2-135m"],
                                 env=os.environ | env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # The items are written in one transaction before the jobs, a thousand at a time; Redis then
    # holds back the next thousand until the signal is in.
    connection = redis.Redis.from_url(env["POLSPEC_REDIS_URL"])
    wait_for(lambda: connection.dbsize() > 0, 120, "the first jobs enqueued")
    connection.execute_command("CLIENT", "PAUSE", "60000", "WRITE")
    try:
        enqueuing.send_signal(signal.SIGINT)
        time.sleep(1)
    finally:
        connection.execute_command("CLIENT", "UNPAUSE")
    output = enqueuing.communicate(timeout=120)[0]
    assert enqueuing.returncode == 1 and "Aborted!" in output, output
    assert counts(env) == (0, 0, 0)


@pytest.mark.parametrize("args", [["enqueue", "generate", "--input", ""], ["enqueue", "sweep", "--config", ""],
                                  ["results", "export", "1", "--output", ""], ["report", "1", "--output", ""]])
def test_an_empty_path_is_refused_as_such(env, args):
    result = CliRunner().invoke(main, args, env=env)
    assert result.exit_code == 2 and result.output.splitlines()[-1] == (
        f"Error: Invalid value for '{args[-2]}': needs a file path, got an empty one (or '.')")
    assert counts(env) == (0, 0, 0)


def test_a_batch_of_more_items_than_sqlite_takes_variables_is_cancelled_and_resumed(env, tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", [{"id": n, "prompt": "Ile nóg ma pająk?"} for n in range(150)])
    assert invoke(env, "--input", str(source), "--target", "smollm2-135m")[0] == 0
    engine = make_engine(env["POLSPEC_DB_URL"])
    # As a sweep of hundreds of thousands of items meets SQLite's limit, in a test's time.
    event.listen(engine, "connect", lambda connection, _: connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 100))
    connection = redis.Redis.from_url(env["POLSPEC_REDIS_URL"])
    assert cancel(engine, connection, 1) == (150, False)
    assert retry(engine, connection, 1, (Status.CANCELLED,)) == 150
    engine.dispose()
    assert counts(env) == (1, 150, 150)


def test_a_blank_batch_name_is_refused(env, tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", GOOD)
    code, output = invoke(env, "--input", str(source), "--name", " ")
    assert code == 1 and output == "polspec: error: --name needs some text in it (or leave it out)\n"
    code, output = invoke(env, "--input", str(source), "--name", "noc\nna")
    assert code == 1 and output == ("polspec: error: --name may not hold a line break or other control character, "
                                    "got 'noc\\nna'\n")
    assert counts(env) == (0, 0, 0)
    code, output = invoke(env, "--input", str(source), "--name", "noc\u00a0świętojańska", "--target", "smollm2-135m")
    assert code == 0, output  # a no-break space is no control character


def test_database_locked_beyond_the_timeout_is_one_line(env, tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", GOOD)
    upgrade(env["POLSPEC_DB_URL"])
    holder = make_engine(env["POLSPEC_DB_URL"])
    with holder.connect() as connection, connection.begin():
        connection.exec_driver_sql("UPDATE polspec_meta SET value = value")  # holds the write lock
        code, output = invoke(dict(env, POLSPEC_DB_BUSY_TIMEOUT_MS="200"), "--input", str(source),
                              "--target", "smollm2-135m")
    holder.dispose()
    assert code == 1 and "database is locked (busy timeout 200 ms" in output and output.count("\n") == 1
    assert counts(env) == (0, 0, 0)


def test_unwritable_data_dir_is_one_line(env, tmp_path):
    blocker = tmp_path / "not-a-directory"  # a file where the data directory should be: fails even for root
    blocker.write_text("")
    source = write_jsonl(tmp_path / "p.jsonl", GOOD)
    code, output = invoke(dict(env, POLSPEC_DB_URL=f"sqlite:///{blocker / 'x.db'}"), "--input", str(source),
                          "--target", "smollm2-135m")
    assert code == 1 and "cannot create" in output and output.count("\n") == 1
    assert counts(env) == (0, 0, 0)
