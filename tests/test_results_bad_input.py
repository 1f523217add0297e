"""The commands that read results and write them out: every user mistake is one line on stderr,
a non-zero exit, and nothing written or created. Real redis-server and SQLite; no models load."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import pty
import re
import sqlite3
import stat
import subprocess
import sys
import threading
from contextlib import closing
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import make_url

from polspec.cli import main
from polspec.store.engine import sqlite_file
from polspec.store.migrate import downgrade


def cli(env: dict[str, str], *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env=env)
    return result.exit_code, result.output


@pytest.fixture
def batch(sqlite_env: dict[str, str]) -> int:
    """A generate batch of three queued items."""
    code, output = cli(sqlite_env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "3", "--json")
    assert code == 0, output
    return json.loads(output)["batch"]


def small_sweep(env: dict[str, str], folder: Path) -> int:
    """A sweep of one pl-short prompt, enqueued and not run: its id."""
    sweep = folder / "sweep.toml"
    sweep.write_text('target = "gemma3-270m"\ndrafts = ["smollm2-135m"]\ndatasets = [{ name = "pl-short", limit = 1 }]\n')
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep), "--json")
    assert code == 0, output
    return json.loads(output)["batch"]


def test_an_unknown_batch_is_an_error_for_every_command_that_takes_one(sqlite_env, batch):
    for args in (["results", "list", "--batch", "99"], ["results", "show", "99", "q1"], ["recover", "--batch", "99"],
                 ["results", "export", "99"], ["status", "99"], ["retry", "99", "--failed"]):
        code, output = cli(sqlite_env, *args)
        assert code == 1 and output == "polspec: error: no batch 99 (polspec status lists the batches)\n", args
    code, output = cli(sqlite_env, "results", "show", str(batch), "nosuch")
    assert code == 1 and f"batch {batch} has no item 'nosuch'" in output


def test_reading_or_changing_a_database_file_that_does_not_exist_creates_nothing(sqlite_env, tmp_path):
    missing = tmp_path / "typo" / "polspec.db"
    env = dict(sqlite_env, POLSPEC_DB_URL=f"sqlite:///{missing}")
    # db current too: its "revision none (empty), run polspec db upgrade" led to an empty file at the typo
    for args in (["status"], ["results", "list"], ["results", "sql", "SELECT 1"], ["report", "1"], ["cancel", "1"],
                 ["recover"], ["retry", "1", "--failed"], ["db", "current"]):
        code, output = cli(env, *args)
        assert code == 1 and output.count("\n") == 1, args
        assert f"database sqlite:///{missing}: no such file, nothing has been stored there" in output
    assert not missing.parent.exists()


def test_the_default_database_starts_empty(isolated_home, sqlite_env):
    env = {key: value for key, value in sqlite_env.items() if key != "POLSPEC_DB_URL"}
    code, output = cli(env, "status")
    assert code == 0 and "no batches yet" in output and (isolated_home / "polspec.db").exists()


def test_an_export_follows_the_umask_and_replaces_a_file_whole(sqlite_env, batch, tmp_path):
    target = tmp_path / "wyniki.csv"
    previous = os.umask(0o027)
    try:
        code, output = cli(sqlite_env, "results", "export", str(batch), "--format", "csv", "--output", str(target))
    finally:
        os.umask(previous)
    assert code == 0, output
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # not the temporary file's private 0600
    assert len(target.read_text(encoding="utf-8-sig").splitlines()) == 4
    target.chmod(0o604)
    code, _ = cli(sqlite_env, "results", "export", str(batch), "--format", "jsonl", "--output", str(target))
    assert code == 0 and stat.S_IMODE(target.stat().st_mode) == 0o604  # a replaced file keeps its mode
    assert [json.loads(line)["status"] for line in target.read_text(encoding="utf-8").splitlines()] == ["queued"] * 3
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data", "wyniki.csv"]

    link = tmp_path / "latest.jsonl"
    link.symlink_to(target)
    code, _ = cli(sqlite_env, "results", "export", str(batch), "--output", str(link))
    assert code == 0 and link.is_symlink() and len(target.read_text(encoding="utf-8").splitlines()) == 3
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data", "latest.jsonl", "wyniki.csv"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_an_export_into_a_pipe_or_device_writes_into_it_and_leaves_it_one(sqlite_env, batch, tmp_path):
    fifo = tmp_path / "rows"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.extend(fifo.read_text(encoding="utf-8").splitlines()),
                              daemon=True)
    reader.start()
    code, output = cli(sqlite_env, "results", "export", str(batch), "--output", str(fifo))
    reader.join(30)
    assert code == 0 and fifo.is_fifo(), output  # not replaced by a file
    assert [json.loads(line)["status"] for line in received] == ["queued"] * 3
    log = tmp_path / "log.jsonl"
    log.write_text("earlier\n")
    with log.open("a") as appended:  # as a shell's `>> log.jsonl` opens it
        subprocess.run([sys.executable, "-c", "from polspec.cli import main; main()", "results", "export", str(batch),
                        "--output", "/dev/stdout"], stdout=appended, env=os.environ | sqlite_env, check=True)
    assert log.read_text().splitlines()[0] == "earlier" and len(log.read_text().splitlines()) == 4


def _read_or_none(descriptor: int) -> bytes | None:
    """What a terminal's other end has for us; None once its writer closed it (EIO on Linux)."""
    try:
        return os.read(descriptor, 4096) or None
    except OSError:
        return None


