"""Sweeps: expansion, bad configs, a small sweep through the worker, resume, and its report."""

from __future__ import annotations

import codecs
import csv
import dataclasses
import io
import json
from datetime import UTC, datetime, timedelta
import re
import signal
import sqlite3
import statistics
import sys
import tomllib
from pathlib import Path

import click
import pytest
import redis
from click.testing import CliRunner
from sqlalchemy import event, select, update

from polspec.cli import main
from polspec.decoding.costmodel import (BatchCost, Probe, accepted_share, break_even_acceptance, candidates_for,
                                       predicted_speedup_of_rounds)
from polspec.decoding.draft_vocab import DEFAULT_SIZE
from polspec.decoding.params import DecodingParams
from polspec.decoding.probe_files import save_probe
from polspec.errors import PolspecError
from polspec.jobs.spec import ITEM_PARAMS
from polspec.jobs import enqueue as enqueue_module
from polspec.jobs import sweep as sweep_module
from polspec.jobs.sweep import expand_sweep, load_sweep
from polspec.report.render import markdown
from polspec.report.summary import (CellKey, Pair, Row, SweepReport, Window, cell_row, joules_per_token, mean_interval,
                                     t_quantile_95,
                                    predicted_speedup_of_cell, row_order, sweep_report)
from polspec.report.summary import headline as summary_headline
from polspec.store.engine import make_engine, session_scope
from polspec.store.items import Worker, claim_item
from polspec.store.migrate import upgrade
from polspec.store.schema import Batch, Cell, EnergyWindow, Item, Result, utcnow
from conftest import sqlite_url
from helpers import start_worker, statuses, wait_for, work

SMALL = """
name = "small"
target = "gemma3-270m"
drafts = ["smollm2-135m"]
strategies = ["aligned", "naive"]
k = [1, 2]
prefix = [5]
datasets = [{ name = "pl-short", limit = 2 }]
max_tokens = 4
raw = true
"""


def config(**changes) -> dict:
    base = {"target": "gemma3-270m", "drafts": ["smollm2-135m"], "strategies": ["aligned", "context", "naive"],
            "k": [1, 2, "auto"], "prefix": [5], "datasets": ["pl-short", {"name": "pl-wiki", "limit": 3}],
            "limit": 4, "max_tokens": 8, "seeds": [0, 1], "repeats": 2, "raw": True}
    return {key: value for key, value in (base | changes).items() if value is not None}


def test_expansion_counts_baselines_and_drift_fair_order():
    sampled = config(temperature=0.7, verify="exact")  # each seed draws apart, each strategy translates apart
    plan = expand_sweep(sampled, "test.toml")
    # per dataset and seed: one baseline plus 1 draft x 3 strategies x 3 k x 1 prefix
    assert len(plan.cells) == 2 * 2 * (1 + 9)
    assert sum(cell.baseline for cell in plan.cells) == 4
    assert len(plan.items) == (4 + 3) * 2 * 2 * 10  # prompts x seeds x repeats x cells
    assert len({item.key for item in plan.items}) == len(plan.items)
    first = plan.items[:20]  # the first prompt: its baseline, then every speculative cell, per seed
    assert first[0].cell == "pl-short/baseline/s0" and first[0].key == "pl-short/baseline/s0/short-001/r0"
    assert {item.prompt_key for item in first} == {"short-001"}
    assert [item.repeat for item in plan.items[:40:20]] == [0, 1]  # then the same prompt's second repeat
    assert plan.items[1].item.overrides["k"] == 1 and plan.items[1].item.overrides["strategy"] == "aligned"
    assert plan.name.startswith("sweep-") and expand_sweep(sampled, "x").name == plan.name
    assert plan.items[1].item.overrides["partial_word"] == "verify"
    held = expand_sweep(config(temperature=0.7, verify="exact", partial_word="hold"), "test.toml")
    assert {item.item.overrides["partial_word"] for item in held.items} == {"hold"}


def test_a_sweep_file_may_leave_out_every_grid_key_but_drafts_and_datasets(tmp_path):
    path = tmp_path / "short.toml"
    path.write_text('target = "gemma3-270m"\ndrafts = ["smollm2-135m"]\ndatasets = ["pl-short"]\n'
                    'limit = 2\nmax_tokens = 8\n')
    plan = load_sweep(path)
    assert [cell.key for cell in plan.cells] == ["pl-short/baseline/s0", "pl-short/smollm2-135m/aligned/k2/p5/s0"]
    assert [cell.config["batch"] for cell in plan.cells] == [1, 1]
    assert len(plan.items) == 2 * 2  # no repeats beyond the first
    # The grid's defaults are the command line's: what `polspec generate` decodes with unless told.
    generate = main.get_command(click.Context(main), "generate")
    cli_defaults = generate.make_context("generate", ["Kraków jest"]).params
    speculative = plan.cells[1]
    assert (speculative.config["strategy"], speculative.config["k"], speculative.config["prefix"]) == (
        cli_defaults["strategy"], cli_defaults["k"], cli_defaults["prefix"])
    assert speculative.params == DecodingParams(**{name: cli_defaults[name] for name in ITEM_PARAMS}
                                                | {"max_tokens": 8, "seed": 0})


