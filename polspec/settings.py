"""Settings read from the environment: the data directory, the Redis URL, the database URL.

``POLSPEC_HOME`` (default ``~/.cache/polspec``) holds caches and data;
``POLSPEC_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``) is the queue;
``POLSPEC_DB_URL`` (default a SQLite file under ``POLSPEC_HOME``) is the results database.
"""

from __future__ import annotations

import os
from pathlib import Path


def polspec_home() -> Path:
    """The data directory; created on first use."""
    home = Path(os.environ.get("POLSPEC_HOME") or Path.home() / ".cache" / "polspec").expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return home


def models_dir() -> Path:
    """Imported MLX model directories, one per GGUF file, keyed by the file's sha256."""
    return polspec_home() / "models"


def blobs_dir() -> Path:
    """Files assembled from packages on the index (GGUF weights, tokenizer models)."""
    return polspec_home() / "blobs"


def user_registry_file() -> Path:
    """The user's own model aliases, merged over the built-in registry."""
    return polspec_home() / "models.toml"


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_url() -> str:
    return os.environ.get("POLSPEC_REDIS_URL") or DEFAULT_REDIS_URL


def database_url() -> str:
    """Any SQLAlchemy URL; default ``sqlite:///$POLSPEC_HOME/polspec.db``."""
    return os.environ.get("POLSPEC_DB_URL") or f"sqlite:///{polspec_home() / 'polspec.db'}"