def test_an_export_to_standard_output_is_utf_8_whatever_the_locale(sqlite_env, batch):
    """A Polish ISO-8859-2 terminal has no „: the export to standard output was a traceback."""
    latin2 = os.environ | sqlite_env | {"PYTHONIOENCODING": "iso8859-2"}
    result = subprocess.run([sys.executable, "-c", "from polspec.cli import main; main()", "results", "export",
                             str(batch)], capture_output=True, env=latin2)
    assert result.returncode == 0, result.stderr
    assert "„Pana Tadeusza”" in result.stdout.decode("utf-8")
    # Tables and text for the terminal itself were tracebacks there (status's bar is drawn in
    # block characters, which ISO-8859-2 lacks; short-003 holds „ and ”). On a terminal what it
    # cannot show is a ?; into a file or a pipe, one line says so rather than change the text.
    for args in (["status"], ["results", "show", str(batch), "short-003"], ["results", "sql", "SELECT prompt FROM items"]):
        terminal, seen = pty.openpty()
        shown = subprocess.Popen([sys.executable, "-c", "from polspec.cli import main; main()", *args], stdout=seen,
                                 stderr=subprocess.PIPE, env=latin2)
        os.close(seen)
        printed = b""
        while chunk := _read_or_none(terminal):
            printed += chunk
        os.close(terminal)
        assert shown.wait() == 0 and shown.stderr.read() == b"", args
        assert "?Pana Tadeusza?" in printed.decode("iso8859-2") or args == ["status"], (args, printed)
        piped = subprocess.run([sys.executable, "-c", "from polspec.cli import main; main()", *args],
                               capture_output=True, env=latin2)
        assert piped.returncode == 1 and piped.stderr.decode().startswith(
            "polspec: error: standard output's encoding (iso8859-2) has no ") and piped.stderr.count(b"\n") == 1
    # JSON for scripts stays UTF-8 and whole there (status's went out in the locale's encoding).
    assert cli(sqlite_env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "1", "--name", "próba–łódź")[0] == 0
    shown = subprocess.run([sys.executable, "-c", "from polspec.cli import main; main()", "status", "--json"],
                           capture_output=True, env=latin2)
    assert shown.returncode == 0 and json.loads(shown.stdout.decode("utf-8").splitlines()[0])["name"] == "próba–łódź"


def test_an_output_of_a_dash_is_standard_output_and_exports_say_what_decoded_each_item(sqlite_env, batch, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["results", "export", str(batch), "--output", "-"], env=sqlite_env)
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert result.exit_code == 0 and [row["status"] for row in rows] == ["queued"] * 3
    assert result.stderr == f"note: batch {batch} is not finished: 3 of 3 items have no result yet\n"
    settings = {(row["target"], row["draft"], row["k"], row["prefix"], row["temperature"]) for row in rows}
    assert settings == {("gemma3-270m", None, None, None, 0.0)}  # target-only: no k, no prefix
    sweep_id = small_sweep(sqlite_env, tmp_path)
    code, output = cli(sqlite_env, "report", str(sweep_id), "--output", "-")
    assert code == 0 and output.startswith(f"# Sweep {sweep_id}: ")
    result = CliRunner().invoke(main, ["results", "export", str(sweep_id)], env=sqlite_env)
    cells = {(row["draft"], row["k"], row["prefix"], row["dataset"], row["prompt_key"], row["repeat"], row["baseline"])
             for row in map(json.loads, result.stdout.splitlines())}
    assert result.exit_code == 0 and cells == {(None, None, None, "pl-short", "short-001", 0, True),
                                               ("smollm2-135m", 2, 5, "pl-short", "short-001", 0, False)}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data", "sweep.toml"]
    code, _ = cli(sqlite_env, "results", "export", str(batch), "--output", "./-")  # a file named "-", asked for
    assert code == 0 and len((tmp_path / "-").read_text(encoding="utf-8").splitlines()) == 3