def test_an_unknown_key_in_a_sweep_file_is_one_line(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text('target = "gemma3-270m"\ndrafts = ["smollm2-135m"]\ndatasets = ["pl-short"]\nrepeat = 2\n')
    result = CliRunner().invoke(main, ["enqueue", "sweep", "--config", str(path)])
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert f"{path}: unknown key 'repeat' (allowed: " in result.output


def test_batch_sizes_are_a_grid_dimension_enqueued_chunk_by_chunk():
    plan = expand_sweep(config(strategies=["aligned"], k=[2], seeds=[0], repeats=None, batch=[1, 2],
                               datasets=[{"name": "pl-short", "limit": 4}]), "test.toml")
    assert [cell.key for cell in plan.cells] == [
        "pl-short/baseline/s0", "pl-short/smollm2-135m/aligned/k2/p5/s0",
        "pl-short/baseline/s0/b2", "pl-short/smollm2-135m/aligned/k2/p5/s0/b2"]
    assert [cell.config["batch"] for cell in plan.cells] == [1, 1, 2, 2]
    # Two prompts (the largest batch) at a time, each cell's items of them in a row.
    first = [(item.cell.rsplit("/", 1)[-1], item.prompt_key) for item in plan.items[:8]]
    assert first == [("s0", "short-001"), ("s0", "short-002")] * 2 + [("b2", "short-001"), ("b2", "short-002")] * 2
    assert len(plan.items) == 4 * 4


def test_temperatures_and_verify_are_grid_dimensions_and_single_values_keep_the_old_keys():
    grid = {"strategies": ["aligned"], "k": [2], "seeds": [0], "repeats": None,
            "datasets": [{"name": "pl-short", "limit": 2}]}
    plan = expand_sweep(config(**grid, temperatures=[0, 0.7], verify=["exact", "tli"]), "test.toml")
    # Every temperature gets its own baseline; verify varies the sampled speculative cells only
    # (greedy decoding verifies by exact match whatever it says: one greedy cell, not two alike).
    assert [cell.key for cell in plan.cells] == [
        "pl-short/baseline/s0/t0", "pl-short/smollm2-135m/aligned/k2/p5/vexact/s0/t0",
        "pl-short/baseline/s0/t0.7", "pl-short/smollm2-135m/aligned/k2/p5/vexact/s0/t0.7",
        "pl-short/smollm2-135m/aligned/k2/p5/vtli/s0/t0.7"]
    assert [(cell.config["temperature"], cell.config.get("verify")) for cell in plan.cells] == [
        (0.0, None), (0.0, "exact"), (0.7, None), (0.7, "exact"), (0.7, "tli")]
    assert [(cell.params.temperature, cell.params.verification) for cell in plan.cells[2:]] == [
        (0.7, "exact"), (0.7, "exact"), (0.7, "tli")]
    assert {(item.item.overrides["temperature"], item.item.overrides["verify"]) for item in plan.items
            if item.cell == plan.cells[4].key} == {(0.7, "tli")}
    assert len(plan.items) == 5 * 2
    greedy = expand_sweep(config(**grid, temperatures=[0], verify=["exact", "tli"]), "test.toml")
    assert [cell.key for cell in greedy.cells] == [
        "pl-short/baseline/s0/t0", "pl-short/smollm2-135m/aligned/k2/p5/vexact/s0/t0"]
    # The size is known before any item is built: one past the cap is refused, not built for ever.
    with pytest.raises(PolspecError, match=r"^test.toml: the sweep would queue 1,000,010 items, more than 1,000,000"):
        expand_sweep(config(**(grid | {"repeats": 100_001}), temperatures=[0, 0.7], verify=["exact", "tli"]),
                     "test.toml")

    # Absent, scalar or single-valued, they leave the keys of older sweeps as they were.
    old = [cell.key for cell in expand_sweep(config(**grid), "test.toml").cells]
    assert old == ["pl-short/baseline/s0", "pl-short/smollm2-135m/aligned/k2/p5/s0"]
    for verify, verification in (("tli", "tli"), (["exact"], "exact")):
        plan = expand_sweep(config(**grid, temperature=0.7, verify=verify), "test.toml")
        assert [cell.key for cell in plan.cells] == old
        assert (plan.cells[1].config["temperature"], plan.cells[1].config["verify"]) == (0.7, verification)
        assert plan.cells[1].params.verification == verification
    # One listed temperature is a grid of one: its key says so.
    assert [cell.key for cell in expand_sweep(config(**grid, temperatures=[1.0]), "test.toml").cells] == [
        "pl-short/baseline/s0/t1", "pl-short/smollm2-135m/aligned/k2/p5/s0/t1"]


def test_grid_points_that_would_decode_alike_get_one_cell():
    """Greedy decoding draws nothing: a temperature of 0 gets the first seed's cells alone.
    Speculative sampling (tli) translates nothing: its cells take the first strategy and prefix.
    naive translation reads no prefix: its cells take the first. 2 seeds x 2 temperatures x 2
    strategies x 2 prefixes x 2 verifications planned 28 cells a dataset (greedy ones verified
    one way already), 14 of them decoding what another did."""
    plan = expand_sweep(config(strategies=["aligned", "naive"], prefix=[5, 3], k=[2], seeds=[0, 1], repeats=None,
                               temperatures=[0, 0.7], verify=["exact", "auto"],
                               datasets=[{"name": "pl-short", "limit": 2}]), "test.toml")
    cells = [(cell.config["seed"], cell.config["temperature"], cell.config.get("strategy"), cell.config.get("prefix"),
              cell.config.get("verify")) for cell in plan.cells]
    assert cells == [
        (0, 0.0, None, None, None), (0, 0.0, "aligned", 5, "exact"), (0, 0.0, "aligned", 3, "exact"),
        (0, 0.0, "naive", 5, "exact"),
        (0, 0.7, None, None, None), (0, 0.7, "aligned", 5, "exact"), (0, 0.7, "aligned", 5, "auto"),
        (0, 0.7, "aligned", 3, "exact"), (0, 0.7, "naive", 5, "exact"),
        (1, 0.7, None, None, None), (1, 0.7, "aligned", 5, "exact"), (1, 0.7, "aligned", 5, "auto"),
        (1, 0.7, "aligned", 3, "exact"), (1, 0.7, "naive", 5, "exact")]
    assert len(plan.items) == 14 * 2 and plan.notes == []
    with pytest.raises(PolspecError, match=r"^test.toml: 'verify' lists 'auto' and 'tli', which are one way"):
        expand_sweep(config(temperature=0.7, verify=["tli", "exact", "auto"]), "test.toml")


def test_settings_that_change_nothing_and_limits_past_a_dataset_s_end_are_noted(tmp_path):
    path = tmp_path / "noted.toml"
    path.write_text('target = "gemma3-270m"\ndrafts = ["smollm2-135m"]\nstrategies = ["naive", "none"]\n'
                    'prefix = [3, 5]\npartial_word = "hold"\nseeds = [0, 1]\ntop_p = 0.9\n'
                    'datasets = [{ name = "pl-short", limit = 100 }, { name = "pl-wiki", limit = 2 }]\n'
                    'batch = [1, 4, 8]\nrepeats = 2\n')
    result = CliRunner().invoke(main, ["enqueue", "sweep", "--config", str(path), "--dry-run"])
    assert result.exit_code == 0 and result.output.startswith(
        f"note: {path}: 'seeds', 'top_p' have no effect at temperature 0 (greedy decoding): only the first seed runs\n"
        f"note: {path}: 'prefix', 'partial_word' have no effect with strategies naive, none: only the first prefix "
        "runs\n"
        f"note: {path}: dataset 'pl-short' holds 64 prompts, fewer than its limit of 100: all of them run\n"
        f"note: {path}: batch 8 is more than the 4 items a cell of dataset 'pl-wiki' holds (its prompts x repeats): "
        "those cells decode at most 4 together\n"
        "sweep sweep-"), result.output
    assert "would queue 18 cells" in result.output  # a baseline, naive and none per dataset and batch size
    sampled = expand_sweep(config(strategies=["aligned"], prefix=[3, 5], seeds=[0, 1], top_p=0.9, temperature=0.7,
                                  partial_word="hold", verify="exact"), "test.toml")
    assert sampled.notes == []  # each read
    # Speculative sampling translates nothing: of the strategies and prefixes only the first runs.
    mapped = expand_sweep(config(strategies=["aligned", "naive"], prefix=[3, 5], temperature=0.7), "test.toml")
    assert mapped.notes == ["'strategies', 'prefix' have no effect with verify auto at temperature above 0 "
                            "(speculative sampling maps tokens, it translates none): only the first of each runs"]
    assert {cell.config.get("strategy") for cell in mapped.cells} == {None, "aligned"}
    assert expand_sweep(config(strategies=["aligned", "naive"], temperatures=[0.0, 0.7]), "test.toml").notes == []


def test_the_size_a_sweep_is_refused_at_is_the_size_it_builds(monkeypatch):
    wide = config(datasets=["pl-short", {"name": "pl-wiki", "limit": 3}], seeds=[0, 1], batch=[1, 4],
                  temperatures=[0, 0.7], verify=["exact", "tli"], k=[1, 2], repeats=2)
    built = len(expand_sweep(wide, "test.toml").items)
    monkeypatch.setattr(sweep_module, "MAX_SWEEP_ITEMS", built)
    assert len(expand_sweep(wide, "test.toml").items) == built
    monkeypatch.setattr(sweep_module, "MAX_SWEEP_ITEMS", built - 1)
    with pytest.raises(PolspecError, match=rf"^test.toml: the sweep would queue {built:,} items, more than"):
        expand_sweep(wide, "test.toml")


def test_a_dry_run_counts_the_cells_and_items_per_dataset_and_writes_nothing(tmp_path, monkeypatch):
    path = tmp_path / "plan.toml"
    path.write_text('target = "gemma3-270m"\ndrafts = ["smollm2-135m"]\nk = [1, 2]\n'
                    'datasets = ["pl-short", { name = "pl-wiki", limit = 3 }]\nlimit = 4\nrepeats = 2\n')
    monkeypatch.setenv("POLSPEC_DB_URL", sqlite_url(tmp_path / "db"))  # neither is touched
    monkeypatch.setenv("POLSPEC_REDIS_URL", "redis://127.0.0.1:9/0")
    plan = expand_sweep(tomllib.loads(path.read_text()), str(path))
    result = CliRunner().invoke(main, ["enqueue", "sweep", "--config", str(path), "--dry-run"])
    assert result.exit_code == 0 and result.output == (
        f"sweep {plan.name} would queue 6 cells, 42 items on polspec-gemma3-270m (nothing written):\n"
        "  pl-short: 3 cells, 24 items\n  pl-wiki: 3 cells, 18 items\n")
    result = CliRunner().invoke(main, ["enqueue", "sweep", "--config", str(path), "--dry-run", "--json"])
    assert result.exit_code == 0 and json.loads(result.output) == {
        "name": plan.name, "queue": "polspec-gemma3-270m", "cells": 6, "items": 42,
        "datasets": {"pl-short": {"cells": 3, "items": 24}, "pl-wiki": {"cells": 3, "items": 18}}}
    assert len(plan.items) == 42 and not (tmp_path / "db").exists()


def test_temperature_and_temperatures_together_is_one_line(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text('target = "gemma3-270m"\ndrafts = ["smollm2-135m"]\ndatasets = ["pl-short"]\n'
                    'temperature = 0.7\ntemperatures = [0.0, 0.7]\n')
    result = CliRunner().invoke(main, ["enqueue", "sweep", "--config", str(path)])
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert f"{path}: give 'temperature' or 'temperatures', not both" in result.output


@pytest.mark.parametrize(("changes", "message"), [
    ({"drafs": ["x"]}, "test.toml: unknown key 'drafs'"),
    ({"k": []}, "test.toml: 'k' must be a non-empty list"),
    ({"drafts": None}, "test.toml: 'drafts' is missing"),
    ({"batch": [0]}, "test.toml: every 'batch' size must be a whole number of at least 1, got 0"),
    ({"datasets": ["pl-nowe"]}, "test.toml: 'datasets': unknown dataset 'pl-nowe'"),
    ({"k": [0]}, "test.toml: k must be between 1 and 16, got 0"),
    ({"strategies": ["exact"]}, "test.toml: unknown strategy 'exact'"),
    ({"drafts": ["smollm"]}, "test.toml: unknown model alias 'smollm'"),
    ({"target": "gemma"}, "test.toml: unknown model alias 'gemma'"),
    ({"drafts": [5]}, "test.toml: 'drafts' must list model aliases (text), got 5"),
    ({"drafts": [["smollm2-135m"]]}, "test.toml: 'drafts' must list model aliases (text), got"),
    ({"name": 5}, "test.toml: 'name' must be some text on one line (or be left out), got 5"),
    ({"name": " "}, "test.toml: 'name' must be some text on one line (or be left out), got ' '"),
    ({"name": "noc\nna"}, "test.toml: 'name' must be some text on one line (or be left out), got 'noc"),
    ({"seeds": [-1]}, "test.toml: seed must be between 0 and"),
    # Values of cells the grid leaves out (later seeds when greedy, later strategies and prefixes
    # under tli or where no strategy reads them) are checked all the same.
    ({"seeds": [0, -1]}, "test.toml: seed must be between 0 and"),
    ({"seeds": [0, datetime(1979, 5, 27).date()]}, 'test.toml: seed must be a whole number, got 1979-05-27'),  # as the file wrote it
    ({"temperature": 0.7, "verify": "tli", "strategies": ["aligned", "bogus"]}, "test.toml: unknown strategy 'bogus'"),
    ({"temperature": 0.7, "verify": "tli", "strategies": ["aligned", {"x": 1}]}, "test.toml: unknown strategy"),
    ({"strategies": ["naive"], "prefix": [5, -3]}, "test.toml: prefix must be"),
    ({"target": "qwen2.5-coder-1.5b", "drafts": ["gemma3-270m"], "raw": False}, "test.toml: draft gemma3-270m has no chat template but qwen2.5-coder-1.5b runs in chat mode: add raw = true"),
    ({"repeats": 0}, "'repeats' must be a whole number of at least 1"),
    ({"repeats": True}, "test.toml: 'repeats' must be a whole number of at least 1, got true"),
    ({"k": [2, 2]}, "'k' lists 2 twice"),
    ({"k": "2"}, "test.toml: 'k' must be a non-empty list, got '2'"),
    ({"partial_word": "maybe"}, "test.toml: partial_word must be one of verify, hold, got 'maybe'"),
    ({"datasets": [{"name": "pl-short", "limit": "10"}]},
     "test.toml: the 'limit' of dataset 'pl-short' must be a whole number of at least 1, got '10'"),
    ({"limit": True}, "test.toml: 'limit' must be a whole number of at least 1, got true"),
    ({"datasets": [{"name": "pl-short", "limit": False}]},
     "test.toml: the 'limit' of dataset 'pl-short' must be a whole number of at least 1, got false"),
    ({"datasets": [{"name": 5}]}, "test.toml: a dataset entry takes a 'name' (text) and a 'limit', got {'name': 5}"),
    ({"datasets": ["pl-wiki", {"name": "pl-wiki", "limit": 5}]}, "test.toml: 'datasets' lists 'pl-wiki' twice"),
    ({"seeds": ["x"]}, "test.toml: seed must be a whole number, got 'x'"),
    ({"max_tokens": 2.5}, "test.toml: max_tokens must be a whole number, got 2.5"),
    ({"temperatures": []}, "test.toml: 'temperatures' must be a non-empty list"),
    ({"temperatures": [0.7, -0.1]}, "test.toml: 'temperatures' must list numbers of at least 0, got -0.1"),
    ({"temperatures": ["hot"]}, "test.toml: 'temperatures' must list numbers of at least 0, got 'hot'"),
    ({"temperatures": [0.0, float("nan")]}, "test.toml: 'temperatures' must list numbers of at least 0, got nan"),
    ({"temperature": float("inf")}, "test.toml: temperature must be a finite number, 0 or more, got inf"),
    ({"temperatures": [0.7, 0, 0.0]}, "test.toml: 'temperatures' lists 0.0 twice"),
    ({"verify": ["tli", "maybe"]}, "test.toml: verify must be one of auto, exact, tli, got 'maybe'"),
    ({"verify": []}, "test.toml: 'verify' must be a non-empty list"),
    ({"temperature": [0.0, 0.7]}, "test.toml: 'temperature' takes one value, got a list ('temperatures' makes a grid"),
    ({"max_tokens": [32, 64]}, "test.toml: 'max_tokens' takes one value, got a list"),
    ({"datasets": [{"name": "pl-short", "limt": 3}]},
     "test.toml: a dataset entry has an unknown key 'limt' (it takes a 'name' and a 'limit')"),
])
def test_bad_configs_name_the_key(changes, message):
    with pytest.raises(PolspecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        expand_sweep(config(**changes), "test.toml")


def test_the_printed_example_is_a_sweep_that_expands_and_the_repository_example():
    result = CliRunner().invoke(main, ["enqueue", "sweep", "--example"])
    assert result.exit_code == 0
    assert result.output == (Path(__file__).parent.parent / "examples" / "sweep-offline.toml").read_text()
    plan = expand_sweep(tomllib.loads(result.output), "example.toml")
    assert plan.name == "offline" and len(plan.cells) > 1 and plan.items


def test_one_file_under_two_spellings_is_one_dataset_listed_twice(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "mine.jsonl").write_text('{"id": "a", "prompt": "Kraków leży"}\n')
    for spelling in ("./mine.jsonl", "sub/../mine.jsonl", str(tmp_path / "mine.jsonl")):
        with pytest.raises(PolspecError, match=re.escape(f"'datasets' lists {spelling!r} twice (as 'mine.jsonl' too)")):
            expand_sweep(config(datasets=["mine.jsonl", spelling]), "test.toml", tmp_path)


def test_ids_that_make_one_item_key_in_the_grid_are_refused_naming_the_line(tmp_path):
    (tmp_path / "slash.jsonl").write_text('{"id": "x", "prompt": "Kraków"}\n{"id": "b4/x", "prompt": "Wisła"}\n')
    message = ("slash.jsonl:1: the ids 'b4/x' and 'x' make one item key in this grid "
               "('slash.jsonl/baseline/s0/b4/x/r0'): give one of them an id without '/'")
    with pytest.raises(PolspecError, match=re.escape(message)):
        expand_sweep(config(datasets=["slash.jsonl"], batch=[1, 4]), "test.toml", tmp_path)
    assert len(expand_sweep(config(datasets=["slash.jsonl"], batch=[4]), "test.toml", tmp_path).items) > 2


def test_one_hugging_face_split_under_two_spellings_is_listed_twice():
    with pytest.raises(PolspecError, match=re.escape("'datasets' lists 'hf:owner/set:train' twice (as 'hf:owner/set' too)")):
        expand_sweep(config(datasets=["hf:owner/set", "hf:owner/set:train"]), "test.toml")
    with pytest.raises(PolspecError, match="'datasets': hf:owner/set:test( needs the datasets|: cannot load)"):
        expand_sweep(config(datasets=["hf:owner/set:test", "hf:owner/set"]), "test.toml")  # another split: it loads


def test_not_toml_is_one_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("target = [\n")
    result = CliRunner().invoke(main, ["enqueue", "sweep", "--config", str(path)])
    assert result.exit_code == 1 and f"{path}: not valid TOML" in result.output and result.output.count("\n") == 1
    path.write_bytes(b'target = "gemma3-270m"\nname = "\xc5\x81odz \xff"\n')  # UTF-8 up to the last byte
    result = CliRunner().invoke(main, ["enqueue", "sweep", "--config", str(path)])
    assert result.exit_code == 1 and result.output == f"polspec: error: {path}:2: not UTF-8 (byte 0xff at column 15)\n"
    for text, what in (("limit = " + "9" * 5000, f"a number of over {sys.get_int_max_str_digits()} digits"),
                       ("limit = " + "[" * 100_000, "nesting too deep")):
        path.write_text(text)
        result = CliRunner().invoke(main, ["enqueue", "sweep", "--config", str(path)])
        assert result.exit_code == 1 and result.output == f"polspec: error: {path}: cannot be read: {what}\n"
    path.write_bytes(codecs.BOM_UTF8 + b"target = 5\n")  # a BOM is read past, to the TOML's own mistake
    result = CliRunner().invoke(main, ["enqueue", "sweep", "--config", str(path)])
    assert result.exit_code == 1 and result.output == f"polspec: error: {path}: 'target' must name the target model\n"


@pytest.fixture
def env(home_with_models, tmp_path, redis_url) -> dict[str, str]:
    redis.Redis.from_url(redis_url).flushall()
    return {"POLSPEC_DB_URL": f"sqlite:///{tmp_path / 'sweep.db'}", "POLSPEC_REDIS_URL": redis_url,
            "POLSPEC_HOME": str(home_with_models)}


def cli(env, *args) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env=env)
    return result.exit_code, result.output


def stored(env) -> dict[str, tuple[Cell, Item, Result | None]]:
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        rows = session.execute(select(Cell, Item, Result).join(Item, Item.cell_id == Cell.id)
                               .outerjoin(Result, Result.item_id == Item.id)).all()
    engine.dispose()
    return {item.item_key: (cell, item, result) for cell, item, result in rows}


@pytest.mark.slow
def test_small_sweep_runs_resumes_and_reports_numbers_recomputable_by_hand(env, tmp_path):
    sweep_file = tmp_path / "small.toml"
    sweep_file.write_text(SMALL)
    probe = Probe("gemma3-270m", "smollm2-135m", c=0.5, rho=(1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8), tau=0.05,
                  draft_vocab=DEFAULT_SIZE)  # smollm2 runs pruned by default
    save_probe(probe)
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file), "--json")
    assert code == 0, output
    queued = json.loads(output)
    assert (queued["cells"], queued["items"], queued["enqueued"], queued["resumed"]) == (5, 10, 10, False)
    worker = start_worker(env, "--burst")
    wait_for(lambda: statuses(env).get("done", 0) >= 3, 240, "three items done")
    worker.send_signal(signal.SIGKILL)  # a worker restart midway
    worker.wait()
    before = {key: result.id for key, (_, _, result) in stored(env).items() if result is not None}

    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file), "--json")
    resumed = json.loads(output)
    assert resumed["resumed"] and resumed["batch"] == queued["batch"] and resumed["done"] == len(before)
    # The queued items still have their jobs; only the killed worker's item needs a new one.
    assert resumed["enqueued"] in (0, 1)
    work(env)  # the restart, in this process
    rows = stored(env)
    assert all(result is not None for _, _, result in rows.values())
    assert {key: rows[key][2].id for key in before} == before  # finished items were not redone
    assert all(item.attempts == 1 for key, (_, item, _) in rows.items() if key in before)

    code, output = cli(env, "report", str(queued["batch"]), "--format", "json", "--plots", str(tmp_path / "plots"))
    assert code == 0, output
    report = json.loads(output.splitlines()[0])
    assert len(report["rows"]) == 4 and report["missing_probe"] == []
    assert report["done"] == report["total"] == 10
    # The killed worker's baselines pair with the second worker's results: those pairs are counted.
    runs = {key: (item.worker_host, item.worker_pid) for key, (_, item, _) in rows.items()}
    baseline_of = {(item.prompt_key, item.repeat): key for key, (cell, item, _) in rows.items() if cell.baseline}
    crossed = [key for key, (cell, item, _) in rows.items()
               if not cell.baseline and runs[key] != runs[baseline_of[item.prompt_key, item.repeat]]]
    assert report["cross_run_pairs"] == len(crossed)
    assert report["headlines"][0]["best"]["speedup"] == max(row["speedup"] for row in report["rows"])
    row = next(r for r in report["rows"] if r["strategy"] == "aligned" and r["k"] == "2")
    members = [(item, result) for cell, item, result in rows.values()
               if not cell.baseline and cell.config["strategy"] == "aligned" and cell.config["k"] == 2]
    # Each speculative result records the probe its worker predicted with; baselines none.
    assert all(Probe.from_dict(result.metrics["probe"]) == probe for _, result in members)
    assert all(result.metrics["probe"] is None for cell, _, result in rows.values() if cell.baseline)
    ratios = []
    for item, result in members:
        baseline = rows[baseline_of[item.prompt_key, item.repeat]][2]
        ratios.append(result.decode_tokens_per_s / baseline.decode_tokens_per_s)
    assert row["prompts"] == 2 and row["speedup"] == pytest.approx(statistics.fmean(ratios))
    accepted = sum(result.metrics["candidates_accepted"] for _, result in members)
    candidates = sum(result.metrics["candidates"] for _, result in members)
    rejections = sum(result.metrics["rejections"] for _, result in members)
    drafted = sum(result.metrics["draft_tokens"] for _, result in members)
    assert row["acceptance_per_candidate"] == pytest.approx(accepted / candidates)
    a_hat = accepted / (accepted + rejections)
    # A last round with one token to go is a plain step: the prediction prices it as one.
    plain = sum(result.metrics["plain_rounds"] for _, result in members)
    speculative = sum(result.metrics["rounds"] for _, result in members) - plain
    assert row["predicted_speedup"] == pytest.approx(
        predicted_speedup_of_rounds(probe, a_hat, 2, candidates / drafted, speculative, plain))
    even = break_even_acceptance(probe, 2, candidates / drafted)
    assert row["break_even_acceptance"] == (
        None if even is None else pytest.approx(accepted_share(even, candidates_for(2, candidates / drafted))))
    assert row["joules_per_token"] is None  # no meter here: unavailable, never 0
    for name in ("speedup-by-k.png", "acceptance.png", "predicted-vs-measured.png"):
        assert (tmp_path / "plots" / name).read_bytes().startswith(b"\x89PNG") and (tmp_path / "plots" / name).stat().st_size > 5000

    code, output = cli(env, "report", str(queued["batch"]))
    assert "## pl-short" in output and "| smollm2-135m | aligned | 2 | 2 |" in output
    code, output = cli(env, "status", "--json")
    assert json.loads(output.splitlines()[0])["kind"] == "sweep"


