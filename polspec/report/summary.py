"""A sweep's numbers, one row per dataset, draft, strategy, k, prefix, batch size, temperature
and verification.

Every row is computed from the stored results alone (plus this machine's probe for the
break-even acceptance, and for predicting results that recorded no probe), so a report can be
regenerated at any time:

- acceptance per candidate (accepted / verified) and per draft token, committed tokens per round;
- tokens/s (median over generations) and the speedup against the *paired* baseline: for every
  prompt, seed, temperature and repeat the speculative tokens/s over the baseline's tokens/s on
  the same prompt, seed, temperature and repeat; averaged per prompt, then over prompts with a
  95% t-interval (cells of sweeps from before temperature grids count at the sweep's temperature);
- aggregate throughput (every token of the cell over the wall time its items were decoding,
  so items decoded together add up) and its ratio to the target-only baseline at the same
  batch size: what a bulk run gains from speculation at that batch size;
- energy per token where every item of the cell was measured: alone, or as part of a batch
  whose energy window holds the cell's results and nothing else (see :func:`joules_per_token`);
- translation time as a fraction of verification time;
- the cost model's predicted speedup from the acceptance measured in the cell (the
  geometric-acceptance estimate: accepted / (accepted + rejecting rounds)) over the rounds
  the cell ran (``auto`` rows mix speculative rounds with plain target steps), with the probe
  of the machine that ran each result (a sweep resumed on other machines mixes them), and the
  break-even acceptance for the cell's k, as a share of candidates accepted like the
  acceptance per candidate beside it (:func:`~polspec.decoding.costmodel.accepted_share`).

Per dataset, a headline over those rows: the fastest fixed-k cell, how close ``auto`` comes to
the best fixed k of its draft and strategy, and the largest prediction miss for k <= 3.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, Protocol

from sqlalchemy import Engine, func, select

from polspec.decoding.costmodel import (PREDICTION_FORMATS, Probe, accepted_share, break_even_acceptance, candidates_for,
                                       predicted_speedup_of_rounds)
from polspec.decoding.params import DecodingParams
from polspec.decoding.probe_files import load_probe
from polspec.errors import PolspecError
from polspec.store.engine import session_scope
from polspec.store.queries import busy_seconds, decoding_start, seconds_before_decoding
from polspec.store.schema import Batch, Cell, EnergyWindow, Item, Result, Status

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (beyond: t_quantile_95).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


class Measured(Protocol):
    """What a report reads of a result: a stored :class:`Result`, or a row of those columns."""

    metrics: dict[str, Any]
    decode_tokens_per_s: float
    generated_tokens: int
    energy_joules: float | None
    energy_window_id: int | None


class Window(NamedTuple):
    """What a report needs of an energy window: its joules (None: unknown) and every sequence
    and token it decoded."""

    joules: float | None
    generated_tokens: int
    sequences: int


def joules_per_token(results: list[Measured], windows: dict[int, Window] | None = None) -> float | None:
    """Joules per generated token over ``results``, or None where that is not a measurement.

    A result counts with its own joules (it decoded alone), or else with the whole of the
    energy window it decoded in (``windows`` by id), which must hold these results and no other
    sequence: a window that also decoded a cancelled one, another cell's items or a result that
    was not kept spent part of its joules on them (its prefill at least, even where it wrote no
    token), and splitting them would be an estimate.
    """
    joules = 0.0
    kept_in_window: dict[int, list[int]] = defaultdict(list)
    for result in results:
        if result.energy_joules is not None:
            joules += result.energy_joules
        elif result.energy_window_id is not None:
            kept_in_window[result.energy_window_id].append(result.generated_tokens)
        else:
            return None
    for window_id, kept in kept_in_window.items():
        window = (windows or {}).get(window_id)
        whole = window is not None and (window.sequences, window.generated_tokens) == (len(kept), sum(kept))
        if not whole or window.joules is None:
            return None
        joules += window.joules
    tokens = sum(result.generated_tokens for result in results)
    return joules / tokens if tokens else None


class Pair(NamedTuple):
    """Where a result sits in its sweep, short of the configuration under test: a speculative
    result is compared with the baseline result of an equal pair. Read from the item's columns
    and its cell's configuration."""

    dataset: str
    seed: int
    batch: int
    prompt_key: str
    repeat: int
    temperature: float = 0.0


