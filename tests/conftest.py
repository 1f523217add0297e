"""Shared fixtures: real models from the offline registry, an isolated POLSPEC_HOME.

Models load from the normal cache (``POLSPEC_HOME`` or ``~/.cache/polspec``) so that runs on
one machine fetch them once; tests that inspect or dirty the cache use ``isolated_home``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

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