def report_row(draft: str, strategy: str, k: str, speedup: float | None, predicted: float | None = None,
               batch: int = 1) -> Row:
    empty = dict.fromkeys(["acceptance_per_candidate", "acceptance_per_draft_token", "tokens_per_round", "tokens_per_s",
                           "baseline_tokens_per_s", "speedup_low", "speedup_high", "aggregate_tokens_per_s",
                           "aggregate_speedup", "joules_per_token", "translation_overhead", "break_even_acceptance"])
    return Row("pl-wiki", draft, strategy, k, 5, batch, prompts=20, paired_prompts=20, speedup=speedup,
               predicted_speedup=predicted, **empty)


def test_headline_picks_the_fastest_cell_compares_auto_per_pair_and_finds_the_worst_prediction():
    rows = [report_row("gemma3-270m", "aligned", "1", 1.10, predicted=1.00),  # misses by 1/11
            report_row("gemma3-270m", "aligned", "2", 1.20, predicted=1.26),  # misses by 5%
            report_row("gemma3-270m", "aligned", "4", 0.80, predicted=1.60),  # k > 3: not judged
            report_row("gemma3-270m", "aligned", "auto", 1.14),
            report_row("smollm2-135m", "naive", "1", 0.90),
            report_row("smollm2-135m", "naive", "auto", 0.90),
            report_row("gemma3-270m", "context", "1", None, predicted=5.0)]  # no paired baseline yet
    headline = summary_headline("pl-wiki", rows)
    assert headline.best is rows[1]
    assert headline.auto_vs_best == pytest.approx({"gemma3-270m/aligned": 0.95, "smollm2-135m/naive": 1.0})
    assert headline.worst_prediction is rows[0] and headline.prediction_error == pytest.approx(1 / 11)
    report = SweepReport(1, "offline", "qwen2.5-coder-1.5b", "running", 7, 20, rows, {}, [])
    assert ("- **pl-wiki**: fastest: gemma3-270m aligned k=2 at 1.20x; auto at 0.95-1.00 of the best fixed k "
            "of its draft and strategy (lowest: gemma3-270m/aligned); predictions for k <= 3 within 9% (largest "
            "miss: gemma3-270m aligned k=1, 1.00x predicted, 1.10x measured).") in markdown(report)
    assert "status running, 7 of 20 generations done" in markdown(report)
    # Break-even "never" only where this machine's probe says so, not wherever a prediction exists.
    assert "| 1.10x | 1.00x | - |" in markdown(report)
    rows[1] = dataclasses.replace(rows[1], never_pays=True)
    assert "| 1.20x | 1.26x | never |" in markdown(report)