@dataclass(frozen=True)
class CellKey:
    """What makes a report row: a speculative cell's grid point short of its seed."""

    dataset: str
    draft: str
    strategy: str
    k: str
    prefix: int
    batch: int
    temperature: float = 0.0
    verify: str = "auto"  # the cell's setting when it samples; "exact" when greedy, which verifies by exact match


def row_order(key: CellKey) -> tuple:
    """The order of a report's rows: a cell key's fields in turn, but k numbers in numeric order
    (k = 12 after k = 2), then the policies by name."""
    k = (0, int(key.k), "") if key.k.isdigit() else (1, 0, key.k)
    return (key.dataset, key.draft, key.strategy, k, key.prefix, key.batch, key.temperature, key.verify)


@dataclass(frozen=True, kw_only=True)
class Row(CellKey):
    """One cell's numbers, after its grid point."""

    prompts: int
    paired_prompts: int  # the prompts behind the speedup: those whose baseline finished too
    acceptance_per_candidate: float | None
    acceptance_per_draft_token: float | None
    tokens_per_round: float | None
    tokens_per_s: float | None  # median over the cell's timed results
    baseline_tokens_per_s: float | None  # median over the baselines paired with them: the speedup's prompts only
    speedup: float | None
    speedup_low: float | None
    speedup_high: float | None
    aggregate_tokens_per_s: float | None
    aggregate_speedup: float | None  # over the baseline's aggregate throughput at the same batch size
    joules_per_token: float | None
    translation_overhead: float | None
    predicted_speedup: float | None
    break_even_acceptance: float | None
    never_pays: bool = False  # this machine's probe says no acceptance makes the cell's k pay

    @property
    def sampling(self) -> str:
        """Temperature and verify when sampling (``/t0.7/vtli``), empty when greedy: greedy cells
        decode alike whatever their file's verify said (their rows say exact)."""
        return f"/t{self.temperature:g}/v{self.verify}" if self.temperature else ""

    @property
    def custom_prefix(self) -> bool:
        """Whether the cell translates with a prefix other than the default: its rows are told
        apart from the default's by it."""
        return self.prefix != DecodingParams.prefix

    @property
    def variant(self) -> str:
        """What sets the row apart short of draft, strategy, k and batch: a prefix other than the
        default (``/p3``) and the sampling (``/t0.7/vtli``)."""
        return (f"/p{self.prefix}" if self.custom_prefix else "") + self.sampling

    @property
    def pair(self) -> str:
        """Draft and strategy (with the variant, and the batch size above 1): the cells whose k
        are compared."""
        return f"{self.draft}/{self.strategy}{self.variant}" + (f"/b{self.batch}" if self.batch != 1 else "")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Headline:
    """What a reader wants first from one dataset's rows."""

    dataset: str
    best: Row | None  # the fixed-k cell with the highest mean speedup
    auto_vs_best: dict[str, float]  # Row.pair: auto's speedup over that pair's best fixed-k speedup
    worst_prediction: Row | None  # the k <= 3 cell whose prediction misses its measured speedup most
    prompts: int = 0  # the paired prompts of the cells compared: the most any cell has
    left_out: int = 0  # measured cells over fewer paired prompts, compared with none

    @property
    def prediction_error(self) -> float | None:
        """|predicted / measured - 1| of ``worst_prediction``."""
        row = self.worst_prediction
        return abs(row.predicted_speedup / row.speedup - 1) if row else None

    def as_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "best": self.best.as_dict() if self.best else None,
                "auto_vs_best": self.auto_vs_best, "prediction_error": self.prediction_error,
                "worst_prediction": self.worst_prediction.as_dict() if self.worst_prediction else None,
                "prompts": self.prompts, "left_out": self.left_out}


