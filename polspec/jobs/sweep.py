"""Evaluation sweeps: a TOML grid expanded into cells and items, enqueued in a drift-fair order.

A sweep file names one target, its drafts and datasets, and the grid to run on them; every
other key may be left out and takes the default shown in the comment::

    name = "offline"                            # optional; re-running a named sweep resumes it
    target = "qwen2.5-coder-1.5b"
    drafts = ["gemma3-270m", "smollm2-135m"]
    strategies = ["naive", "context", "aligned"]  # default ["aligned"]
    k = [1, 2, 3, 4, 6, "auto"]                 # numbers and policy names (heuristic, confidence, auto); default [2]
    prefix = [5]                                # default [5]
    datasets = ["pl-wiki", "pl-instruct", { name = "pl-short", limit = 10 }]  # or "mine.jsonl", beside this file
    limit = 20                                  # items per dataset unless the dataset says otherwise
    max_tokens = 64
    temperatures = [0.0, 0.7]                   # a grid; or `temperature = 0.7` for every cell (not both); default 0.0
    partial_word = "verify"                     # or "hold" (aligned only; see polspec.decoding.translate)
    draft_vocab = "auto"                        # or "full", or a number of tokens (see polspec.decoding.draft_vocab)
    verify = ["exact", "tli"]                   # sampled rounds: "tli", "exact", "auto" or a list of them; default "auto"
                                                # (see polspec.decoding.speculative_sampling; sampled speculative cells only)
    top_p = 1.0                                 # default 1.0; top_k = 0 (off) likewise
    seeds = [0]                                 # default [0]
    repeats = 1                                 # default 1
    batch = [1]                                 # items decoded together, default [1]; [1, 4, 8] measures throughput
    raw = true                                  # continue text instead of the chat templates

A *cell* is one configuration (dataset, draft, strategy, k, prefix, verify, seed, temperature,
batch); every dataset, seed, temperature and batch size also gets a target-only *baseline* cell.
Grid points that would decode alike get one cell, the first listed: greedy decoding verifies by
exact match and draws nothing, so a temperature of 0 gets the first ``verify`` value's cells
and the first seed's alone; speculative sampling (``tli``) proposes the draft's own tokens and
translates nothing, so its cells take the first strategy and prefix alone; ``naive`` and
``none`` read no prefix, so theirs take the first. A cell's key
names its grid point, with ``/t{temperature}`` only when the file lists ``temperatures`` and ``/v{verify}`` only when ``verify`` lists more than
one value, so that sweeps written before those keys keep their cell keys and still resume. An
*item* is one prompt in one cell (and one repeat). Items are enqueued prompt by prompt: the baseline item of a
prompt, then every speculative cell's item for the same prompt, so that machine drift (thermal
throttling, other load) hits baseline and speculation alike, and the target and drafts stay
resident throughout. With batch sizes above 1 they go chunk by chunk instead, a chunk being as
many prompts as the largest batch: each cell's items of a chunk in a row, so that a batched
worker finds them together (a cell's items only ever share a batch with their own cell).
Batch 1 is the default, so that per-sequence speedups stay comparable to the study.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import math
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any

from polspec.decoding.params import STRATEGY_OPTIONS, DecodingParams, as_written, is_whole_number, options_unread_by
from polspec.errors import PolspecError, not_utf8, past_parser_limits
from polspec.jobs.datasets import dataset_source, load_dataset
from polspec.jobs.spec import GenerateSpec, ItemInput, check_items_fit, check_models, has_control_characters
from polspec.models.registry import load_registry

# Decoding parameters a sweep sets once for all its cells.
SWEEP_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "partial_word", "draft_vocab", "verify")
SWEEP_KEYS = {"name", "target", "drafts", "strategies", "k", "prefix", "datasets", "limit", *SWEEP_PARAMS,
              "temperatures", "seeds", "repeats", "batch", "raw"}
# Decoding parameters that may also be a grid dimension: every cell is given its own value.
GRID_PARAMS = ("temperature", "verify")
DATASET_KEYS = {"name", "limit"}
GRID_KEYS = ("drafts", "strategies", "k", "prefix", "datasets", "seeds", "batch")
# What a sweep file may leave out takes the command line's defaults, which are DecodingParams's
# own; a sweep's seed is 0 rather than the command line's none so that its samples repeat.
# `drafts` and `datasets` it must name.
_DEFAULT = DecodingParams()
# More items than an overnight sweep decodes on any machine (a million 128-token generations
# of a 1.5B model is weeks of an M2 Pro), and few enough to write in one enqueue.
MAX_SWEEP_ITEMS = 1_000_000
GRID_DEFAULTS = {"strategies": [_DEFAULT.strategy], "k": [_DEFAULT.k], "prefix": [_DEFAULT.prefix], "seeds": [0],
                 "batch": [1]}


@dataclass(frozen=True)
class CellPlan:
    key: str
    config: dict[str, Any]
    baseline: bool
    params: DecodingParams


@dataclass(frozen=True)
class ItemPlan:
    """One item of a sweep: its cell's key, its unique item key, the dataset's id of its prompt
    and its repeat (stored as columns, which pair it with other cells' items), and its input."""

    cell: str
    key: str
    prompt_key: str
    repeat: int
    item: ItemInput


@dataclass
class SweepPlan:
    """A validated, expanded sweep: its name, spec, cells and items in enqueue order."""

    name: str
    spec: GenerateSpec
    config: dict[str, Any]
    cells: list[CellPlan] = field(default_factory=list)
    items: list[ItemPlan] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # settings that change nothing, limits past a dataset's end


def load_sweep(path: Path) -> SweepPlan:
    """Read, validate and expand a sweep file; every problem is one error naming the file and key."""
    try:
        data = path.read_bytes().removeprefix(codecs.BOM_UTF8)  # an editor's byte order mark is no error
        config = tomllib.loads(data.decode("utf-8"))
    except OSError as error:
        raise PolspecError(f"{path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise not_utf8(str(path), error) from None
    except tomllib.TOMLDecodeError as error:
        raise PolspecError(f"{path}: not valid TOML: {error}") from None
    except (ValueError, RecursionError) as error:
        raise past_parser_limits(str(path), error) from None
    return expand_sweep(config, str(path), path.parent)


def expand_sweep(config: dict[str, Any], source: str, folder: Path | None = None) -> SweepPlan:
    """Cells and items of a sweep configuration (see the module docstring for the keys); a
    dataset file named by a relative path is taken from ``folder`` (the sweep file's), else
    from the working directory."""
    unknown = sorted(set(config) - SWEEP_KEYS)
    if unknown:
        raise PolspecError(f"{source}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(SWEEP_KEYS))})")
    if not isinstance(config.get("target"), str):
        raise PolspecError(f"{source}: 'target' must name the target model")
    sweep_name = config.get("name", "x")
    if not isinstance(sweep_name, str) or not sweep_name.strip() or has_control_characters(sweep_name):
        raise PolspecError(f"{source}: 'name' must be some text on one line (or be left out), got {sweep_name!r}")
    grid = {key: _list(config, key, source) for key in GRID_KEYS if key != "datasets"}
    _check_aliases(config["target"], grid["drafts"], source)
    datasets = _datasets(config, source, folder)
    temperatures, verifies = _temperatures(config, source), _verifies(config, source)
    repeats = _at_least_one(config.get("repeats", 1), "'repeats'", source)
    for size in grid["batch"]:
        _at_least_one(size, "every 'batch' size", source)
    base = _params(config, source, temperature=temperatures[0], verify=verifies[0])
    # Each value of the grid's lists on its own: a cell the grid leaves out (later seeds when
    # greedy, later strategies under tli) must not hide a value that cannot run.
    for key, param in (("seeds", "seed"), ("strategies", "strategy"), ("k", "k"), ("prefix", "prefix")):
        for value in grid[key]:
            _params(config, source, temperature=temperatures[0], verify=verifies[0], **{param: value})
    raw = config.get("raw", False)
    if not isinstance(raw, bool):
        raise PolspecError(f"{source}: 'raw' must be true or false")
    spec = GenerateSpec(config["target"], None, base, False if raw else None, source)

    try:
        prompts = {name: load_dataset(name, base, limit, relative_to=folder) for name, limit in datasets}
    except PolspecError as error:
        raise PolspecError(f"{source}: 'datasets': {error}") from None
    every_item = [item for items in prompts.values() for item in items]
    tuned = next((item for item in every_item if item.overrides), None)
    if tuned is not None:  # a cell's settings are what the sweep compares: one line may not change them
        raise PolspecError(f"{tuned.where or source}: item {tuned.key!r} sets {', '.join(sorted(tuned.overrides))}, "
                           "but a sweep decodes every prompt with its cell's settings: remove it from the line "
                           "(the sweep file sets them)")
    try:
        for draft in [None, *grid["drafts"]]:
            check_models(GenerateSpec(spec.target, draft, base, spec.chat, source), every_item,
                         raw_option="raw = true")
        check_items_fit(spec, every_item)
    except PolspecError as error:
        raise PolspecError(f"{source}: {error}") from None

    per_dataset = {dataset: _cells(config, source, dataset, grid, temperatures, verifies) for dataset, _ in datasets}
    total = sum(len(per_dataset[dataset]) * len(items) for dataset, items in prompts.items()) * repeats
    if total > MAX_SWEEP_ITEMS:  # before building them: a typo in 'repeats' would not end
        raise PolspecError(f"{source}: the sweep would queue {total:,} items, more than {MAX_SWEEP_ITEMS:,}: "
                           "cut its repeats, seeds, grid or dataset limits")

    plan = SweepPlan(config.get("name") or _default_name(config), spec, dict(config))
    plan.cells = [cell for cells in per_dataset.values() for cell in cells]
    plan.notes = _notes(config, grid, temperatures, verifies, datasets, prompts, repeats)
    chunk = max(grid["batch"])
    ids: dict[str, str] = {}  # an item's key, the id of the prompt it was made for
    for dataset, _ in datasets:
        runs = list(product(prompts[dataset], range(repeats)))
        params = {cell.key: cell.params.as_dict() for cell in per_dataset[dataset]}
        for start in range(0, len(runs), chunk):
            for cell in per_dataset[dataset]:
                for item, repeat in runs[start:start + chunk]:
                    key = f"{cell.key}/{item.key}/r{repeat}"
                    if key in ids:  # ids with a '/' can: "b4/x" in one cell, "x" in the cell ending "/b4"
                        raise PolspecError(f"{item.where or source}: the ids {ids[key]!r} and {item.key!r} make one "
                                           f"item key in this grid ({key!r}): give one of them an id without '/'")
                    ids[key] = item.key
                    plan.items.append(ItemPlan(cell.key, key, item.key, repeat,
                                               ItemInput(key, item.prompt, item.messages, dict(params[cell.key]))))
    return plan


def _cells(config: dict[str, Any], source: str, dataset: str, grid: dict[str, list],
           temperatures: list[float], verifies: list) -> list[CellPlan]:
    """One dataset's cells, in enqueue order: per seed, temperature and batch size, its baseline
    then every draft setting."""
    cells = []
    for seed, temperature, batch in product(grid["seeds"], temperatures, grid["batch"]):
        if not temperature and seed != grid["seeds"][0]:
            continue
        # Batch 1, a scalar temperature and a single verify keep the cell keys of older sweeps,
        # so that they still resume.
        size = "" if batch == 1 else f"/b{batch}"
        heat = f"/t{_number(temperature)}" if "temperatures" in config else ""
        sampled = {"seed": seed, "temperature": temperature}
        cells.append(CellPlan(f"{dataset}/baseline/s{seed}{heat}{size}",
                              {"dataset": dataset, "draft": None, **sampled, "batch": batch}, True,
                              _params(config, source, **sampled, verify=verifies[0])))
        # Greedy cells verify by exact match whatever 'verify' says: one of them, not one per way.
        for draft, strategy, k, prefix, verify in product(grid["drafts"], grid["strategies"], grid["k"],
                                                          grid["prefix"], verifies if temperature else verifies[:1]):
            translates = not temperature or verify == "exact"
            if not translates and strategy != grid["strategies"][0]:
                continue
            if not (translates and strategy in STRATEGY_OPTIONS["prefix"]) and prefix != grid["prefix"][0]:
                continue
            check = f"/v{verify}" if len(verifies) > 1 else ""
            cells.append(CellPlan(
                f"{dataset}/{draft}/{strategy}/k{k}/p{prefix}{check}/s{seed}{heat}{size}",
                {"dataset": dataset, "draft": draft, "strategy": strategy, "k": k, "prefix": prefix,
                 "verify": verify, **sampled, "batch": batch},
                False, _params(config, source, k=k, strategy=strategy, prefix=prefix, verify=verify, **sampled)))
    return cells


def _notes(config: dict[str, Any], grid: dict[str, list], temperatures: list[float], verifies: list,
           datasets: list[tuple[str, int | None]], prompts: dict[str, list], repeats: int) -> list[str]:
    """What the file asks for that changes nothing, as ``generate`` tells of its options: the
    sampler's keys where nothing is sampled, a strategy's own where no strategy reads them,
    strategies and prefixes where no round translates, a dataset's limit past its end, and a
    batch size that a dataset's cells cannot fill."""
    notes = []
    greedy = [key for key in ("seeds", "top_p", "top_k", "verify")
              if key in config and not (key == "seeds" and len(grid["seeds"]) == 1)] if not any(temperatures) else []
    unread = options_unread_by(grid["strategies"], [key for key in config if not (key == "prefix" and len(grid["prefix"]) == 1)])
    strategies = ", ".join(grid["strategies"])
    for keys, reason, (listed, one) in ((greedy, "at temperature 0 (greedy decoding)", ("seeds", "seed")),
                                        (unread, f"with strategies {strategies}", ("prefix", "prefix"))):
        if keys:
            alone = f": only the first {one} runs" if listed in keys else ""
            notes.append(f"{', '.join(repr(key) for key in keys)} {'has' if len(keys) == 1 else 'have'} no effect "
                         f"{reason}{alone}")
    # Every round sampled and verified by speculative sampling, which maps tokens: no cell translates.
    mapped = [key for key in ("strategies", "prefix") if len(grid[key]) > 1 and key not in unread]
    if mapped and all(temperatures) and "exact" not in verifies:
        notes.append(f"{', '.join(repr(key) for key in mapped)} {'has' if len(mapped) == 1 else 'have'} no effect "
                     f"with verify {', '.join(verifies)} at temperature above 0 (speculative sampling maps tokens, "
                     f"it translates none): only the first {'of each ' if len(mapped) > 1 else ''}runs")
    notes += [f"dataset {name!r} holds {len(prompts[name])} prompts, fewer than its limit of {limit}: all of them run"
              for name, limit in datasets if limit is not None and len(prompts[name]) < limit]
    # A cell's items only ever share a batch with their own cell.
    for name, _ in datasets:
        items = len(prompts[name]) * repeats
        unfilled = [size for size in grid["batch"] if size > items]
        if unfilled:
            sizes = ", ".join(map(str, unfilled))
            notes.append(f"batch {sizes} {'is' if len(unfilled) == 1 else 'are'} more than the {items} items a cell "
                         f"of dataset {name!r} holds (its prompts x repeats): those cells decode at most {items} "
                         "together")
    return notes


def _list(config: dict[str, Any], key: str, source: str) -> list:
    if key not in config:
        if key in GRID_DEFAULTS:
            return GRID_DEFAULTS[key]
        raise PolspecError(f"{source}: '{key}' is missing")
    values = config[key]
    if not isinstance(values, list) or not values:
        raise PolspecError(f"{source}: '{key}' must be a non-empty list, got {as_written(values)}")
    _refuse_repeats(values, str, key, source)
    return values


def _refuse_repeats(values: list, same: Callable[[Any], Any], key: str, source: str) -> None:
    """Name the first value of ``key`` that repeats an earlier one (equal under ``same``)."""
    seen = set()
    for value in values:
        if same(value) in seen:
            raise PolspecError(f"{source}: '{key}' lists {value!r} twice")
        seen.add(same(value))


def _check_aliases(target: str, drafts: list, source: str) -> None:
    """The target and every draft are model aliases the registry knows."""
    registry = load_registry()
    for alias in [target, *drafts]:
        if not isinstance(alias, str):
            raise PolspecError(f"{source}: 'drafts' must list model aliases (text), got {as_written(alias)}")
        try:
            registry.model(alias)
        except PolspecError as error:
            raise PolspecError(f"{source}: {error}") from None


def _temperatures(config: dict[str, Any], source: str) -> list[float]:
    """The sweep's temperatures: the ``temperatures`` list, else the one ``temperature`` (or the default)."""
    if "temperatures" not in config:
        return [config.get("temperature", _DEFAULT.temperature)]
    if "temperature" in config:
        raise PolspecError(f"{source}: give 'temperature' or 'temperatures', not both")
    values = _list(config, "temperatures", source)
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
            raise PolspecError(f"{source}: 'temperatures' must list numbers of at least 0, got {as_written(value)}")
    _refuse_repeats(values, float, "temperatures", source)  # 0 and 0.0 are one temperature
    return [float(value) for value in values]


def _verifies(config: dict[str, Any], source: str) -> list:
    """The sweep's verification settings: ``verify`` as a list, or one value (older files) as a
    list of one, each checked by DecodingParams."""
    verifies = _list(config, "verify", source) if isinstance(config.get("verify"), list) \
        else [config.get("verify", _DEFAULT.verify)]
    for verify in verifies:
        try:
            DecodingParams(verify=verify)
        except PolspecError as error:
            raise PolspecError(f"{source}: {error}") from None
    if {"auto", "tli"} <= set(verifies):
        raise PolspecError(f"{source}: 'verify' lists 'auto' and 'tli', which are one way (auto samples with tli)")
    return verifies


def _number(value: float) -> str:
    """A temperature in a cell key: ``0``, ``1``, ``0.7`` (distinct temperatures, distinct text)."""
    return str(int(value)) if value.is_integer() else repr(value)


def _at_least_one(value: object, where: str, source: str) -> int | None:
    if value is not None and (not is_whole_number(value) or value < 1):
        raise PolspecError(f"{source}: {where} must be a whole number of at least 1, got {as_written(value)}")
    return value


def _datasets(config: dict[str, Any], source: str, folder: Path | None) -> list[tuple[str, int | None]]:
    default = _at_least_one(config.get("limit"), "'limit'", source)
    chosen: list[tuple[str, int | None]] = []
    for entry in _list(config, "datasets", source):
        if isinstance(entry, str):
            chosen.append((entry, default))
        elif isinstance(entry, dict):
            unknown = sorted(set(entry) - DATASET_KEYS)
            if unknown:
                raise PolspecError(f"{source}: a dataset entry has an unknown key {unknown[0]!r} "
                                   "(it takes a 'name' and a 'limit')")
            if not isinstance(entry.get("name"), str):
                raise PolspecError(f"{source}: a dataset entry takes a 'name' (text) and a 'limit', got {entry}")
            limit = _at_least_one(entry.get("limit", default), f"the 'limit' of dataset {entry['name']!r}", source)
            chosen.append((entry["name"], limit))
        else:
            raise PolspecError(f"{source}: 'datasets' entries are names or {{ name = ..., limit = ... }} tables")
        same = next((name for name, _ in chosen[:-1]
                     if dataset_source(name, folder) == dataset_source(chosen[-1][0], folder)), None)
        if same is not None:  # under two spellings, one file would run twice
            also = f" (as {same!r} too)" if same != chosen[-1][0] else ""
            raise PolspecError(f"{source}: 'datasets' lists {chosen[-1][0]!r} twice{also}")
    return chosen


def _params(config: dict[str, Any], source: str, **grid_point) -> DecodingParams:
    """The decoding parameters of one grid point; ``grid_point`` gives every GRID_PARAMS value."""
    options = {key: config[key] for key in SWEEP_PARAMS if key in config and key not in GRID_PARAMS}
    listed = next((key for key in ("temperature", *options) if isinstance(config.get(key), list)), None)
    if listed is not None:  # a list where one value goes: the grid keys are others
        grid = " ('temperatures' makes a grid of them)" if listed == "temperature" else ""
        raise PolspecError(f"{source}: '{listed}' takes one value, got a list{grid}")
    try:
        return DecodingParams(**options, **grid_point)
    except (PolspecError, TypeError) as error:
        raise PolspecError(f"{source}: {error}") from None


def _default_name(config: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]
    return f"sweep-{digest}"