def test_the_headline_compares_cells_measured_on_the_same_number_of_prompts():
    """Mid-sweep a cell queued last has few prompts: k = 4 at 1.60x on one prompt was named the
    fastest, and auto was judged against it."""
    rows = [report_row("gemma3-270m", "aligned", "2", 1.30, predicted=1.25),
            dataclasses.replace(report_row("gemma3-270m", "aligned", "4", 1.60, predicted=1.0), paired_prompts=1),
            report_row("gemma3-270m", "aligned", "auto", 1.28)]
    headline = summary_headline("pl-wiki", rows)
    assert (headline.best, headline.prompts, headline.left_out) == (rows[0], 20, 1)
    assert headline.auto_vs_best == pytest.approx({"gemma3-270m/aligned": 1.28 / 1.30})
    assert headline.worst_prediction is rows[0]
    report = SweepReport(1, "offline", "qwen2.5-coder-1.5b", "running", 41, 60, rows, {}, [])
    assert ("- **pl-wiki**: fastest: gemma3-270m aligned k=2 at 1.30x; auto at 0.98-0.98 of the best fixed k of its "
            "draft and strategy (lowest: gemma3-270m/aligned); predictions for k <= 3 within 4% (largest miss: "
            "gemma3-270m aligned k=2, 1.25x predicted, 1.30x measured); 1 cell measured on fewer than 20 prompts "
            "left out of these comparisons.") in markdown(report)
    assert "left out" not in markdown(dataclasses.replace(report, rows=[rows[0], rows[2]]))


def test_rows_order_k_by_number_and_the_headline_names_a_batch_size():
    """k up to 16 sorted as text put k = 12 between 1 and 2; and a headline that ranks rows of
    every batch size credited a batch's gain to draft, strategy and k."""
    keys = [CellKey("pl-wiki", "gemma3-270m", "aligned", k, 5, 1) for k in ("auto", "12", "2", "heuristic", "1")]
    assert [key.k for key in sorted(keys, key=row_order)] == ["1", "2", "12", "auto", "heuristic"]
    rows = [report_row("gemma3-270m", "aligned", "2", 0.98), report_row("gemma3-270m", "aligned", "2", 1.04, batch=4)]
    report = SweepReport(1, "offline", "qwen2.5-coder-1.5b", "done", 4, 4, rows, {}, [])
    assert "- **pl-wiki**: fastest: gemma3-270m aligned k=2 B=4 at 1.04x." in markdown(report)


def test_repeats_of_a_prompt_are_averaged_before_the_interval_over_prompts():
    def result(tokens_per_s: float) -> Result:
        return Result(decode_tokens_per_s=tokens_per_s, metrics={"generated_tokens": 8, "rounds": 4})

    members = [(Pair("pl-wiki", 0, 1, "a", 0), result(2.0)), (Pair("pl-wiki", 0, 1, "a", 1), result(4.0)),
               (Pair("pl-wiki", 0, 1, "b", 0), result(2.0)), (Pair("pl-wiki", 0, 1, "b", 1), result(2.0))]
    baseline = {pair: 2.0 for pair, _ in members}
    row = cell_row(CellKey("pl-wiki", "gemma3-270m", "aligned", "2", 5, 1), members, baseline, None)
    per_prompt = [1.5, 1.0]  # a: (1 + 2) / 2, b: (1 + 1) / 2
    half = 12.706 * statistics.stdev(per_prompt) / 2 ** 0.5  # t(0.975, 1 degree of freedom)
    assert row.prompts == 2
    assert (row.speedup, row.speedup_high) == pytest.approx((1.25, 1.25 + half))
    assert 1.25 - half < 0 and row.speedup_low == 0.0  # two prompts: the t-interval reaches below any ratio


def test_a_cell_counts_the_prompts_behind_its_speedup():
    """A prompt whose baseline failed has no speedup: the row says how many prompts the speedup
    is over, not only how many the cell has."""
    def result(tokens_per_s: float) -> Result:
        return Result(decode_tokens_per_s=tokens_per_s, metrics={"generated_tokens": 8, "rounds": 4})

    members = [(Pair("pl-wiki", 0, 1, "a", 0), result(3.0)), (Pair("pl-wiki", 0, 1, "b", 0), result(1.0))]
    row = cell_row(CellKey("pl-wiki", "gemma3-270m", "aligned", "2", 5, 1), members, {members[0][0]: 2.0}, None)
    assert (row.prompts, row.paired_prompts, row.speedup) == (2, 1, 1.5)
    report = SweepReport(1, "offline", "qwen2.5-coder-1.5b", "done", 3, 4, [row], {}, [])
    assert "| gemma3-270m | aligned | 2 | 1/2 |" in markdown(report)


def test_a_sample_that_stopped_at_once_has_no_speed_on_either_side():
    """Sampled EOS as the first token: no decode speed (stored as 0). It counted as a speedup of
    0 beside a baseline, and a row of speedup 0 made the headline divide by zero."""
    def result(tokens_per_s: float) -> Result:
        return Result(decode_tokens_per_s=tokens_per_s, metrics={"generated_tokens": 1, "rounds": 1})

    stopped, measured, unpaired = (Pair("pl-wiki", 0, 1, key, 0) for key in "abc")
    members = [(stopped, result(0.0)), (measured, result(60.0)), (unpaired, result(30.0))]
    baseline = {stopped: 50.0, measured: 40.0, unpaired: 0.0}
    row = cell_row(CellKey("pl-wiki", "gemma3-270m", "aligned", "2", 5, 1, 0.7, "tli"), members, baseline, None)
    assert (row.prompts, row.paired_prompts, row.speedup, row.tokens_per_s) == (3, 1, 1.5, 45.0)
    nothing = cell_row(CellKey("pl-wiki", "gemma3-270m", "aligned", "3", 5, 1, 0.7, "tli"), members[:1], baseline, None)
    assert (nothing.speedup, nothing.tokens_per_s) == (None, None)
    report = SweepReport(1, "sampled", "gemma3-270m", "done", 3, 3, [row, nothing], {}, [])
    assert "fastest: gemma3-270m aligned k=2" in markdown(report)


