"""Settings read from the environment; nothing else in polspec reads it.

``POLSPEC_HOME`` (default ``~/.cache/polspec``) holds caches and data;
``POLSPEC_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``) is the queue;
``POLSPEC_DB_URL`` (default a SQLite file under ``POLSPEC_HOME``) is the results database and
``POLSPEC_DB_BUSY_TIMEOUT_MS`` how long SQLite waits for another writer;
``POLSPEC_DEVICE``, ``POLSPEC_DTYPE`` and ``POLSPEC_BLAS`` choose the MLX backend (see
:mod:`polspec.backend`); ``POLSPEC_MODEL_CACHE_GB`` bounds the models a worker keeps loaded.
A value that is set but wrong is a one-line :class:`PolspecError` naming the variable.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from polspec.errors import PolspecError
from polspec.files import user_path


def polspec_home() -> Path:
    """The data directory; created on first use."""
    given = os.environ.get("POLSPEC_HOME", "").strip()
    # Absolute, so that messages and the database URL name the folder a worker started from
    # another directory would not find.
    home = user_path(given).absolute() if given else Path.home() / ".cache" / "polspec"
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file in the way, a read-only or full disk
        problem = "is a file, not a directory" if isinstance(error, FileExistsError) else \
            f"cannot be created: {error.strerror}"
        where = "POLSPEC_HOME" if given else "polspec's data directory"
        raise PolspecError(f"{where} {home} {problem}") from None
    return home


def models_dir() -> Path:
    """Imported MLX model directories, one per GGUF file, keyed by the file's sha256."""
    return polspec_home() / "models"


def blobs_dir() -> Path:
    """Files assembled from packages on the index (GGUF weights, tokenizer models)."""
    return polspec_home() / "blobs"


def locks_dir() -> Path:
    """Lock files of the caches above, one per entry, kept apart so that the caches hold only data."""
    return polspec_home() / "locks"


def user_registry_file() -> Path:
    """The user's own model aliases, merged over the built-in registry."""
    return polspec_home() / "models.toml"


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_url() -> str:
    return os.environ.get("POLSPEC_REDIS_URL") or DEFAULT_REDIS_URL


def database_url() -> str:
    """Any SQLAlchemy URL; default ``sqlite:///$POLSPEC_HOME/polspec.db``."""
    return os.environ.get("POLSPEC_DB_URL") or f"sqlite:///{polspec_home() / 'polspec.db'}"


def database_url_set() -> bool:
    """Whether the user chose the database (``POLSPEC_DB_URL``) rather than taking the default."""
    return bool(os.environ.get("POLSPEC_DB_URL"))



DEFAULT_BUSY_TIMEOUT_MS = 30_000
MAX_BUSY_TIMEOUT_MS = 2**31 - 1  # SQLite keeps it in a C int: past it the timeout reads back as 0, no wait


def db_busy_timeout_ms() -> int:
    """How long a SQLite connection waits for another writer: ``POLSPEC_DB_BUSY_TIMEOUT_MS``."""
    raw = os.environ.get("POLSPEC_DB_BUSY_TIMEOUT_MS")
    if not raw:
        return DEFAULT_BUSY_TIMEOUT_MS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_BUSY_TIMEOUT_MS:
        raise PolspecError(f"POLSPEC_DB_BUSY_TIMEOUT_MS must be a whole number of milliseconds up to "
                           f"{MAX_BUSY_TIMEOUT_MS}, got {raw!r}")
    return value


DEFAULT_MODEL_CACHE_FRACTION = 0.6


def model_cache_bytes() -> int:
    """How much model weight a worker keeps loaded: ``POLSPEC_MODEL_CACHE_GB`` if set, else 60%
    of physical memory."""
    raw = os.environ.get("POLSPEC_MODEL_CACHE_GB")
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 1 <= value * 1e9 < math.inf:  # nan fails this too
            raise PolspecError(f"POLSPEC_MODEL_CACHE_GB must be a positive number of gigabytes, got {raw!r}")
        return int(value * 1e9)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * DEFAULT_MODEL_CACHE_FRACTION)


DEVICES = ("cpu", "gpu")
DTYPES = ("float32", "float16", "bfloat16", "native")


def mlx_device(default: str) -> str:
    """``POLSPEC_DEVICE``, one of :data:`DEVICES`; ``default`` when unset."""
    return _choice("POLSPEC_DEVICE", DEVICES, default)


def mlx_dtype(default: str) -> str:
    """``POLSPEC_DTYPE``, one of :data:`DTYPES`; ``default`` when unset."""
    return _choice("POLSPEC_DTYPE", DTYPES, default)


def _choice(name: str, allowed: tuple[str, ...], default: str) -> str:
    value = os.environ.get(name, "").strip().lower() or default
    if value not in allowed:
        raise PolspecError(f"{name}={value!r} is not one of {', '.join(allowed)}")
    return value


def blas_choice() -> str:
    """``POLSPEC_BLAS``: ``off`` (in any case), a path to a BLAS library, or empty for the
    bundled OpenBLAS."""
    value = os.environ.get("POLSPEC_BLAS", "").strip()
    return "off" if value.lower() == "off" else value


# The variables OpenBLAS reads for its thread count, in its own order of precedence.
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")


def blas_threads_set() -> bool:
    """Whether the user chose the BLAS's thread count (:data:`BLAS_THREAD_VARIABLES`): polspec then
    leaves it as it is (see :mod:`polspec.cpu_share`)."""
    return any(os.environ.get(name, "").strip() for name in BLAS_THREAD_VARIABLES)


def columns_set() -> bool:
    """Whether ``COLUMNS`` is set; Rich then takes the output width from it."""
    return "COLUMNS" in os.environ
