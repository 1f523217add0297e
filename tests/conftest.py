"""Shared fixtures: real models from the offline registry, an isolated POLSPEC_HOME.

Models load from the normal cache (``POLSPEC_HOME`` or ``~/.cache/polspec``) so that runs on
one machine fetch them once; tests that inspect or dirty the cache use ``isolated_home``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from polspec import backend  # noqa: F401  (before anything imports mlx: the Linux BLAS fix)
from polspec.models.loader import LoadedModel, load_model

POLISH_TEXT = (
    "Kraków jest jednym z najstarszych i największych miast w Polsce. Przez wieki był stolicą "
    "kraju, a jego Stare Miasto zostało wpisane na listę światowego dziedzictwa UNESCO."
)
ENGLISH_TEXT = (
    "The quick brown fox jumps over the lazy dog. London is the capital and largest city of "
    "England and the United Kingdom."
)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3() -> LoadedModel:
    return load_model("gemma3-270m")


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


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server of our own on a free loopback port, with AOF on like production."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (scripts/test installs it)")
    port = _free_port()
    data = tmp_path_factory.mktemp("redis")
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
         "--appendonly", "yes", "--save", "", "--daemonize", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail(f"redis-server did not start on port {port}")
            time.sleep(0.05)
    yield url
    server.terminate()
    server.wait(timeout=10)


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on."""
    return _free_port()