def test_an_export_or_report_into_the_database_itself_is_refused(sqlite_env, batch, tmp_path, monkeypatch):
    """It replaced every result with the export (`status` then read "file is not a database"), and
    replaced the write-ahead log's."""
    database = sqlite_file(make_url(sqlite_env["POLSPEC_DB_URL"]))
    monkeypatch.chdir(database.parent)
    (tmp_path / "linked.db").symlink_to(database)  # written through, as a shell's > would
    before = database.read_bytes()
    for command in (["results", "export", str(batch)], ["report", "1"]):
        for output in (str(database), database.name, f"{database.name}-wal", str(tmp_path / "linked.db")):
            code, said = cli(sqlite_env, *command, "--output", output)
            assert code == 2 and said.splitlines()[-1] == (f"Error: Invalid value for '--output': {output} is a file of "
                                                           f"polspec's database {database}; write to another file")
    assert database.read_bytes() == before and not Path(f"{database}-wal").exists()
    code, said = cli(sqlite_env, "results", "list", "--json")
    assert code == 0 and [json.loads(line)["status"] for line in said.splitlines()] == ["queued"] * 3


def test_the_output_file_extension_chooses_the_format_unless_one_is_given(sqlite_env, batch, tmp_path):
    sweep_id = small_sweep(sqlite_env, tmp_path)
    written = {}
    for command, name in [(["results", "export", str(batch)], "items.CSV"), (["results", "export", str(batch)], "items.jsonl"),
                          (["results", "export", str(batch), "--format", "jsonl"], "typed.csv"),
                          (["results", "export", str(batch)], "items.txt"), (["report", str(sweep_id)], "report.csv"),
                          (["report", str(sweep_id)], "report.json"), (["report", str(sweep_id)], "report.txt")]:
        code, output = cli(sqlite_env, *command, "--output", str(tmp_path / name))
        assert code == 0, output
        written[name] = (tmp_path / name).read_text(encoding="utf-8")
    assert written["items.CSV"].startswith("\ufeffbatch,id,status,")
    assert [json.loads(line)["status"] for line in written["items.jsonl"].splitlines()] == ["queued"] * 3
    assert written["typed.csv"] == written["items.txt"] == written["items.jsonl"]  # typed, or no format named
    assert written["report.csv"].startswith("dataset,") and json.loads(written["report.json"])["sweep"] == sweep_id
    assert written["report.txt"].startswith(f"# Sweep {sweep_id}: ")


@pytest.mark.parametrize("args", [
    ["enqueue", "generate", "--dataset", "pl-short", "--limit", "1", "--name", "pr\udcf3ba"],  # Latin-2 "próba"
    ["results", "show", "1", "\udcff"],
    ["results", "sql", "select '\udcff'"],
])
def test_an_argument_that_is_not_utf8_is_one_line_before_anything_runs(sqlite_env, batch, args):
    code, output = cli(sqlite_env, *args)
    shown = args[-1].replace("\udcf3", "\\xf3").replace("\udcff", "\\xff")
    assert code == 1 and output.startswith(f"polspec: error: the argument '{shown}' is not UTF-8: byte 0x")
    assert output.count("\n") == 1
    code, output = cli(sqlite_env, "status", "--json")
    assert code == 0 and [json.loads(line)["batch"] for line in output.splitlines()] == [batch]  # nothing enqueued


