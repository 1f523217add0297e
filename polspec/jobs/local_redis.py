"""A private redis-server for one command, when no Redis is reachable (the demo uses it).

Started the way a queue wants it: loopback only, AOF on with ``appendfsync everysec``,
``noeviction``, data under ``$POLSPEC_HOME/redis``; stopped (with its AOF flushed) afterwards.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import redis

from polspec.errors import PolspecError
from polspec.jobs.queue import check_redis_url, connect, display_redis_url
from polspec.settings import polspec_home, redis_url

START_TIMEOUT_S = 10.0


@contextmanager
def redis_available(url: str | None = None, data: Path | None = None) -> Iterator[bool]:
    """Yield with Redis reachable at ``url``; True when it had to be started here (and is stopped after),
    keeping its data in ``data`` (default ``$POLSPEC_HOME/redis``, where the queue outlives the command).

    Only a loopback URL is started locally: a remote one that does not answer is an error.
    """
    url = url or redis_url()
    check_redis_url(url)  # a URL that is wrong is no reason to start a server
    try:
        connect(url)
    except PolspecError:
        parts = urlsplit(url)
        if parts.hostname not in ("127.0.0.1", "localhost") or parts.scheme != "redis":
            raise
    else:
        yield False
        return
    server = _start(parts.port or 6379, url, data or polspec_home() / "redis")
    try:
        yield True
    finally:
        server.terminate()
        server.wait(timeout=30)


def _start(port: int, url: str, data: Path) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    if binary is None:
        raise PolspecError(f"no Redis at {display_redis_url(url)} and redis-server is not installed "
                           "(scripts/setup installs it)")
    data.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data), "--appendonly", "yes",
         "--appendfsync", "everysec", "--maxmemory-policy", "noeviction", "--save", "", "--daemonize", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            client.ping()
            return server
        except (redis.ConnectionError, redis.BusyLoadingError):
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                reason = (server.stderr.read() or b"").decode(errors="replace").strip().splitlines()
                raise PolspecError(f"could not start redis-server on port {port}: "
                                   f"{reason[-1] if reason else 'no answer'}") from None
            time.sleep(0.05)
