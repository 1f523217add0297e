"""The command line end to end: doctor, models, generate, on real services and models."""

from __future__ import annotations

import json
import platform
import re
import shutil
import sqlite3
import subprocess
from pathlib import Path

import click
import pytest
import redis
from click.testing import CliRunner

from polspec import backend
from polspec.cli import main
from polspec.cli.doctor import _redis_report
from polspec.cli.options import note_if_the_draft_is_the_target
from polspec.cli.worker import BatchSize
from polspec.decoding.params import DecodingParams
from polspec.decoding.run import generate
from polspec.models.registry import load_registry
from polspec.store.migrate import head_revision
from helpers import wait_for


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env=env)
    return result.exit_code, result.output


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'results.db'}"


@pytest.mark.slow
def test_doctor_reports_backend_redis_database_and_energy(redis_url, sqlite_url):
    env = {"POLSPEC_REDIS_URL": redis_url, "POLSPEC_DB_URL": sqlite_url}
    code, output = invoke("doctor", "--json", env=env)
    assert code == 0, output
    report = json.loads(output)
    assert report["device"] in ("cpu", "gpu") and report["matmul_gflops_f32"] > 0
    if platform.system() == "Linux" and report["device"] == "cpu":
        assert report["blas_fix"]["active"], report["blas_fix"]["reason"]
        assert report["blas_threads"] == {"threads": backend.blas_threads(), "shared": True, "decoding_processes": 0}
    assert report["redis"]["reachable"] and report["redis"]["aof"] and "warning" not in report["redis"]
    assert report["database"]["revision"] is None and report["database"]["head"] == head_revision()
    energy = report["energy"]
    assert energy["available"] == (energy["meter"] is not None) and energy["reason"]

    assert invoke("db", "upgrade", env=env)[0] == 0
    report = json.loads(invoke("doctor", "--json", env=env)[1])
    assert report["database"]["revision"] == head_revision() and report["database"]["up_to_date"]


@pytest.mark.slow
def test_doctor_fails_on_a_file_that_is_no_database_and_on_a_newer_schema(redis_url, tmp_path):
    """Both refuse every command that reads results, so doctor marks them failures ("!!"), in
    one line each, and db current says what to do."""
    not_a_database = tmp_path / "notes.db"
    not_a_database.write_text("garbage\n")
    env = {"POLSPEC_REDIS_URL": redis_url, "POLSPEC_DB_URL": f"sqlite:///{not_a_database}"}
    code, output = invoke("doctor", "--json", env=env)
    assert code == 1 and json.loads(output)["database"]["error"] == "file is not a database"
    code, output = invoke("db", "current", env=env)
    assert code == 1 and output == f"polspec: error: database sqlite:///{not_a_database}: file is not a database\n"

    newer = f"sqlite:///{tmp_path / 'newer.db'}"
    env["POLSPEC_DB_URL"] = newer
    assert invoke("db", "upgrade", env=env)[0] == 0
    with sqlite3.connect(tmp_path / "newer.db") as connection:
        connection.execute("UPDATE alembic_version SET version_num = 'ffff'")
    code, output = invoke("doctor", env=env)
    newer_schema = "revision ffff is newer than this polspec knows (a newer polspec upgraded it): upgrade polspec"
    assert code == 1 and f"!! database   {newer}: {newer_schema}\n" in output
    code, output = invoke("db", "current", env=env)
    assert code == 0 and output == f"{newer}: {newer_schema}\n"
    code, output = invoke("status", env=env)
    assert code == 1 and output == f"polspec: error: database {newer}: {newer_schema}\n"
    # A Redis URL that enqueue refuses is no healthy Redis to doctor either
    env["POLSPEC_REDIS_URL"] = redis_url.rsplit("/", 1)[0] + "/abc"
    redis_report = json.loads(invoke("doctor", "--json", env=env)[1])["redis"]
    assert not redis_report["reachable"] and redis_report["error"].startswith("not a Redis URL: ")