def test_the_interval_of_close_ratios_is_the_t_interval():
    ratios = [1.1, 1.2, 1.3, 1.2]
    half = 3.182 * statistics.stdev(ratios) / 2  # t(0.975, 3 degrees of freedom), 4 prompts
    assert mean_interval(ratios) == pytest.approx((1.2, 1.2 - half, 1.2 + half), abs=1e-3)
    # Past the table's 30 degrees of freedom: Student's t from published tables, not the normal 1.96.
    for freedom, quantile in ((30, 2.042), (31, 2.040), (40, 2.021), (60, 2.000), (120, 1.980)):
        assert t_quantile_95(freedom) == pytest.approx(quantile, abs=1e-3)


def test_a_sweep_whose_dataset_gained_or_changed_prompts_is_not_resumed(env, tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text('{"id": "a", "prompt": "Ala ma kota"}\n{"id": "b", "prompt": "Kot ma Alę"}\n', encoding="utf-8")
    sweep_file = tmp_path / "mine.toml"
    sweep_file.write_text(SMALL.replace('datasets = [{ name = "pl-short", limit = 2 }]', f'datasets = ["{data}"]'))
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file))
    assert code == 0 and "5 cells, 10 items" in output
    with data.open("a", encoding="utf-8") as lines:
        lines.write('{"id": "c", "prompt": "Pies ma kość"}\n')
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file))
    assert code == 1 and output == ("polspec: error: sweep 'small' (id 1) was enqueued over other prompts: its datasets "
                                    f"now give 5 items it lacks (first: '{data}/baseline/s0/c/r0'); give the sweep "
                                    "another name\n")
    data.write_text('{"id": "a", "prompt": "Ala ma psa"}\n{"id": "b", "prompt": "Kot ma Alę"}\n', encoding="utf-8")
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file))
    assert code == 1 and output == ("polspec: error: sweep 'small' (id 1) was enqueued over other prompts: its datasets "
                                    f"now give 5 items another text (first: '{data}/baseline/s0/a/r0'); give the "
                                    "sweep another name\n")
    assert len(stored(env)) == 10


def test_a_sweep_name_taken_by_another_configuration_or_a_batch_says_what_differs(env, tmp_path):
    sweep_file = tmp_path / "small.toml"
    sweep_file.write_text(SMALL)
    assert cli(env, "enqueue", "sweep", "--config", str(sweep_file))[0] == 0
    sweep_file.write_text(SMALL.replace("k = [1, 2]", "k = [1, 3]"))
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file))
    assert (code, output) == (1, "polspec: error: sweep 'small' (id 1) exists with another configuration (k: [1, 2] "
                                 "there, [1, 3] in this file); give the sweep another name\n")
    sweep_file.write_text(SMALL.replace('name = "small"', 'name = "pierwsza"'))
    code, output = cli(env, "enqueue", "generate", "--dataset", "pl-short", "--limit", "1", "--name", "pierwsza")
    assert code == 0, output
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file))
    assert (code, output) == (1, "polspec: error: a batch named 'pierwsza' (id 2) exists and is no sweep; give the "
                                 "sweep another name\n")


def test_a_dataset_file_named_by_a_relative_path_is_the_one_beside_the_sweep_file(tmp_path, monkeypatch):
    folder = tmp_path / "eval"
    folder.mkdir()
    (folder / "mine.jsonl").write_text('{"id": "a", "prompt": "Ala ma kota"}\n', encoding="utf-8")
    (tmp_path / "mine.jsonl").write_text('{"id": "z", "prompt": "Nie ten plik"}\n', encoding="utf-8")
    sweep_file = folder / "sweep.toml"
    sweep_file.write_text(SMALL.replace('datasets = [{ name = "pl-short", limit = 2 }]', 'datasets = ["mine.jsonl"]'))
    monkeypatch.chdir(tmp_path)  # started from elsewhere, where a file of that name is another one
    plan = load_sweep(Path("eval/sweep.toml"))
    assert {item.key for item in plan.items} == {"mine.jsonl/baseline/s0/a/r0", *(
        f"mine.jsonl/smollm2-135m/{strategy}/k{k}/p5/s0/a/r0" for strategy in ("aligned", "naive") for k in (1, 2))}
    sweep_file.write_text(SMALL.replace('datasets = [{ name = "pl-short", limit = 2 }]', 'datasets = ["gone.jsonl"]'))
    with pytest.raises(PolspecError) as error:
        load_sweep(Path("eval/sweep.toml"))
    assert str(error.value) == "eval/sweep.toml: 'datasets': eval/gone.jsonl: No such file or directory"


def test_resuming_reopens_a_cancelled_sweep_and_keeps_a_finished_one_done(env, tmp_path):
    sweep_file = tmp_path / "small.toml"
    sweep_file.write_text(SMALL)
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file), "--json")
    batch = json.loads(output)["batch"]
    assert cli(env, "cancel", str(batch))[0] == 0
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file), "--json")
    resumed = json.loads(output)
    assert code == 0 and resumed["enqueued"] == 10
    assert resumed["was_cancelled"] and resumed["reopened"] == {"cancelled": 10}
    assert {item.status for _, item, _ in stored(env).values()} == {"queued"}
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file))
    assert code == 0 and "0 enqueued on polspec-gemma3-270m, 10 still queued or running, 0 already done" in output
    assert "note:" not in output  # nothing was reopened this time
    assert cli(env, "cancel", str(batch))[0] == 0
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file))
    # Resuming a cancelled sweep is how it runs again, as polspec retry --cancelled does for a
    # batch; it was done without a word.
    assert code == 0 and output.startswith(f"note: sweep {batch} was cancelled; its 10 cancelled items are queued "
                                           f"again (polspec cancel {batch} stops them)\n")
    progress = json.loads(cli(env, "status", str(batch), "--json")[1].splitlines()[0])
    assert progress["status"] == "queued" and progress["drafts"] == ["smollm2-135m"]  # resumed, not yet run
    assert "gemma3-270m + smollm2-135m" in cli(env, "status", str(batch))[1]

    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        session.execute(update(Item).values(status="done"))  # as if a worker had run them all
    engine.dispose()
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file), "--json")
    assert code == 0 and json.loads(output)["enqueued"] == 0
    assert json.loads(cli(env, "status", str(batch), "--json")[1].splitlines()[0])["status"] == "done"
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file))
    assert code == 0 and output.endswith(f"0 enqueued on polspec-gemma3-270m, 10 already done\n"
                                         f"nothing left to run: polspec report {batch}\n")


def test_a_resume_that_redis_refuses_says_the_sweep_is_reopened_and_how_it_gets_its_jobs(env, tmp_path, redis_server,
                                                                                           closed_port):
    """Resuming reopens the sweep in the database, then queues its items; a Redis that answers
    a ping but refuses writes failed the second step with a traceback."""
    env = dict(env, POLSPEC_REDIS_URL=redis_server.url)
    sweep_file = tmp_path / "small.toml"
    sweep_file.write_text(SMALL)
    batch = json.loads(cli(env, "enqueue", "sweep", "--config", str(sweep_file), "--json")[1])["batch"]
    assert cli(env, "cancel", str(batch))[0] == 0
    connection = redis.Redis.from_url(redis_server.url)
    connection.replicaof("127.0.0.1", closed_port)
    try:
        code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file))
    finally:
        connection.replicaof("NO", "ONE")
    assert code == 1 and output.count("\n") == 1 and "failed part-way (" in output, output
    assert output.endswith(f"; sweep {batch} is reopened in the database: polspec recover --batch {batch} queues its "
                           "items once Redis takes writes\n")
    assert {item.status for _, item, _ in stored(env).values()} == {"queued"}
    assert cli(env, "recover", "--batch", str(batch))[0] == 0
    assert connection.llen("rq:queue:polspec-gemma3-270m") == 10


def test_an_interrupted_sweep_a_worker_had_begun_stays_whole_and_resumes(env, tmp_path, monkeypatch):
    """Ctrl+C after a worker had taken a sweep's first item: the undo kept that item and deleted
    the rest, and the sweep, missing items, could never be resumed. It now stays whole."""
    sweep_file = tmp_path / "small.toml"
    sweep_file.write_text(SMALL)
    enqueue_items = enqueue_module.enqueue_items

    def enqueue_then_interrupt(connection, name, db_id, items):
        enqueue_items(connection, name, db_id, items[:3])  # the first chunk's jobs went in,
        engine = make_engine(env["POLSPEC_DB_URL"])
        claim_item(engine, items[0][0], Worker("elsewhere", 1))  # a worker took one,
        engine.dispose()
        raise KeyboardInterrupt  # and the user pressed Ctrl+C

    monkeypatch.setattr(enqueue_module, "enqueue_items", enqueue_then_interrupt)
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file))
    assert (code, output) == (1, "polspec: error: interrupted; sweep 1 was already being decoded, so it stays whole: "
                                 "run the sweep again to queue the rest, or polspec cancel 1\n")
    assert sorted(item.status for _, item, _ in stored(env).values()) == ["queued"] * 9 + ["running"]
    monkeypatch.setattr(enqueue_module, "enqueue_items", enqueue_items)
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file), "--json")
    assert code == 0 and json.loads(output)["resumed"], output
    assert redis.Redis.from_url(env["POLSPEC_REDIS_URL"]).llen("rq:queue:polspec-gemma3-270m") == 10


