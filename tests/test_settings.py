"""Settings: every environment variable is read in polspec.settings, and bad values are one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import polspec
from polspec.cli import main
from polspec.errors import PolspecError
from polspec.settings import database_url, db_busy_timeout_ms, model_cache_bytes, polspec_home


def test_only_settings_reads_the_environment():
    package = Path(polspec.__file__).parent
    readers = [str(path.relative_to(package)) for path in sorted(package.rglob("*.py"))
               if path.name != "settings.py" or path.parent != package
               if re.search(r"\benviron\b|\bgetenv\b", path.read_text(encoding="utf-8"))]
    assert readers == []


def test_the_model_cache_budget_is_gigabytes_or_a_share_of_memory(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("POLSPEC_MODEL_CACHE_GB", "2.5")
    assert model_cache_bytes() == 2_500_000_000
    monkeypatch.delenv("POLSPEC_MODEL_CACHE_GB")
    assert model_cache_bytes() > 0
    for bad in ("lots", "0", "nan", "inf", "1e400", "1e300", "1e-12"):
        monkeypatch.setenv("POLSPEC_MODEL_CACHE_GB", bad)
        with pytest.raises(PolspecError, match=f"^POLSPEC_MODEL_CACHE_GB must be a positive number of gigabytes, "
                                               f"got '{bad}'$"):
            model_cache_bytes()


def test_the_busy_timeout_is_milliseconds_sqlite_can_hold(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("POLSPEC_DB_BUSY_TIMEOUT_MS", str(2**31 - 1))
    assert db_busy_timeout_ms() == 2**31 - 1
    for bad in ("soon", "-1", str(2**31)):  # 2**31 read back from SQLite as 0: no wait at all
        monkeypatch.setenv("POLSPEC_DB_BUSY_TIMEOUT_MS", bad)
        with pytest.raises(PolspecError, match=f"^POLSPEC_DB_BUSY_TIMEOUT_MS must be a whole number of milliseconds "
                                               f"up to 2147483647, got '{bad}'$"):
            db_busy_timeout_ms()


def test_a_home_that_is_a_file_is_one_line_for_every_command(tmp_path):
    home = tmp_path / "home"
    home.write_text("not a directory")
    for args in (["models", "list"], ["status"], ["enqueue", "generate", "--dataset", "pl-short", "--limit", "1"],
                 ["doctor"]):
        result = CliRunner().invoke(main, args, env={"POLSPEC_HOME": str(home), "POLSPEC_DB_URL": ""})
        assert result.exit_code == 1 and result.output.endswith(
            f"polspec: error: POLSPEC_HOME {home} is a file, not a directory\n"), (args, result.output)


def test_a_relative_or_padded_home_is_made_absolute_from_the_working_directory(tmp_path, monkeypatch):
    """" data" made a folder named " data"; a relative home was named relative in messages and
    in the database URL, which a worker started in another directory reads as another file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POLSPEC_HOME", " data ")
    monkeypatch.delenv("POLSPEC_DB_URL", raising=False)
    assert polspec_home() == tmp_path / "data" and (tmp_path / "data").is_dir()
    assert database_url() == f"sqlite:///{tmp_path / 'data' / 'polspec.db'}"
    monkeypatch.setenv("POLSPEC_HOME", "  ")  # blank: the default, not a folder named by spaces
    assert polspec_home() == Path.home() / ".cache" / "polspec" and sorted(tmp_path.iterdir()) == [tmp_path / "data"]