def test_doctor_takes_a_redis_that_refuses_config_for_the_working_queue_it_is(tmp_path, closed_port):
    """Managed Redis services and restricted users refuse CONFIG, which the queue never uses:
    doctor called such a server refused, a failure."""
    port = closed_port
    server = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "yes", "--dir", str(tmp_path), "--rename-command", "CONFIG", ""],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        wait_for(lambda: _answers(url), 10, "redis-server to start")
        report = _redis_report(url)
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert report["reachable"] and report["aof"] and "error" not in report and "warning" not in report, report
    assert report["appendfsync"] is None and report["snapshots"] is None  # unknown, not "off"


def _answers(url: str) -> bool:
    try:
        return redis.Redis.from_url(url).ping()
    except redis.ConnectionError:
        return False


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs procfs, where no file can be created")
def test_db_upgrade_where_no_file_can_be_created_is_one_line():
    code, output = invoke("db", "upgrade", env={"POLSPEC_DB_URL": "sqlite:////proc/polspec.db"})
    assert code == 1 and output.startswith("polspec: error: cannot create the migration lock /proc/polspec.db.migrate-lock: ")
    assert output.count("\n") == 1


@pytest.mark.slow
def test_doctor_names_an_unreachable_redis_without_its_password(closed_port, sqlite_url):
    url = f"redis://:s3cret@127.0.0.1:{closed_port}/0"
    code, output = invoke("doctor", "--json", env={"POLSPEC_REDIS_URL": url, "POLSPEC_DB_URL": sqlite_url})
    assert code == 1  # a failure, not a warning: nothing can be queued
    report = json.loads(output)
    assert not report["redis"]["reachable"] and report["redis"]["error"]
    assert f"127.0.0.1:{closed_port}" in report["redis"]["url"] and "s3cret" not in output


@pytest.mark.slow
def test_doctor_reports_a_malformed_redis_url(sqlite_url):
    code, output = invoke("doctor", "--json", env={"POLSPEC_REDIS_URL": "localhost:6379", "POLSPEC_DB_URL": sqlite_url})
    assert code == 1, output
    report = json.loads(output)["redis"]
    assert not report["reachable"] and report["error"].startswith("not a Redis URL (")


BEYOND_ANY_ID = "9223372036854775808"  # one past the largest 64-bit integer key


@pytest.mark.parametrize("args, message", [
    (["status", "--watch", "--interval", "0"], "0.0 is not in the range 0.1<=x<=86400"),
    (["status", "--watch", "--interval", "nan"], "nan is not a number of seconds"),
    (["results", "list", "--limit", "-1"], "-1 is not in the range 0<=x<=1000000000"),
    (["status", BEYOND_ANY_ID], f"{BEYOND_ANY_ID} is no id: ids are whole numbers from 1 to 9223372036854775807"),
    (["status", "0"], "0 is no id: ids are whole numbers from 1 to"),
    (["status", "1.5"], "'1.5' is not an id (a whole number)"),
    (["cancel", BEYOND_ANY_ID], "is no id: ids are whole numbers from 1 to"),
    (["retry", BEYOND_ANY_ID, "--failed"], "is no id: ids are whole numbers from 1 to"),
    (["recover", "--batch", BEYOND_ANY_ID], "is no id: ids are whole numbers from 1 to"),
    (["results", "list", "--batch", BEYOND_ANY_ID], "is no id: ids are whole numbers from 1 to"),
    (["results", "show", BEYOND_ANY_ID, "a"], "is no id: ids are whole numbers from 1 to"),
    (["results", "export", BEYOND_ANY_ID], "is no id: ids are whole numbers from 1 to"),
    (["report", BEYOND_ANY_ID], "is no id: ids are whole numbers from 1 to"),
])
def test_out_of_range_options_are_usage_errors(sqlite_url, args, message):
    code, output = invoke(*args, env={"POLSPEC_DB_URL": sqlite_url})
    assert code == 2 and message in output


def test_a_worker_batch_size_is_a_number_or_auto_in_any_case():
    size = BatchSize()  # its help shows N|AUTO, as click writes a type's name
    assert [size.convert(value, None, None) for value in ("auto", "AUTO", "3")] == [None, None, 3]
    for bad in ("0", "-1", "abc", "1.5"):
        with pytest.raises(click.BadParameter, match="is neither a whole number of at least 1 nor 'auto'"):
            size.convert(bad, None, None)