@dataclass
class SweepReport:
    batch_id: int
    name: str
    target: str
    status: str
    done: int  # generations finished, of ``total``
    total: int
    rows: list[Row]
    probes: dict[str, Probe | None]
    missing_probe: list[str]
    # speculative results paired with a baseline that another worker process ran (a restart, a
    # resumed sweep, another machine): their speedups compare runs under different conditions
    cross_run_pairs: int = 0

    @property
    def batched(self) -> bool:
        """Whether the sweep decoded at batch sizes above 1."""
        return any(row.batch != 1 for row in self.rows)

    @property
    def temperatures(self) -> list[float]:
        """The temperatures the rows decoded at, in order."""
        return sorted({row.temperature for row in self.rows})

    @property
    def prefixes(self) -> list[int]:
        """The prefixes the rows translated with, in order."""
        return sorted({row.prefix for row in self.rows})

    @property
    def verifies(self) -> list[str]:
        """The verify settings of the rows, in order."""
        return sorted({row.verify for row in self.rows})

    @property
    def headlines(self) -> list[Headline]:
        return [headline(dataset, [row for row in self.rows if row.dataset == dataset])
                for dataset in sorted({row.dataset for row in self.rows})]


def headline(dataset: str, rows: list[Row]) -> Headline:
    """The headline of one dataset's rows, over the cells measured on the most paired prompts.

    Cells without a paired baseline are left out, and so are cells measured on fewer prompts
    than others: mid-sweep the baselines and the cells queued first hold more prompts than the
    rest, and a cell measured on one prompt would win or lose the comparison on that prompt."""
    measured = [row for row in rows if row.speedup is not None]
    prompts = max((row.paired_prompts for row in measured), default=0)
    compared = [row for row in measured if row.paired_prompts == prompts]
    left_out, measured = len(measured) - len(compared), compared
    fixed = [row for row in measured if row.k.isdigit()]
    best_per_pair: dict[str, float] = {}
    for row in fixed:
        best_per_pair[row.pair] = max(best_per_pair.get(row.pair, 0.0), row.speedup)
    auto_vs_best = {row.pair: row.speedup / best_per_pair[row.pair]
                    for row in measured if row.k == "auto" and row.pair in best_per_pair}
    predicted = [row for row in fixed if int(row.k) <= 3 and row.predicted_speedup is not None]
    return Headline(dataset, max(fixed, key=lambda row: row.speedup, default=None), auto_vs_best,
                    max(predicted, key=lambda row: abs(row.predicted_speedup / row.speedup - 1), default=None),
                    prompts, left_out)


def mean_interval(ratios: list[float]) -> tuple[float, float | None, float | None]:
    """Mean of positive ratios (speedups) and its two-sided 95% t-interval, whose lower bound
    stops at 0 (over few, scattered prompts the t-interval reaches below it, where no ratio
    lies); a single value has no interval (None bounds)."""
    mean = statistics.fmean(ratios)
    if len(ratios) < 2:
        return mean, None, None
    half = t_quantile_95(len(ratios) - 1) * statistics.stdev(ratios) / math.sqrt(len(ratios))
    return mean, max(mean - half, 0.0), mean + half


def t_quantile_95(freedom: int) -> float:
    """The two-sided 95% quantile of Student's t at ``freedom`` degrees of freedom: the table up
    to 30, then the Cornish-Fisher expansion about the normal quantile, within 1e-4 there (the
    normal 1.96 alone made intervals over 31-120 prompts 1-4% too narrow)."""
    if freedom <= len(_T95):
        return _T95[freedom - 1]
    z, v = statistics.NormalDist().inv_cdf(0.975), freedom
    return (z + (z ** 3 + z) / (4 * v) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * v ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * v ** 3))