def test_an_edited_sweep_file_tells_that_its_earlier_sweep_is_still_queued(env, tmp_path):
    """Without a name a sweep is named by its content: after an edit the file makes a new sweep,
    and the old one's items stayed queued for the same worker, unmentioned."""
    sweep_file = tmp_path / "small.toml"
    sweep_file.write_text(SMALL.replace('name = "small"\n', ""))
    first = json.loads(cli(env, "enqueue", "sweep", "--config", str(sweep_file), "--json")[1])["batch"]
    sweep_file.write_text(SMALL.replace('name = "small"\n', "").replace("max_tokens = 4", "max_tokens = 6"))
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file))
    assert code == 0 and output.startswith(
        f"note: sweep {first}, from an earlier version of {sweep_file}, is unfinished and still queued; "
        f"polspec cancel {first} drops it\nsweep {first + 1} (sweep-")
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file))  # resumed: nothing new to say
    assert code == 0 and "note:" not in output and f"sweep {first + 1} (" in output
    assert cli(env, "cancel", str(first))[0] == 0
    sweep_file.write_text(SMALL.replace('name = "small"\n', "").replace("max_tokens = 4", "max_tokens = 5"))
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file))
    assert code == 0 and output.startswith(f"note: sweep {first + 1}, from an earlier version") and output.count("note:") == 1


def test_a_sweep_stores_prompt_and_repeat_and_the_report_pairs_results_by_them(env, tmp_path):
    sweep_file = tmp_path / "small.toml"
    sweep_file.write_text(SMALL + "repeats = 2\n")
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file), "--json")
    assert code == 0, output
    rows = stored(env)
    assert len(rows) == 5 * 2 * 2  # cells x prompts x repeats
    assert all(key == f"{cell.key}/{item.prompt_key}/r{item.repeat}" for key, (cell, item, _) in rows.items())
    assert {(item.prompt_key, item.repeat) for _, item, _ in rows.values()} == {
        (prompt, repeat) for prompt in ("short-001", "short-002") for repeat in (0, 1)}

    # Results by hand: every speculative cell exactly `factor` times as fast as the baseline on
    # the same prompt and repeat, whose speeds all differ, so one mispaired result shows.
    base_speed = {("short-001", 0): 10.0, ("short-001", 1): 13.0, ("short-002", 0): 31.0, ("short-002", 1): 47.0}
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        for cell, item, _ in rows.values():
            factor = 1.0 if cell.baseline else factor_of(cell.config)
            session.add(hand_result(item.id, base_speed[item.prompt_key, item.repeat] * factor))
        session.execute(update(Item).values(status="done"))
    engine.dispose()
    code, output = cli(env, "report", str(json.loads(output)["batch"]), "--format", "json")
    assert code == 0, output
    report = json.loads(output.splitlines()[0])
    assert len(report["rows"]) == 4 and report["done"] == report["total"] == 20
    for row in report["rows"]:
        factor = factor_of(row)
        assert row["prompts"] == 2
        assert (row["speedup"], row["speedup_low"], row["speedup_high"]) == pytest.approx((factor, factor, factor))


def test_aggregate_throughput_counts_decoding_not_the_model_load(env, tmp_path):
    sweep_file = tmp_path / "small.toml"
    sweep_file.write_text(SMALL)
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file), "--json")
    # Items run one after another in the order queued, each decoding its 2 tokens in 1 s (the
    # baseline) or 0.5 s; the first, a baseline item, loads the models for 5 s before that.
    engine = make_engine(env["POLSPEC_DB_URL"])
    clock = datetime(2026, 12, 5, 12, 0, 0, tzinfo=UTC)
    with session_scope(engine) as session:
        for index, (cell, item) in enumerate(session.execute(select(Cell, Item).join(Item.cell).order_by(Item.id))):
            load_s = 5.0 if index == 0 else 0.0
            assert cell.baseline == (index % 5 == 0)  # queued prompt by prompt, the baseline first
            decode_s = 1.0 if cell.baseline else 0.5
            item.started_at, item.finished_at = clock, clock + timedelta(seconds=load_s + decode_s)
            clock = item.finished_at + timedelta(seconds=1)
            result = hand_result(item.id, 2 / decode_s)
            result.timings = {"model_load_s": load_s, "probe_s": 0.0}
            session.add(result)
            item.status = "done"
    engine.dispose()
    report = json.loads(cli(env, "report", str(json.loads(output)["batch"]), "--format", "json")[1].splitlines()[0])
    assert [row["aggregate_tokens_per_s"] for row in report["rows"]] == pytest.approx([4.0] * 4)
    assert [row["aggregate_speedup"] for row in report["rows"]] == pytest.approx([2.0] * 4)
    # A cell short of one prompt (failed, or not yet run) has no aggregate speedup: its baseline's
    # whole-run throughput is over other prompts. The other cells keep theirs.
    with session_scope(engine) as session:
        last = session.scalars(select(Item).join(Item.cell).where(Cell.baseline.is_(False)).order_by(Item.id.desc())).first()
        session.delete(last.result)
        last.status = "failed"
    engine.dispose()
    report = json.loads(cli(env, "report", str(json.loads(output)["batch"]), "--format", "json")[1].splitlines()[0])
    assert sorted(row["aggregate_speedup"] is None for row in report["rows"]) == [False, False, False, True]
    assert all(row["aggregate_tokens_per_s"] for row in report["rows"])


def test_a_cell_decoded_in_batches_has_the_energy_of_its_windows_where_they_hold_it_alone(env, tmp_path):
    sweep_file = tmp_path / "small.toml"
    sweep_file.write_text(SMALL)
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file), "--json")
    assert code == 0, output
    # Each cell has two items of 2 tokens. How they were measured, per cell:
    plans = {("aligned", 1): [(0.3, 1, 2), (0.5, 1, 2)],  # two windows, one item each (joules, sequences, tokens)
             ("aligned", 2): [(1.2, 2, 4)],  # one window holding both
             ("naive", 1): [(0.9, 3, 4)],  # both, and a sequence cancelled before its first token
             ("naive", 2): [0.5, (0.7, 1, 2)]}  # one measured alone, one in a window of its own
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        members = {}
        for cell, item in session.execute(select(Cell, Item).join(Item.cell).order_by(Item.id)):
            members.setdefault((cell.baseline, cell.config.get("strategy"), cell.config.get("k")), []).append(item)
        for (baseline, strategy, k), items in members.items():
            plan = [None] if baseline else plans[strategy, k]
            windows = {}
            for index, item in enumerate(items):
                result = hand_result(item.id, 10.0)
                way = plan[index % len(plan)]
                if isinstance(way, float):
                    result.energy_joules, result.energy_source, result.energy_unavailable_reason = way, "rapl", None
                elif way is not None:
                    if id(way) not in windows:
                        joules, sequences, tokens = way
                        window = EnergyWindow(worker_host="h", worker_pid=1, ended_at=utcnow(), energy_joules=joules,
                                              energy_source="rapl", sequences=sequences, generated_tokens=tokens)
                        session.add(window)
                        session.flush()
                        windows[id(way)] = window.id
                    result.energy_window_id = windows[id(way)]
                session.add(result)
                item.status = "done"
    engine.dispose()
    batch = json.loads(output)["batch"]
    code, output = cli(env, "report", str(batch), "--format", "json")
    assert code == 0, output
    rows = {(row["strategy"], int(row["k"])): row["joules_per_token"] for row in json.loads(output.splitlines()[0])["rows"]}
    assert rows == {("aligned", 1): pytest.approx(0.2), ("aligned", 2): pytest.approx(0.3), ("naive", 1): None,
                    ("naive", 2): pytest.approx(0.3)}
    # Five windows where SQLite takes four variables a statement: as a batched sweep of
    # hundreds of thousands of items meets its limit, in a test's time.
    engine = make_engine(env["POLSPEC_DB_URL"])
    event.listen(engine, "connect", lambda connection, _: connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 4))
    report = sweep_report(engine, batch)
    engine.dispose()
    assert {(row.strategy, int(row.k)): row.joules_per_token for row in report.rows} == rows
    # A window that never ended, or one another cell's items shared, gives no joules either.
    results = [hand_result(1, 1.0)]
    results[0].energy_window_id = 7
    assert joules_per_token(results, {7: Window(None, 2, 1)}) is None
    assert joules_per_token(results, {7: Window(1.0, 4, 2)}) is None
    assert joules_per_token(results, {7: Window(1.0, 2, 1)}) == pytest.approx(0.5)
    assert joules_per_token(results) is None


def factor_of(config: dict) -> float:
    """The made-up speedup of a speculative cell (or report row) in the test above."""
    return 1 + int(config["k"]) / 10 + (0.5 if config["strategy"] == "naive" else 0.0)


def hand_result(item_id: int, tokens_per_s: float) -> Result:
    return Result(item_id=item_id, text="Wisła", token_ids=[1, 2], metrics={"generated_tokens": 2, "rounds": 2},
                  prompt_tokens=3, generated_tokens=2, decode_tokens_per_s=tokens_per_s, acceptance_rate=None,
                  energy_joules=None, energy_unavailable_reason="no meter in this test", backend="mlx-cpu",
                  device="cpu", versions={}, timings={})


def test_report_of_a_missing_sweep_is_one_line(env, tmp_path):
    code, output = cli(env, "report", "99")  # the database was never written: no file, not an empty one
    assert code == 1 and "no such file, nothing has been stored there" in output and output.count("\n") == 1
    upgrade(env["POLSPEC_DB_URL"])
    code, output = cli(env, "report", "99", "--output", str(tmp_path / "r.md"))
    assert code == 1 and "no sweep 99" in output and output.count("\n") == 1
    assert not (tmp_path / "r.md").exists()


