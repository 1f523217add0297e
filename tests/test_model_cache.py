"""Processes that share the model cache (two workers starting on a fresh machine) build each
entry once, and none replaces a whole copy that another may be reading."""

from __future__ import annotations

import json
import threading

import pytest

from polspec.models.fetch import cache_lock
from polspec.models.files import IMPORT_FORMAT, imported_dir, import_gguf_file
from polspec.settings import models_dir

from helpers import wait_for


@pytest.mark.slow
def test_an_import_waits_for_the_one_in_progress_and_keeps_what_it_made(isolated_home, smollm2_gguf, registry):
    gguf_file, sha256 = smollm2_gguf, registry.model("smollm2-135m").sha256
    dest = imported_dir(sha256)
    waited_on: list[str] = []
    imported = []
    with cache_lock(dest, "importing it"):  # this test is the process importing first
        second = threading.Thread(target=lambda: imported.append(import_gguf_file(
            gguf_file, sha256, lambda doing, done, total: waited_on.append(doing))))
        second.start()
        wait_for(lambda: waited_on, 120, "the second import to wait for the lock")  # hashing the file first
        dest.mkdir(parents=True)
        (dest / "polspec-import.json").write_text(json.dumps({"format": IMPORT_FORMAT}))  # the first one's import
        in_use = (dest / "polspec-import.json").stat().st_ino
    second.join(timeout=120)
    assert imported == [dest] and waited_on == ["waiting for another process importing " + gguf_file.name]
    assert (dest / "polspec-import.json").stat().st_ino == in_use and [p.name for p in dest.iterdir()] == \
        ["polspec-import.json"]  # kept, not imported again
    assert [path.name for path in models_dir().iterdir() if path.name != "sha256-index.json"] == [sha256]


@pytest.mark.slow
def test_an_import_in_an_older_layout_is_redone(isolated_home, smollm2_gguf, registry):
    gguf_file, sha256 = smollm2_gguf, registry.model("smollm2-135m").sha256
    dest = imported_dir(sha256)
    dest.mkdir(parents=True)
    (dest / "polspec-import.json").write_text(json.dumps({"format": IMPORT_FORMAT - 1}))
    assert import_gguf_file(gguf_file, sha256) == dest
    assert json.loads((dest / "polspec-import.json").read_text())["format"] == IMPORT_FORMAT
    assert (dest / "config.json").exists()
    assert [path.name for path in models_dir().iterdir() if path.name != "sha256-index.json"] == [sha256]


def test_a_worker_logs_each_step_of_a_first_fetch_once_and_then_how_far_it_is(caplog):
    from polspec.worker.model_cache import logged_steps

    steps = [("waiting for another process fetching m.gguf", 0, None)]
    steps += [(f"downloading part{index}", index, 3) for index in range(3)] + [("assembled m.gguf", 3, 3)]
    steps += [(f"importing tensor{index}", index, 100) for index in range(100)] + [("imported weights", 100, 100)]
    with caplog.at_level("INFO", logger="polspec.worker"):
        report = logged_steps("m")
        for step in steps:
            report(*step)
        assert caplog.messages == ["m: waiting for another process fetching m.gguf", "m: downloading part0 (0 of 3)",
                                   "m: assembled m.gguf (3 of 3)", "m: importing tensor0 (0 of 100)",
                                   "m: imported weights (100 of 100)"]
        caplog.clear()
        every_call = logged_steps("m", every_s=0)
        for step in steps[1:4]:
            every_call(*step)
        assert caplog.messages == ["m: downloading part0 (0 of 3)", "m: downloading part1 (1 of 3)",
                                   "m: downloading part2 (2 of 3)"]