def sweep_report(engine: Engine, batch_id: int) -> SweepReport:
    """The report of sweep ``batch_id`` (see the module docstring for what each number means)."""
    with session_scope(engine) as session:
        batch = session.get(Batch, batch_id)
        if batch is None:
            raise PolspecError(f"no sweep {batch_id} (polspec status lists batches and sweeps)")
        if batch.kind != "sweep":
            raise PolspecError(f"batch {batch_id} is a {batch.kind} batch, not a sweep: polspec results list "
                               f"--batch {batch_id} shows its items")
        cells = {cell.id: cell for cell in session.scalars(select(Cell).where(Cell.batch_id == batch_id))}
        # Columns, not objects: a sweep may have hundreds of thousands of results, and loading
        # them whole (texts, token ids, prompts, version records) took a minute and gigabytes.
        # Each row holds what a report reads of an item and of its result (a Measured).
        rows = session.execute(
            select(Item.cell_id, Item.prompt_key, Item.repeat, Item.worker_host, Item.worker_pid, Item.started_at,
                   Item.finished_at, seconds_before_decoding().label("waited_s"), Result.metrics,
                   Result.decode_tokens_per_s, Result.generated_tokens, Result.energy_joules, Result.energy_window_id)
            .join(Result, Result.item_id == Item.id).where(Item.batch_id == batch_id, Item.cell_id.is_not(None))).all()
        name, target, status, spec = batch.name, batch.spec["target"], batch.status, batch.spec
        counts = dict(session.execute(select(Item.status, func.count()).where(Item.batch_id == batch_id)
                                      .group_by(Item.status)).all())
        # By a subquery, not a list of ids: a batched sweep's windows may be more than SQLite
        # takes variables in one statement.
        in_sweep = select(Result.energy_window_id).join(Item, Result.item_id == Item.id).where(Item.batch_id == batch_id)
        windows = {window.id: Window(window.energy_joules, window.generated_tokens, window.sequences) for window in
                   session.scalars(select(EnergyWindow).where(EnergyWindow.id.in_(in_sweep)))}
    scalar = _sweep_params(spec)
    baseline: dict[Pair, float] = {}
    baseline_runs: dict[Pair, tuple] = {}
    speculative_runs: list[tuple[Pair, tuple]] = []
    groups: dict[CellKey, list[tuple[Pair, Measured]]] = defaultdict(list)
    spans: dict[tuple, list[tuple[Any, Any, int]]] = defaultdict(list)  # per cell: (start, end, tokens)
    ran: dict[tuple, set[Pair]] = defaultdict(set)  # per cell: the runs it has results for
    # Cells of older sweeps lack the keys they did not vary.
    configs = {cell.id: scalar | cell.config for cell in cells.values()}
    for row in rows:
        cell, config = cells[row.cell_id], configs[row.cell_id]
        run = (row.worker_host, row.worker_pid)
        batch_size, temperature = config["batch"], float(config["temperature"])
        pair = Pair(config["dataset"], config["seed"], batch_size, row.prompt_key, row.repeat, temperature)
        key = _cell_key(config, batch_size, temperature) if not cell.baseline else \
            (config["dataset"], None, batch_size, temperature)
        ran[key].add(pair)
        if row.started_at is not None and row.finished_at is not None:
            start = decoding_start(row.started_at, row.finished_at, row.waited_s)
            spans[key].append((start, row.finished_at, row.generated_tokens))
        if cell.baseline:
            baseline[pair], baseline_runs[pair] = row.decode_tokens_per_s, run
        else:
            speculative_runs.append((pair, run))
            groups[key].append((pair, row))
    aggregate = {key: _aggregate(members) for key, members in spans.items()}

    def baseline_aggregate(key: CellKey) -> float | None:
        """The baseline's aggregate where it ran what the cell ran: a whole run's throughput
        depends on the prompts (prefill, lengths), so over other prompts (a sweep part-way, a
        failed item) it is no baseline for the cell's."""
        base = (key.dataset, None, key.batch, key.temperature)
        return aggregate.get(base) if ran[base] == ran[key] else None

    probes = {draft: load_probe(target, draft, PREDICTION_FORMATS) for draft in {key.draft for key in groups}}
    report_rows = [cell_row(key, members, baseline, probes[key.draft], aggregate.get(key), baseline_aggregate(key),
                            windows)
                   for key, members in sorted(groups.items(), key=lambda group: row_order(group[0]))]
    missing = sorted(draft for draft, found in probes.items() if found is None)
    return SweepReport(batch_id, name, target, status, counts.get(Status.DONE, 0), sum(counts.values()),
                       report_rows, probes, missing,
                       sum(1 for pair, run in speculative_runs if baseline_runs.get(pair, run) != run))