@pytest.mark.slow
def test_doctor_human_report_marks_problems(closed_port, sqlite_url, redis_url):
    code, output = invoke("doctor", env={"POLSPEC_REDIS_URL": f"redis://127.0.0.1:{closed_port}/0",
                                         "POLSPEC_DB_URL": sqlite_url})
    assert code == 1
    assert re.search(r"^!! redis +redis://127\.0\.0\.1:\d+/0: unreachable", output, re.M)
    assert re.search(r"^-- database .*run polspec db upgrade", output, re.M)  # commands upgrade it themselves
    code, output = invoke("doctor", env={"POLSPEC_REDIS_URL": f"redis://127.0.0.1:{closed_port}/0",
                                         "POLSPEC_DB_URL": "nosuch://x"})
    assert code == 1 and re.search(r"^!! database +nosuch://x: ", output, re.M)
    code, output = invoke("doctor", env={"POLSPEC_REDIS_URL": redis_url.rsplit("/", 1)[0] + "/99",
                                         "POLSPEC_DB_URL": "notaurl"})
    assert code == 1 and re.search(r"^!! database +POLSPEC_DB_URL: not a database URL", output, re.M)
    # The rest of the report still comes; a server that answers is no unreachable one.
    assert re.search(r"^!! redis +redis://127\.0\.0\.1:\d+/99: refused \(.*DB index is out of range", output, re.M)
    code, output = invoke("doctor", env={"POLSPEC_REDIS_URL": redis_url, "POLSPEC_DB_URL": sqlite_url,
                                         "POLSPEC_DB_BUSY_TIMEOUT_MS": "abc", "POLSPEC_MODEL_CACHE_GB": "-1"})
    assert code == 1 and re.search(r"^!! settings +POLSPEC_DB_BUSY_TIMEOUT_MS .*; POLSPEC_MODEL_CACHE_GB ", output, re.M)


@pytest.mark.slow
def test_generate_says_what_it_does_while_its_first_use_imports_the_model(isolated_home, smollm2_gguf):
    """A first generate fetched and imported its model (minutes for a 1.5B) and printed nothing."""
    isolated_home.mkdir()
    (isolated_home / "models.toml").write_text(f'[models.mine]\nsource = "gguf:{smollm2_gguf}"\n')
    result = CliRunner().invoke(main, ["generate", "Kraków jest", "--target", "mine", "--max-tokens", "2", "--raw"])
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("loading: ") and "import" in result.stderr, result.stderr


