"""Imports run one way: jobs/ (what a batch asks for, how it is enqueued) never imports worker/."""

from __future__ import annotations

import ast
from pathlib import Path

import polspec


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module a file of ``package`` imports, relative imports resolved, and for ``from A
    import B`` both A and A.B (B may be a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) + 1 - node.level] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_the_check_sees_every_form_of_import(tmp_path):
    source = tmp_path / "example.py"
    source.write_text("import polspec.worker.tasks\nfrom polspec import worker\nfrom ..worker import run\n"
                      "from . import queue\n")
    assert {"polspec.worker.tasks", "polspec.worker", "polspec.worker.run", "polspec.jobs.queue"} <= \
        imported_modules(source, "polspec.jobs")


def test_jobs_never_imports_the_worker():
    jobs = Path(polspec.__file__).parent / "jobs"
    upward = {f"{path.name}: {name}" for path in jobs.glob("*.py") for name in imported_modules(path, "polspec.jobs")
              if name == "polspec.worker" or name.startswith("polspec.worker.")}
    assert upward == set()