def test_hugging_face_rows_are_checked_like_file_lines():
    from polspec.decoding.params import DecodingParams
    from polspec.jobs.datasets import _hugging_face_rows
    from polspec.jobs.spec import parse_items

    rows = [{"id": "a", "instruction": "Napisz wiersz."}, {"text": "Kraków to"}, {"id": "a", "question": "Co?"}]
    items = parse_items(_hugging_face_rows("o/n", rows, 2), "hf:o/n", DecodingParams())
    assert [(item.key, item.prompt) for item in items] == [("a", "Napisz wiersz."), ("1", "Kraków to")]
    with pytest.raises(PolspecError, match=r"^hf:o/n row 2: duplicate id 'a' \(first on row 0\)$"):
        parse_items(_hugging_face_rows("o/n", rows, None), "hf:o/n", DecodingParams())

    def streamed():  # the hub dropped the connection after two rows
        yield from rows[:2]
        raise ConnectionError("Connection reset by peer")

    with pytest.raises(PolspecError, match=r"^hf:o/n row 2: reading it failed: Connection reset by peer$"):
        parse_items(_hugging_face_rows("o/n", streamed(), None), "hf:o/n", DecodingParams())
    assert len(parse_items(_hugging_face_rows("o/n", streamed(), 2), "hf:o/n", DecodingParams())) == 2


def test_a_dataset_line_that_sets_decoding_options_is_refused_by_a_sweep(tmp_path):
    """The sweep's cells would decode it with their own settings, so the line's would be
    dropped, and its max_tokens judged the prompt's fit against the context instead of theirs."""
    path = tmp_path / "tuned.jsonl"
    path.write_text('{"id": "a", "prompt": "Ala ma kota"}\n{"id": "b", "prompt": "Kot", "max_tokens": 1, "k": 3}\n',
                    encoding="utf-8")
    with pytest.raises(PolspecError, match=rf"^{path}:2: item 'b' sets k, max_tokens, but a sweep decodes every "
                                           r"prompt with its cell's settings: remove it"):
        expand_sweep(config(datasets=[str(path)]), "test.toml")


def test_datasets_from_jsonl_files_and_a_clear_error_for_hf_without_the_package(tmp_path, monkeypatch):
    from polspec.decoding.params import DecodingParams
    from polspec.jobs.datasets import load_dataset

    path = tmp_path / "moje.jsonl"
    path.write_text('{"id": "x", "prompt": "Zażółć gęślą jaźń"}\n', encoding="utf-8")
    plan = expand_sweep(config(datasets=[str(path)]), "test.toml")
    assert {item.item.prompt for item in plan.items} == {"Zażółć gęślą jaźń"}
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed, whether or not it is here
    with pytest.raises(PolspecError, match=r"hf:speakleash/x needs the datasets package: pip install 'polspec\[hf\]'"):
        load_dataset("hf:speakleash/x", DecodingParams())


@pytest.mark.slow
def test_prompt_length_is_checked_once_for_all_drafts(gemma3, tmp_path, monkeypatch):
    """The length check depends on the target alone: a sweep with two drafts counts a prompt in
    doubt with the target's tokenizer once, and names the file and line of one that does not fit."""
    from polspec.models import tokenizers

    loaded = []
    real = tokenizers.tokenizer_from_directory
    monkeypatch.setattr(tokenizers, "tokenizer_from_directory", lambda *args: loaded.append(args) or real(*args))
    drafts = ["smollm2-135m", "qwen2.5-coder-1.5b"]
    in_doubt = tmp_path / "in_doubt.jsonl"  # 32,000 bytes in few tokens: counted, and it fits
    in_doubt.write_text(json.dumps({"id": "x", "prompt": "a" * 32000}) + "\n", encoding="utf-8")
    plan = expand_sweep(config(datasets=[str(in_doubt)], drafts=drafts), "test.toml")
    assert {planned.item.prompt for planned in plan.items} == {"a" * 32000}
    assert [alias for _, alias in loaded] == ["gemma3-270m"]

    too_long = tmp_path / "too_long.jsonl"
    too_long.write_text(json.dumps({"id": "x", "prompt": "Wisła płynie przez Kraków. " * 6000}) + "\n", encoding="utf-8")
    with pytest.raises(PolspecError, match=rf"^test.toml: {too_long}:1: .*takes at most 32768"):
        expand_sweep(config(datasets=[str(too_long)], drafts=drafts), "test.toml")


def test_each_result_is_predicted_with_the_probe_of_the_machine_that_ran_it():
    """A sweep resumed on two machines: w1 and w2 ran where c = 0.2, w3 where c = 0.5 (by an
    earlier polspec, whose probes did not measure the draft's feed), and w4 recorded no probe
    (the reporting machine's, c = 0.3, stands in). The cell's prediction is each machine's,
    from the acceptance of its own results, weighted by prompts."""
    def probe(c: float) -> Probe:
        return Probe("qwen2.5-coder-1.5b", "gemma3-270m", c=c, rho=(1.0, 1.2, 1.3), tau=0.01)

    def result(recorded: dict | None, accepted: int) -> Result:
        return Result(metrics={"rounds": 10, "plain_rounds": 0, "draft_tokens": 20, "candidates": 20,
                               "candidates_accepted": accepted, "rejections": 10 - accepted // 2, "probe": recorded})

    fast, slow, here = probe(0.2), probe(0.5), probe(0.3)
    earlier = {key: value for key, value in slow.as_dict().items() if key != "draft_feed_s"} | {"format": 2}
    members = [(Pair("pl-wiki", 0, 1, "w1", 0), result(fast.as_dict(), 8)),
               (Pair("pl-wiki", 0, 1, "w2", 0), result(fast.as_dict(), 12)),
               (Pair("pl-wiki", 0, 1, "w3", 0), result(earlier, 6)), (Pair("pl-wiki", 0, 1, "w4", 0), result(None, 4))]
    by_machine = [
        (predicted_speedup_of_rounds(fast, 20 / (20 + 6 + 4), 2, 1.0, 20, 0), 2),  # w1 + w2: 20 accepted, 10 rejections
        (predicted_speedup_of_rounds(slow, 6 / (6 + 7), 2, 1.0, 10, 0), 1),
        (predicted_speedup_of_rounds(here, 4 / (4 + 8), 2, 1.0, 10, 0), 1),
    ]
    expected = sum(value * prompts for value, prompts in by_machine) / 4
    assert predicted_speedup_of_cell("2", members, here) == pytest.approx(expected)
    assert len({round(value, 6) for value, _ in by_machine}) == 3  # the probes make a difference
    assert predicted_speedup_of_cell("2", members, None) is None  # w4 cannot be predicted here
    assert predicted_speedup_of_cell("2", members[:3], None) == pytest.approx(sum(v * w for v, w in by_machine[:2]) / 3)

    # auto: w1's machine speculated (k = 2 on average); w5's probe said no k pays, so it decoded
    # plainly there, which the model predicts as speedup 1.
    plain = Result(metrics={"rounds": 12, "plain_rounds": 12, "draft_tokens": 0, "candidates": 0,
                            "candidates_accepted": 0, "rejections": 0, "probe": slow.as_dict()})
    auto = [members[0], (Pair("pl-wiki", 0, 1, "w5", 0), plain)]
    expected_auto = (predicted_speedup_of_rounds(fast, 8 / (8 + 6), 2, 1.0, 10, 0) + 1.0) / 2
    assert predicted_speedup_of_cell("auto", auto, None) == pytest.approx(expected_auto)


def test_a_batched_cell_is_predicted_and_broken_even_with_the_costs_at_its_batch_size():
    """At B = 4 a round costs what the probe's batch table says for four sequences, in plain
    steps of four: verifying three positions a row costs 1.5 plain steps there against 1.2
    alone (the spare compute runs out), so the same acceptance predicts less and breaks even
    later."""
    table = (BatchCost(1, (0.10, 0.11, 0.12, 0.14, 0.18), 0.05), BatchCost(4, (0.16, 0.20, 0.24, 0.32, 0.48), 0.08))
    probe = Probe("qwen2.5-coder-1.5b", "gemma3-270m", c=0.5, rho=(1.0, 1.1, 1.2, 1.4), tau=0.01,
                  target_step_s=0.10, draft_step_s=0.05, batch=table)
    metrics = {"rounds": 10, "plain_rounds": 0, "draft_tokens": 20, "candidates": 20, "candidates_accepted": 12,
               "rejections": 6, "draft_tokens_accepted": 12, "generated_tokens": 22, "probe": probe.as_dict()}
    results = [(Pair("pl-wiki", 0, batch, "w1", 0), Result(metrics=metrics, decode_tokens_per_s=10.0))
               for batch in (1, 4)]
    rows = {batch: cell_row(CellKey("pl-wiki", "gemma3-270m", "aligned", "2", 5, batch), [member], {}, probe)
            for batch, member in zip((1, 4), results)}
    for batch, row in rows.items():
        at = probe.at_batch(batch)
        assert row.predicted_speedup == pytest.approx(predicted_speedup_of_rounds(at, 12 / 18, 2, 1.0, 10, 0))
        assert row.break_even_acceptance == pytest.approx(accepted_share(break_even_acceptance(at, 2), 2))
    assert rows[4].predicted_speedup < rows[1].predicted_speedup
    assert rows[4].break_even_acceptance > rows[1].break_even_acceptance


def test_a_cell_that_pays_shows_an_acceptance_above_its_break_even():
    """The break-even acceptance was the cost model's chance per candidate, set beside the share
    of candidates accepted: at k = 3 a cell accepting each candidate with 40% accepts 21% of
    them, and a break-even of 29% made a cell the model says pays (1.1x) look as if it did not."""
    probe = Probe("qwen2.5-coder-1.5b", "gemma3-270m", c=0.05, rho=(1.0, 1.05, 1.1, 1.15), tau=0.05,
                  draft_overhead=0.05, target_step_s=0.5, draft_step_s=0.025)
    # 1,000 rounds of 3 candidates, each accepted with 40% up to the first rejection.
    accepted, rejections = round(1000 * (0.4 + 0.4**2 + 0.4**3)), round(1000 * (1 - 0.4**3))
    metrics = {"rounds": 1000, "plain_rounds": 0, "draft_tokens": 3000, "candidates": 3000,
               "candidates_accepted": accepted, "rejections": rejections, "draft_tokens_accepted": accepted,
               "generated_tokens": 1000 + accepted, "probe": probe.as_dict()}
    row = cell_row(CellKey("pl-wiki", "gemma3-270m", "aligned", "3", 5, 1),
                   [(Pair("pl-wiki", 0, 1, "w1", 0), Result(metrics=metrics, decode_tokens_per_s=10.0))], {}, probe)
    assert row.predicted_speedup > 1
    assert break_even_acceptance(probe, 3) > row.acceptance_per_candidate  # the chance per candidate: not comparable
    assert row.break_even_acceptance < row.acceptance_per_candidate == pytest.approx(accepted / 3000)


@pytest.mark.slow
def test_a_sweep_over_batch_sizes_decodes_each_cell_in_its_batches_and_reports_throughput(env, tmp_path):
    sweep_file = tmp_path / "batched.toml"
    sweep_file.write_text('target = "gemma3-270m"\ndrafts = ["smollm2-135m"]\nbatch = [1, 2]\n'
                          'datasets = [{ name = "pl-short", limit = 2 }]\nmax_tokens = 3\nraw = true\n')
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file), "--json")
    assert code == 0 and json.loads(output)["items"] == 4 * 2, output
    sweep = json.loads(output)["batch"]
    work(env, batch=8)  # the cells' own batch sizes win
    rows = stored(env)
    assert all(result is not None for _, _, result in rows.values())
    for cell, _, result in rows.values():
        if cell.config["batch"] == 1:
            assert result.batch_size == 1.0
        else:  # two items of one cell, decoded together and with no other cell's
            assert 1 < result.batch_size <= 2, (cell.key, result.batch_size)

    code, output = cli(env, "report", str(sweep), "--plots", str(tmp_path / "plots"))
    assert code == 0, output
    assert "| B | agg tok/s | agg speedup |" in output
    assert (tmp_path / "plots" / "speedup-by-batch.png").read_bytes().startswith(b"\x89PNG")
    code, output = cli(env, "report", str(sweep), "--format", "json")
    report_rows = json.loads(output)["rows"]
    assert sorted(row["batch"] for row in report_rows) == [1, 2]
    assert all(row["aggregate_tokens_per_s"] > 0 and row["aggregate_speedup"] > 0 for row in report_rows)


