"""Imports run one way: jobs/ (what a batch asks for, how it is enqueued) never imports worker/."""

from __future__ import annotations

import ast
from pathlib import Path

import polspec


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_jobs_never_imports_the_worker():
    jobs = Path(polspec.__file__).parent / "jobs"
    upward = {f"{path.name}: {name}" for path in jobs.glob("*.py") for name in imported_modules(path)
              if name == "polspec.worker" or name.startswith("polspec.worker.")}
    assert upward == set()