@pytest.mark.slow
def test_models_import_registers_an_alias(isolated_home, tmp_path, capsys, smollm2_gguf):
    entry = load_registry().model("smollm2-135m")
    gguf_file = tmp_path / "smollm2.gguf"
    shutil.copyfile(smollm2_gguf, gguf_file)
    code, output = invoke("models", "import", str(gguf_file), "--name", "my-smol")
    assert code == 0, output
    listed = [json.loads(line) for line in invoke("models", "list", "--json")[1].splitlines()]
    mine = next(row for row in listed if row["alias"] == "my-smol")
    assert mine["cached"] and mine["architecture"] == "llama" and mine["chat_template"]
    assert mine["source"] == f"gguf:{gguf_file}"  # as models show gives it
    shown = json.loads(invoke("models", "show", "my-smol", "--json")[1])
    assert shown["source"] == f"gguf:{gguf_file}" and shown["sha256"] == entry.sha256
    assert shown["config"]["model_type"] == "llama" and shown["config"]["vocab_size"] == 49152
    # In words without --json: no Python reprs of booleans, lists and dicts.
    lines = dict(line.split(None, 1) for line in invoke("models", "show", "my-smol")[1].splitlines())
    assert (lines["chat_template"], lines["cached"], lines["eos_tokens"]) == ("yes", "yes", '["<|im_end|>"]')
    assert lines["config"].startswith("model_type llama, hidden_size 576,") and "tie_word_embeddings yes" in lines["config"]

    code, output = invoke("models", "import", str(gguf_file), "--name", "my-smol")
    assert code == 1 and "alias 'my-smol' already exists" in output
    gguf_file.unlink()  # imported: the model serves without the file it came from
    code, output = invoke("models", "fetch", "my-smol")
    assert code == 0 and output.startswith("my-smol: ") and json.loads(invoke("models", "show", "my-smol", "--json")[1])["cached"]

    capsys.readouterr()
    note_if_the_draft_is_the_target("smollm2-135m", "my-smol")  # the same GGUF bytes under another alias
    assert capsys.readouterr().err.startswith("note: the draft my-smol is the target's own model")
    note_if_the_draft_is_the_target("gemma3-270m", "my-smol")
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_models_fetch_a_tokenizer_saying_what_it_does_off_a_terminal(isolated_home):
    result = CliRunner().invoke(main, ["models", "fetch", "tok:mistral-32k"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("tok:mistral-32k: ") and result.stdout.strip().endswith("tokenizer.model.v1")
    assert result.stderr.startswith("tok:mistral-32k: downloading "), result.stderr  # a bar where it can be drawn


@pytest.mark.slow
def test_generate_streams_greedy_polish_and_reports_json(gemma3, resident_models):
    code, output = invoke("generate", "Kraków jest", "--target", "gemma3-270m", "--max-tokens", "6", "--json")
    assert code == 0, output
    result = json.loads(output)
    assert result["metrics"]["generated_tokens"] == len(result["token_ids"]) == 6
    # What the library decodes greedily in the model's default (chat) mode: the CLI passed it on.
    assert result["token_ids"] == generate(gemma3, None, "Kraków jest", DecodingParams(max_tokens=6)).token_ids
    assert result["text"] == gemma3.tokenizer.decode(result["token_ids"])
    assert result["draft"] == "none" and result["spans"] == [[result["text"], False]]
    code, streamed = invoke("generate", "Kraków jest", "--target", "gemma3-270m", "--max-tokens", "6")
    assert streamed.strip() == result["text"].strip()  # greedy: the same text both times


@pytest.mark.parametrize("args, message", [
    (["generate", "   "], "polspec: error: the prompt is empty"),
    (["generate", "Krak\udcf3w"], "polspec: error: the argument 'Krak\\xf3w' is not UTF-8: byte 0xf3 at character 5"),  # Latin-2 ó
    (["generate", "x", "--target", "gemma-270m"], "polspec: error: unknown model alias 'gemma-270m'; did you mean gemma3-270m"),
    (["generate", "x", "--target", "GEMMA3-270M"], "polspec: error: unknown model alias 'GEMMA3-270M'; did you mean gemma3-270m"),
    # The draft is checked before the target loads (this test has no models to load).
    (["generate", "x", "--target", "gemma3-270m", "--draft", "smollm"], "polspec: error: unknown model alias 'smollm'"),
    (["generate", "x", "--temperature", "0.7", "--seed", "-3"], "polspec: error: --seed must be between 0 and"),
    # Told before the 1.5B target loads (the encoder said it once both had loaded).
    (["generate", "x", "--target", "qwen2.5-coder-1.5b", "--draft", "gemma3-270m"],
     "polspec: error: draft gemma3-270m has no chat template but qwen2.5-coder-1.5b runs in chat mode: add --raw"),
    (["generate", "x", "--draft", "tok:llama3"], "polspec: error: tok:llama3 is a tokenizer alone, not a model that can run"),
])
def test_generate_bad_input(args, message):
    code, output = invoke(*args)
    assert code == 1 and output.startswith(message) and output.count("\n") == 1


@pytest.mark.slow
def test_generate_tells_a_prompt_too_long_before_loading_a_model(gemma3, monkeypatch):
    """As enqueue does, from the target's tokenizer: both models loaded (or were fetched) first."""
    monkeypatch.setattr("polspec.models.loader.load_model", lambda *args, **kwargs: pytest.fail("a model loaded"))
    code, output = invoke("generate", "Kraków jest", "--target", "gemma3-270m", "--draft", "smollm2-135m",
                          "--max-tokens", "100000")
    assert code == 1 and output.startswith("polspec: error: PROMPT: ") and "takes at most 32768" in output, output
    assert output.count("\n") == 1


@pytest.mark.slow
@pytest.mark.parametrize("args, note", [
    (["--target", "gemma3-270m", "--draft", "smollm2-135m", "--temperature", "0.7", "--strategy", "context",
      "--prefix", "9"], "--strategy, --prefix have no effect under --verify tli (auto's choice when sampling): "
                        "speculative sampling maps tokens, it translates none"),
    (["--target", "qwen2.5-coder-1.5b", "--draft", "qwen2.5-1.5b", "--raw", "--strategy", "naive"],
     "--strategy has no effect with a draft of the target's tokenizer family (its tokens need no translation)"),
])
def test_generate_says_when_no_round_translates_what_the_translation_options_ask(gemma3, monkeypatch, args, note):
    """They were taken silently (and stored in --json's params as if they had run)."""
    monkeypatch.setattr("polspec.models.loader.load_model", lambda *args, **kwargs: pytest.fail("a model loaded"))
    code, output = invoke("generate", "Kraków jest", *args, "--max-tokens", "100000")  # told, then refused unloaded
    assert code == 1 and output.splitlines()[0] == f"note: {note}", output


@pytest.mark.parametrize("args, message", [
    (["--show-accepted"], "Error: --show-accepted marks text taken from the draft; give a --draft"),
    (["--show-accepted", "--draft", "smollm2-135m", "--json"], "Error: --show-accepted marks the printed text; "
     "with --json the spans say which tokens came from the draft"),
])
def test_generate_refuses_options_it_would_ignore(args, message):
    code, output = invoke("generate", "x", *args)
    assert code == 2 and output.splitlines()[-1] == message


def test_a_probe_of_fewer_than_three_repeats_is_called_noisy():
    code, output = invoke("models", "probe", "gemma-270m", "smollm2-135m", "--repeats", "2")
    assert output.startswith("note: 2 repeat(s) give noisy figures")  # said before anything loads
    assert code == 1 and "unknown model alias 'gemma-270m'" in output


@pytest.mark.parametrize("args", [["models", "probe", "gemma3-270m", "smollm"], ["models", "fetch", "gemma3-270m", "smollm"]])
def test_a_mistyped_alias_among_several_is_told_before_any_model_is_fetched(isolated_home, args):
    code, output = invoke(*args)
    assert code == 1 and output.startswith("polspec: error: unknown model alias 'smollm'") and output.count("\n") == 1
    assert not (isolated_home / "models").exists()


def test_tables_print_whole_when_the_output_is_not_a_terminal(monkeypatch):
    from polspec.cli.console import REDIRECTED_WIDTH, output_console

    monkeypatch.delenv("COLUMNS", raising=False)
    assert output_console().width == REDIRECTED_WIDTH
    monkeypatch.setenv("COLUMNS", "100")
    assert output_console().width == 100


@pytest.mark.slow
def test_a_draft_put_in_the_target_s_tokenizer_family_by_mistake_is_refused(home_with_models, closed_port,
                                                                             resident_models, smollm2_gguf):
    """A wrong --tokenizer-family made the target read the draft's ids as its own: every round
    proposed tokens the draft had not chosen, and nothing said so. (The tolerance for a family's
    renamed control tokens: test_translate; a family's pair decoding untranslated: the twin pair
    of test_lossless_inputs.)"""
    code, output = invoke("models", "import", str(smollm2_gguf), "--name", "smol-as-gemma", "--tokenizer-family", "gemma3")
    assert code == 0, output
    code, output = invoke("generate", "Kraków jest", "--target", "gemma3-270m", "--draft", "smol-as-gemma",
                          "--max-tokens", "2", "--raw")
    assert code == 1 and output.startswith(
        "polspec: error: smol-as-gemma and gemma3-270m are registered as one tokenizer family (gemma3), but ")
    assert "id 0 is '<|endoftext|>' to smol-as-gemma and '<pad>' to gemma3-270m" in output
    assert output.count("\n") == 1
    refusal = output
    # Refused as the work is queued too, where both models are on this machine: a sweep's every
    # item failed on the worker.
    env = {"POLSPEC_DB_URL": f"sqlite:///{home_with_models / 'results.db'}",
           "POLSPEC_REDIS_URL": f"redis://127.0.0.1:{closed_port}/0"}
    code, output = invoke("enqueue", "generate", "--dataset", "pl-short", "--limit", "2", "--target", "gemma3-270m",
                          "--draft", "smol-as-gemma", "--raw", env=env)
    assert (code, output) == (1, refusal) and not (home_with_models / "results.db").exists()