def test_an_output_that_cannot_be_written_is_one_line_and_leaves_nothing(sqlite_env, batch, tmp_path):
    blocker = tmp_path / "a-file"  # a file where a directory should be: refused even for root
    blocker.write_text("")
    code, output = cli(sqlite_env, "results", "export", str(batch), "--output", str(blocker / "x.csv"))
    assert code == 1 and output == f"polspec: error: {blocker / 'x.csv'}: {blocker} is not a directory\n"
    code, output = cli(sqlite_env, "results", "export", str(batch), "--output", str(tmp_path / "no" / "x.csv"))
    assert code == 1 and "does not exist" in output and output.count("\n") == 1
    if platform.system() == "Linux":  # a directory no file can be created in
        code, output = cli(sqlite_env, "results", "export", str(batch), "--output", "/proc/polspec-x.csv")
        assert code == 1 and output.startswith("polspec: error: /proc/polspec-x.csv: cannot write there:")
        assert output.count("\n") == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a-file", "data"]


def test_a_report_or_its_plots_that_cannot_be_written_leave_nothing_behind(sqlite_env, tmp_path):
    sweep_id = small_sweep(sqlite_env, tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    report = tmp_path / "report.md"
    code, output = cli(sqlite_env, "report", str(sweep_id), "--output", str(report), "--plots", str(blocker / "plots"))
    assert code == 1 and output.startswith(f"polspec: error: {blocker / 'plots'}: cannot make the plots directory")
    assert output.count("\n") == 1 and not report.exists()
    code, output = cli(sqlite_env, "report", str(sweep_id), "--plots", "")  # it wrote into the working directory
    assert code == 2 and output.splitlines()[-1] == ("Error: Invalid value for '--plots': needs a folder, got an "
                                                     "empty path (. is the working directory)")
    taken = tmp_path / "taken"
    (taken / "acceptance.png").mkdir(parents=True)  # a folder where a plot goes
    code, output = cli(sqlite_env, "report", str(sweep_id), "--output", str(report), "--plots", str(taken))
    assert code == 1 and output == (f"polspec: error: {taken / 'acceptance.png'}: cannot write there: "
                                    "Is a directory\n") and not report.exists()
    plots = tmp_path / "plots"
    for folder in (plots, plots / "of" / "sweep"):
        code, output = cli(sqlite_env, "report", str(sweep_id), "--output", str(tmp_path / "no" / "r.md"),
                           "--plots", str(folder))
        assert code == 1 and output == f"polspec: error: {tmp_path / 'no' / 'r.md'}: {tmp_path / 'no'} does not exist\n"
        assert not plots.exists()  # the plots it had written are gone with every folder it made
    plots.mkdir()
    (plots / "mine.txt").write_text("keep")
    code, output = cli(sqlite_env, "report", str(sweep_id), "--output", str(tmp_path / "no" / "r.md"), "--plots", str(plots))
    assert code == 1 and [path.name for path in plots.iterdir()] == ["mine.txt"]

    code, output = cli(sqlite_env, "report", str(sweep_id), "--output", str(report), "--plots", str(plots))
    assert code == 0 and report.read_text(encoding="utf-8").startswith("#")
    assert output.endswith(f"sweep {sweep_id} has no speculative results yet (0 of 2 generations done), so its tables are empty\n")
    assert f"wrote {report}\n" in output and len(list(plots.glob("*.png"))) == 3


def test_plots_on_a_disk_that_fills_stay_whole(sqlite_env, tmp_path, tiny_disk):
    """savefig wrote into the old plot in place: a disk that filled while a plot was written
    left it cut off."""
    sweep_id = small_sweep(sqlite_env, tmp_path)
    plots = tiny_disk / "plots"
    code, output = cli(sqlite_env, "report", str(sweep_id), "--plots", str(plots))
    assert code == 0 and len(list(plots.glob("*.png"))) == 3, output
    before = {path.name: path.read_bytes() for path in plots.iterdir()}
    with contextlib.suppress(OSError), open(tiny_disk / "filler", "wb", buffering=0) as filler:
        while True:  # until the disk is full
            filler.write(b"\0" * 65536)
    code, output = cli(sqlite_env, "report", str(sweep_id), "--plots", str(plots))
    assert code == 1 and re.fullmatch(rf"polspec: error: {re.escape(str(plots))}/[a-z-]+\.png: cannot write there: "
                                      r"No space left on device\n", output), output
    assert {path.name: path.read_bytes() for path in plots.iterdir()} == before  # every plot whole, no stray file


def test_the_read_only_query_cannot_create_a_file_or_run_nothing(sqlite_env, batch, tmp_path):
    other = tmp_path / "other.db"
    code, output = cli(sqlite_env, "results", "sql", f"ATTACH DATABASE '{other}' AS other")
    assert code == 1 and output.startswith("polspec: error: the database refused the query: not authorized")
    assert not other.exists()
    code, output = cli(sqlite_env, "results", "sql", "  ")
    assert code == 1 and output == "polspec: error: the query is empty\n"
    for write in ("DELETE FROM items", "CREATE TABLE mine (a)"):  # SQLite said "attempt to write a readonly database"
        code, output = cli(sqlite_env, "results", "sql", write)
        assert (code, output) == (1, "polspec: error: results sql only reads: the query would change the database "
                                     "(attempt to write a readonly database)\n")
    code, output = cli(sqlite_env, "results", "sql", "SELECT count(*) AS n FROM items", "--json")
    assert code == 0 and json.loads(output) == {"n": 3}
    code, output = cli(sqlite_env, "results", "sql", "SELECT 1e999 AS big, -1e999 AS small, 0.5 AS half", "--json")
    assert code == 0 and json.loads(output) == {"big": "inf", "small": "-inf", "half": 0.5}  # strict JSON
    code, output = cli(sqlite_env, "results", "sql", "SELECT 1 AS a, 2 AS a", "--json")
    assert code == 1 and output == ("polspec: error: the query returns two columns named 'a'; for --json, name "
                                    "them apart with AS\n")


def test_items_of_every_batch_are_listed_the_newest_batch_first(sqlite_env, batch):
    """As status lists batches: the oldest batch's first items filled the default 20 rows."""
    newer = json.loads(cli(sqlite_env, "enqueue", "generate", "--dataset", "pl-wiki", "--limit", "2", "--json")[1])
    result = CliRunner().invoke(main, ["results", "list", "--json", "--limit", "3"], env=sqlite_env)
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(row["batch"], row["id"]) for row in rows] == [(newer["batch"], "wiki-001"), (newer["batch"], "wiki-002"),
                                                           (batch, "short-001")]
    assert result.stderr == "the first 3 items, the newest batch first; --limit 0 shows all\n"