def _sweep_params(spec: dict[str, Any]) -> dict[str, Any]:
    """What a cell's configuration means where it leaves a key out (sweeps from before batching,
    temperature grids or verification): the sweep's one value, else what ran then (a sweep from
    before ``verify`` sampled with exact match: every later one records it)."""
    params = spec.get("params", {})
    return {"batch": 1, "temperature": params.get("temperature", 0.0), "verify": params.get("verify", "exact")}


def _aggregate(spans: list[tuple[Any, Any, int]]) -> float | None:
    """Tokens per second of wall time during which any of these items was decoding."""
    busy = busy_seconds((start, end) for start, end, _ in sorted(spans, key=lambda span: span[0]))
    return sum(tokens for _, _, tokens in spans) / busy if busy > 0 else None


def _cell_key(config: dict[str, Any], batch_size: int, temperature: float) -> CellKey:
    """A speculative cell's row key. Greedy cells verify by exact match whatever their file's
    verify said; speculative sampling (tli, which auto means) proposes the draft's own tokens
    through the shared vocabulary, so its cells, which carry the file's first strategy, say tli."""
    verify = config["verify"] if temperature else "exact"
    strategy = config["strategy"] if verify == "exact" else "tli"
    return CellKey(config["dataset"], config["draft"], strategy, str(config["k"]), config["prefix"], batch_size,
                   temperature, verify)


def cell_row(key: CellKey, members: list[tuple[Pair, Measured]], baseline: dict[Pair, float], probe: Probe | None,
             aggregate: float | None = None, baseline_aggregate: float | None = None,
             windows: dict[int, Window] | None = None) -> Row:
    """The row of ``key`` from its results, each with its pair, the baseline tokens/s of each
    pair, the aggregate throughput of the cell and of its batch size's and temperature's
    baseline, and the energy windows its results decoded in."""
    metrics = [result.metrics for _, result in members]

    def total(name: str) -> float:
        return _total(metrics, name)

    # A result that decoded nothing past its first token (sampled EOS at once) has no speed, on
    # either side: as a 0 it made a speedup of 0 (a report then divided by it and failed).
    timed = [(pair, result) for pair, result in members if result.decode_tokens_per_s > 0]
    # Seeds and repeats of one prompt are not independent samples: average them per prompt first.
    ratios_per_prompt, base_speeds = defaultdict(list), []
    for pair, result in timed:
        paired = baseline.get(pair)
        if paired:
            ratios_per_prompt[pair.prompt_key].append(result.decode_tokens_per_s / paired)
            base_speeds.append(paired)
    ratios = [statistics.fmean(values) for values in ratios_per_prompt.values()]
    speedup, low, high = mean_interval(ratios) if ratios else (None, None, None)
    accepted = total("candidates_accepted")
    ratio = _candidates_per_draft_token(metrics)
    k_used = _k_used(key.k, metrics)
    # On the scale of acceptance_per_candidate, which the table sets beside it: the cost model's
    # a is the chance of each candidate, and with k > 1 a smaller share of them is accepted.
    even = break_even_acceptance(probe.at_batch(key.batch), k_used, ratio) if probe is not None and k_used else None
    even_share = accepted_share(even, candidates_for(k_used, ratio)) if even is not None else None
    return Row(
        **vars(key),
        prompts=len({pair.prompt_key for pair, _ in members}),
        paired_prompts=len(ratios),
        acceptance_per_candidate=accepted / total("candidates") if total("candidates") else None,
        acceptance_per_draft_token=total("draft_tokens_accepted") / total("draft_tokens") if total("draft_tokens") else None,
        tokens_per_round=total("generated_tokens") / total("rounds") if total("rounds") else None,
        tokens_per_s=statistics.median(result.decode_tokens_per_s for _, result in timed) if timed else None,
        baseline_tokens_per_s=statistics.median(base_speeds) if base_speeds else None,
        speedup=speedup, speedup_low=low, speedup_high=high, aggregate_tokens_per_s=aggregate,
        aggregate_speedup=aggregate / baseline_aggregate if aggregate and baseline_aggregate else None,
        joules_per_token=joules_per_token([result for _, result in members], windows),
        translation_overhead=total("translate_s") / total("verify_s") if total("verify_s") else None,
        predicted_speedup=predicted_speedup_of_cell(key.k, members, probe, key.batch),
        break_even_acceptance=even_share,
        never_pays=probe is not None and bool(k_used) and even is None,
    )