def test_the_report_pairs_each_temperature_with_its_own_baseline_and_shows_temperature_and_verify(env, tmp_path):
    sweep_file = tmp_path / "sampled.toml"
    sweep_file.write_text(SMALL.replace('strategies = ["aligned", "naive"]', 'strategies = ["aligned"]')
                          + 'temperatures = [0.0, 0.7]\nverify = ["tli", "exact"]\n')
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file), "--json")
    assert code == 0, output
    sweep = json.loads(output)["batch"]
    rows = stored(env)
    assert len(rows) == (1 + 2 + 1 + 2 * 2) * 2  # (greedy: baseline + k; sampled: baseline + k x verify) x prompts

    # Baselines differ by temperature as well as by prompt: pairing across temperatures shows.
    base_speed = {("short-001", 0.0): 10.0, ("short-002", 0.0): 31.0, ("short-001", 0.7): 7.0, ("short-002", 0.7): 19.0}
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        for cell, item, _ in rows.values():
            config = cell.config
            factor = 1.0 if cell.baseline else sampled_factor_of(config)
            result = hand_result(item.id, base_speed[item.prompt_key, config["temperature"]] * factor)
            if not cell.baseline:  # tli accepts 3 of 4 draft tokens, exact 1 of 4
                result.metrics = result.metrics | {"draft_tokens": 4, "draft_tokens_accepted": accepted_of(config)}
            session.add(result)
        session.execute(update(Item).values(status="done"))
    engine.dispose()
    code, output = cli(env, "report", str(sweep), "--format", "json")
    assert code == 0, output
    report = json.loads(output.splitlines()[0])
    # Greedy rows verified by exact match, though their cells carry the file's first verify.
    assert sorted((row["temperature"], row["verify"], row["k"]) for row in report["rows"]) == [
        (0.0, "exact", "1"), (0.0, "exact", "2"),
        *((0.7, verify, k) for verify in ("exact", "tli") for k in ("1", "2"))]
    for row in report["rows"]:
        factor = sampled_factor_of(row)
        assert (row["speedup"], row["speedup_low"], row["speedup_high"]) == pytest.approx((factor, factor, factor))
        assert row["acceptance_per_draft_token"] == accepted_of(row) / 4
    code, output = cli(env, "report", str(sweep), "--plots", str(tmp_path / "plots"))
    assert (tmp_path / "plots" / "speedup-by-k.png").read_bytes().startswith(b"\x89PNG")
    assert "| draft | strategy | k | T | verify | prompts | accept/cand | accept/draft tok |" in output
    assert "| smollm2-135m | tli | 2 | 0.7 | tli | 2 | - | 75% |" in output  # no strategy translated its tokens
    assert "| smollm2-135m | aligned | 2 | 0.7 | exact | 2 | - | 25% |" in output
    assert "Rows at temperature 0.7 sample with the verify of their row" in output


def test_the_report_tells_cells_at_two_prefixes_apart(env, tmp_path):
    """Rows, auto's comparison with the best fixed k and the plots' lines are per prefix: a
    prefix other than the default is part of what a row is."""
    sweep_file = tmp_path / "prefixes.toml"
    sweep_file.write_text(SMALL.replace('strategies = ["aligned", "naive"]', 'strategies = ["aligned"]')
                          .replace("k = [1, 2]", 'k = [1, 2, "auto"]').replace("prefix = [5]", "prefix = [3, 5]"))
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file), "--json")
    assert code == 0, output
    sweep = json.loads(output)["batch"]
    speed = {"baseline": 10.0, 1: 11.0, 2: 15.0, "auto": 14.0}  # at prefix 5; prefix 3 twice as fast
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        for cell, item, _ in stored(env).values():
            if cell.baseline:
                session.add(hand_result(item.id, speed["baseline"]))
            else:
                session.add(hand_result(item.id, speed[cell.config["k"]] * (2 if cell.config["prefix"] == 3 else 1)))
        session.execute(update(Item).values(status="done"))
    engine.dispose()
    code, output = cli(env, "report", str(sweep), "--format", "json")
    assert code == 0, output
    report = json.loads(output.splitlines()[0])
    speedups = {(row["prefix"], row["k"]): row["speedup"] for row in report["rows"]}
    assert speedups == pytest.approx({(3, "1"): 2.2, (3, "2"): 3.0, (3, "auto"): 2.8,
                                      (5, "1"): 1.1, (5, "2"): 1.5, (5, "auto"): 1.4})
    assert report["headlines"][0]["auto_vs_best"] == pytest.approx({"smollm2-135m/aligned": 1.4 / 1.5,
                                                                    "smollm2-135m/aligned/p3": 2.8 / 3.0})
    code, output = cli(env, "report", str(sweep))
    assert "| draft | strategy | k | prefix | prompts |" in output
    assert "| smollm2-135m | aligned | 2 | 3 | 2 |" in output and "| smollm2-135m | aligned | 2 | 5 | 2 |" in output
    assert "fastest: smollm2-135m aligned k=2 prefix=3 at 3.00x" in output
    code, output = cli(env, "report", str(sweep), "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(output, newline="")))
    assert code == 0 and output.endswith("False\n") and len(rows) == 6 and {row["prefix"] for row in rows} == {"3", "5"}


def sampled_factor_of(config: dict) -> float:
    """The made-up speedup of a sampled sweep's cell (or report row) in the test above."""
    tli = config["verify"] == "tli" and config["temperature"]  # greedy cells verify by exact match
    return 1 + int(config["k"]) / 10 + (0.5 if tli else 0.0) + config["temperature"]


def accepted_of(config: dict) -> int:
    return 3 if config["verify"] == "tli" and config["temperature"] else 1


def test_cells_of_sweeps_from_before_temperature_grids_count_at_the_sweeps_temperature(env, tmp_path):
    sweep_file = tmp_path / "old.toml"
    sweep_file.write_text(SMALL + 'temperature = 0.7\nverify = "exact"\n')
    code, output = cli(env, "enqueue", "sweep", "--config", str(sweep_file), "--json")
    assert code == 0, output
    rows = stored(env)
    assert not any("/t" in cell.key or "/v" in cell.key for cell, _, _ in rows.values())
    engine = make_engine(env["POLSPEC_DB_URL"])
    with session_scope(engine) as session:
        for cell in session.scalars(select(Cell)):  # as an older sweep wrote them
            cell.config = {key: value for key, value in cell.config.items()
                           if key not in ("temperature", "verify", "batch")}
        for cell, item, _ in rows.values():
            session.add(hand_result(item.id, 10.0 * (1.0 if cell.baseline else factor_of(cell.config))))
        session.execute(update(Item).values(status="done"))
    engine.dispose()
    sweep = json.loads(output)["batch"]
    for before_verify in (False, True):
        if before_verify:  # nor does the sweep itself record one: it sampled with exact match
            with session_scope(engine) as session:
                batch = session.get(Batch, sweep)
                batch.spec = batch.spec | {"params": {k: v for k, v in batch.spec["params"].items() if k != "verify"}}
            engine.dispose()
        code, output = cli(env, "report", str(sweep), "--format", "json")
        report = json.loads(output.splitlines()[0])
        assert sorted(row["strategy"] for row in report["rows"]) == ["aligned", "aligned", "naive", "naive"]
        for row in report["rows"]:
            assert (row["temperature"], row["verify"], row["batch"]) == (0.7, "exact", 1)
            assert row["speedup"] == pytest.approx(factor_of(row))