def test_an_output_extension_that_names_no_format_is_noted(sqlite_env, batch, tmp_path):
    """wyniki.tsv was written as JSON lines without a word."""
    target = tmp_path / "wyniki.tsv"
    result = CliRunner().invoke(main, ["results", "export", str(batch), "--output", str(target)], env=sqlite_env)
    assert result.exit_code == 0 and result.stderr.startswith(
        f"note: {target}: .tsv names none of the formats (csv, jsonl): writing jsonl; --format chooses\n")
    assert [json.loads(line)["status"] for line in target.read_text(encoding="utf-8").splitlines()] == ["queued"] * 3


def test_sql_as_json_gives_numbers_as_numbers_on_either_database(any_db_env):
    """PostgreSQL returns an average or a rounding as numeric: it went out as the string
    "2.0000000000000000" where SQLite's went out as 2.0."""
    code, output = cli(any_db_env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "3", "--json")
    assert code == 0, output
    code, output = cli(any_db_env, "results", "sql", "SELECT avg(id) AS mean, round(avg(id) / 4, 2) AS quarter, "
                                                     "max(created_at) AS newest FROM items", "--json")
    row = json.loads(output)
    assert code == 0 and (row["mean"], row["quarter"]) == (2, 0.5) and not isinstance(row["quarter"], str), row
    assert re.fullmatch(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d.*", row["newest"]), row


# Runs the CLI commands given as JSON, printing each one's exit code and output as JSON.
COMMANDS_AS_JSON = """
import json, sys
from click.testing import CliRunner
from polspec.cli import main
print(json.dumps([(r.exit_code, r.output) for r in (CliRunner().invoke(main, a) for a in json.loads(sys.argv[1]))]))
"""


def cli_on_a_read_only_mount(env: dict[str, str], place: Path, commands: list[list[str]]) -> list[tuple[int, str]]:
    """Each command's exit code and output with the folder ``place`` mounted read-only over
    itself, in a mount namespace of their own."""
    mount = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$1" -c "$2" "$3"'
    result = subprocess.run(["unshare", "-m", "sh", "-c", mount, str(place), sys.executable, COMMANDS_AS_JSON,
                             json.dumps(commands)], env=os.environ | env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return [tuple(answer) for answer in json.loads(result.stdout)]


def can_mount() -> bool:
    try:
        return os.geteuid() == 0 and subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0
    except OSError:  # no unshare
        return False


@pytest.mark.skipif(not can_mount(), reason="mounting a folder read-only needs root and unshare")
def test_a_database_on_read_only_storage_is_read_as_it_stands(sqlite_env, batch, tmp_path):
    """A database copied alone onto a read-only mount (no -wal or -shm beside it, as a clean
    close or a copy leaves it) reads as it does where it was written."""
    place = tmp_path / "mounted"
    place.mkdir()
    copy = place / "copy.db"
    with closing(sqlite3.connect(sqlite_file(make_url(sqlite_env["POLSPEC_DB_URL"])))) as source, \
            closing(sqlite3.connect(copy)) as target:
        source.backup(target)
    with closing(sqlite3.connect(copy)) as check:
        assert check.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    env = dict(sqlite_env, POLSPEC_DB_URL=f"sqlite:///{copy}")
    commands = [["results", "list", "--json"], ["results", "show", str(batch), "short-001", "--json"],
                ["results", "export", str(batch)], ["results", "sql", "SELECT count(*) AS n FROM items", "--json"],
                ["status", str(batch), "--json"]]
    read = cli_on_a_read_only_mount(env, place, commands)
    assert [code for code, _ in read] == [0] * len(commands), read
    assert [output for _, output in read[:4]] == [cli(sqlite_env, *args)[1] for args in commands[:4]]
    assert json.loads(read[4][1])["status"] == "queued" and json.loads(read[4][1])["total"] == 3

    downgrade(env["POLSPEC_DB_URL"], "0005")
    (code, output), = cli_on_a_read_only_mount(env, place, [["results", "list"]])
    assert code == 1 and output.count("\n") == 1
    assert output.startswith(f"polspec: error: database sqlite:///{copy} is at revision 0005, polspec needs ")
    assert output.endswith(", and it lies on read-only storage: run polspec db upgrade on a copy that can be "
                           "written\n")


def test_show_cuts_a_long_prompt_short_and_json_keeps_it_whole(sqlite_env, tmp_path):
    source = tmp_path / "long.jsonl"
    long_prompt = "Kraków leży nad Wisłą. " * 100
    source.write_text(json.dumps({"id": "long", "prompt": long_prompt}, ensure_ascii=False) + "\n", encoding="utf-8")
    code, output = cli(sqlite_env, "enqueue", "generate", "--input", str(source), "--json")
    batch = json.loads(output)["batch"]
    code, output = cli(sqlite_env, "results", "show", str(batch), "long")
    assert code == 0 and f"prompt: {long_prompt[:400]}... (2,300 characters; --json gives it whole)" in output
    shown = json.loads(cli(sqlite_env, "results", "show", str(batch), "long", "--json")[1])
    assert shown["prompt"] == long_prompt
    # What it decodes with, as an export gives it: a target-only item has no k, though its
    # parameters hold the default.
    assert (shown["draft"], shown["settings"]["k"], shown["params"]["k"]) == (None, None, 2)
    decoded_by = next(line for line in output.splitlines() if line.startswith("decoded by: "))
    assert decoded_by.startswith("decoded by: gemma3-270m (temperature=0.0, ") and not re.search(r"\bk=", decoded_by)


def test_retry_says_which_items_it_queues_again(sqlite_env, batch):
    code, output = cli(sqlite_env, "retry", str(batch))
    assert code == 2 and "say which items to queue again: --failed, --cancelled or both" in output
    code, output = cli(sqlite_env, "retry", str(batch), "--failed", "--cancelled")
    assert code == 0 and output == f"batch {batch} has no failed or cancelled items\n"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
@pytest.mark.parametrize("args", [["--help"], ["results", "list"]])
def test_a_full_stdout_is_one_line_and_a_failure(sqlite_env, batch, args):
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-c", f"from polspec.cli import main; main({args!r})"],
                                stdout=full, stderr=subprocess.PIPE, text=True, env={**os.environ, **sqlite_env})
    assert result.returncode == 1
    assert result.stderr == "polspec: error: cannot write the output: No space left on device\n"


def test_a_cut_list_says_so_and_a_report_names_a_batch_that_is_no_sweep(sqlite_env, batch):
    code, output = cli(sqlite_env, "results", "list", "--limit", "2", "--json")
    assert code == 0 and output.count("\n") == 3 and "the first 2 items, the newest batch first; --limit 0 shows all" in output
    code, output = cli(sqlite_env, "results", "list", "--limit", "3", "--json")
    assert code == 0 and output.count("\n") == 3 and "--limit 0" not in output
    code, output = cli(sqlite_env, "results", "list", "--limit", str(2**63 - 1))  # the database's integers end there
    assert code == 2 and "Invalid value for '--limit'" in output and "Traceback" not in output
    code, output = cli(sqlite_env, "report", str(batch))
    assert code == 1 and output == (f"polspec: error: batch {batch} is a generate batch, not a sweep: "
                                    f"polspec results list --batch {batch} shows its items\n")


def test_square_brackets_and_emoji_codes_in_ids_names_and_sql_print_as_they_are(sqlite_env, tmp_path):
    """Tables print users' text verbatim: Rich markup would hide ``[b]`` and fail on ``[/]``, and
    its emoji codes would print ``:fire:`` as a picture."""
    source = tmp_path / "p.jsonl"
    rows = [{"id": "[/]", "prompt": "Kraków leży"}, {"id": "[b]q:fire:", "prompt": "Wisła"}]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    code, output = cli(sqlite_env, "enqueue", "generate", "--input", str(source), "--name", "[/]names:smile:", "--json")
    assert code == 0, output
    code, output = cli(sqlite_env, "status")
    assert code == 0 and "[/]names:smile:" in output
    code, output = cli(sqlite_env, "results", "list")
    assert code == 0 and "[/]" in output and "[b]q:fire:" in output
    code, output = cli(sqlite_env, "results", "sql", "SELECT '[/]' AS x, '[bold]y:thumbs_up:' AS y")
    assert code == 0 and "[/]" in output and "[bold]y:thumbs_up:" in output


def test_a_file_that_is_no_database_is_one_line_for_every_reading_command(sqlite_env, tmp_path):
    notes = tmp_path / "notes.db"
    notes.write_text("garbage\n")
    env = dict(sqlite_env, POLSPEC_DB_URL=f"sqlite:///{notes}")
    for args in (["status"], ["results", "list"], ["results", "sql", "SELECT 1"], ["report", "1"], ["db", "upgrade"]):
        code, output = cli(env, *args)
        assert code == 1 and output == f"polspec: error: database sqlite:///{notes}: file is not a database\n", args
    assert notes.read_text() == "garbage\n"


def test_a_directory_named_as_the_database_is_one_line_for_every_command(sqlite_env, tmp_path):
    env = dict(sqlite_env, POLSPEC_DB_URL=f"sqlite:///{tmp_path}")
    for args in (["status"], ["results", "list"], ["db", "current"], ["db", "upgrade"], ["worker", "--burst"]):
        code, output = cli(env, *args)
        assert code == 1 and output == f"polspec: error: database sqlite:///{tmp_path}: a directory, not a database " \
                                       "file\n", args


def test_reading_a_database_of_other_tables_adds_nothing_to_it(sqlite_env, tmp_path):
    shop = tmp_path / "shop.db"
    with sqlite3.connect(shop) as connection:
        connection.execute("CREATE TABLE customers (name TEXT)")
    env = dict(sqlite_env, POLSPEC_DB_URL=f"sqlite:///{shop}")
    for args in (["status"], ["results", "list"], ["report", "1"]):
        code, output = cli(env, *args)
        assert code == 1 and output.count("\n") == 1, args
        assert f"database sqlite:///{shop} holds tables that are not polspec's (customers) and none of polspec's" in output
    assert cli(env, "db", "current")[0] == 0  # asking for the revision is no write either
    with sqlite3.connect(shop) as connection:
        assert connection.execute("SELECT name FROM sqlite_master").fetchall() == [("customers",)]
        assert connection.execute("PRAGMA journal_mode").fetchone() == ("delete",)  # not switched to WAL


def test_a_database_downgraded_to_base_is_polspecs_and_empty(sqlite_env):
    assert cli(sqlite_env, "db", "upgrade")[0] == 0
    downgrade(sqlite_env["POLSPEC_DB_URL"], "base")  # leaves an empty alembic_version table
    code, output = cli(sqlite_env, "status")
    assert code == 0 and "no batches yet" in output