def _total(metrics: list[dict], name: str) -> float:
    return sum(m.get(name) or 0 for m in metrics)


def _candidates_per_draft_token(metrics: list[dict]) -> float:
    """Target candidates per draft token: what translation makes of k (1 with no draft tokens)."""
    drafted = _total(metrics, "draft_tokens")
    return _total(metrics, "candidates") / drafted if drafted else 1.0


def _k_used(k: str, metrics: list[dict]) -> int:
    """The cell's k; for a policy, the mean draft length of its speculative rounds (0: none)."""
    if k.isdigit():
        return int(k)
    speculative = _total(metrics, "rounds") - _total(metrics, "plain_rounds")
    return max(1, round(_total(metrics, "draft_tokens") / speculative)) if speculative else 0


def predicted_speedup_of_cell(k: str, members: list[tuple[Pair, Measured]], fallback: Probe | None,
                              batch: int = 1) -> float | None:
    """The cost model's speedup for a cell's results, decoded ``batch`` sequences at a time, each
    predicted with the probe its worker recorded (the machine that ran it) or else ``fallback``,
    at that batch size (:meth:`Probe.at_batch`): per probe, from the acceptance
    measured over that probe's results, then averaged weighted by the prompts each probe ran (a
    prompt split across machines counts once per machine). None when a result has no probe
    either way, or a probe's results speculated without a single verified candidate."""
    by_probe: dict[str, list[tuple[Pair, Measured]]] = defaultdict(list)
    for pair, result in members:
        # JSON text as the key: the recorded probe is a dict, and equal dicts are one machine.
        by_probe[json.dumps(result.metrics.get("probe"), sort_keys=True)].append((pair, result))
    weighted = []
    for recorded, group in by_probe.items():
        probe = _recorded_probe(json.loads(recorded)) or fallback
        metrics = [result.metrics for _, result in group]
        if not _total(metrics, "rounds"):
            continue  # nothing decoded (the prompt ended at once): nothing to predict
        accepted, rejections = _total(metrics, "candidates_accepted"), _total(metrics, "rejections")
        speculative = _total(metrics, "rounds") - _total(metrics, "plain_rounds")
        k_used = _k_used(k, metrics)
        if probe is None or (speculative and not accepted + rejections):
            return None
        # An auto cell whose probe said no k pays ran plain target steps only: speedup 1.
        a_hat = accepted / (accepted + rejections) if speculative else 0.0
        predicted = predicted_speedup_of_rounds(probe.at_batch(batch), a_hat, max(k_used, 1),
                                                _candidates_per_draft_token(metrics),
                                                speculative, _total(metrics, "plain_rounds"))
        weighted.append((predicted, len({pair.prompt_key for pair, _ in group})))
    if not weighted:
        return None
    return sum(value * prompts for value, prompts in weighted) / sum(prompts for _, prompts in weighted)


def _recorded_probe(data: dict | None) -> Probe | None:
    return Probe.from_dict(data) if data and data.get("format") in PREDICTION_FORMATS else None
