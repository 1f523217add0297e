"""Where polspec keeps its caches and data (``POLSPEC_HOME``, default ``~/.cache/polspec``)."""

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
