"""Answers of the reference implementation, kept between test runs on one machine.

transformers reading a GGUF file is what the importer is tested against, and it is slow on a
2-core CPU (10-40 s a model: it reads and converts the whole file); so is gguf's own reader over
Qwen's 1.5B file, whose vocabulary the tiktoken reference is built from. An answer depends only on
the file, the question, the code that asks it and the versions of the libraries that answer,
so it is computed once per machine and kept under POLSPEC_HOME beside the fetched models; a
change to any of those computes it anew. The polspec side of each comparison always runs.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from polspec.settings import polspec_home

REFERENCE_PACKAGES = ("transformers", "torch", "tokenizers", "gguf")


def _path(kind: str, sha256: str, question: Any, compute: Callable, suffix: str) -> Path:
    versions = {name: _version(name) for name in REFERENCE_PACKAGES}
    key = json.dumps([kind, sha256, question, inspect.getsource(compute), versions], sort_keys=True, ensure_ascii=False)
    folder = polspec_home() / "test-references"
    folder.mkdir(exist_ok=True)
    return folder / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:32]}{suffix}"


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:  # not installed: part of the key all the same
        return None


def _kept(path: Path, compute: Callable[[], Any], write: Callable[[Path, Any], None], read: Callable[[Path], Any]) -> Any:
    """What ``read`` gives back from ``path``, written there first (whole or not at all) from
    ``compute()`` when it is not there yet."""
    if not path.exists():
        partial = path.with_name(f"partial-{path.name}")
        write(partial, compute())
        partial.replace(path)
    return read(path)


def kept_array(kind: str, sha256: str, question: Any, compute: Callable[[], np.ndarray]) -> np.ndarray:
    """``compute()`` for the GGUF file ``sha256`` and ``question`` (JSON), from the machine's
    store when it was computed before by the same code with the same reference libraries."""
    return _kept(_path(kind, sha256, question, compute, ".npy"), compute, np.save, np.load)


def kept_json(kind: str, sha256: str, question: Any, compute: Callable[[], Any]) -> Any:
    """Like :func:`kept_array` for an answer that JSON holds (as JSON gives it back: lists, not tuples)."""
    return _kept(_path(kind, sha256, question, compute, ".json"), compute,
                 lambda path, answer: path.write_text(json.dumps(answer, ensure_ascii=False)),
                 lambda path: json.loads(path.read_text()))
