"""A sweep's numbers, one row per dataset, draft, strategy, k and prefix.

Every row is computed from the stored results alone (plus this machine's probe for the
prediction), so a report can be regenerated at any time:

- acceptance per candidate (accepted / verified) and per draft token, committed tokens per round;
- tokens/s (median over prompts) and the speedup against the *paired* baseline: for every prompt
  (and seed and repeat) the speculative tokens/s over the baseline's tokens/s on the same
  prompt, averaged over prompts with a 95% t-interval;
- energy per token where every item of the cell was measured;
- translation time as a fraction of verification time;
- the cost model's predicted speedup from the acceptance measured in the cell (the
  geometric-acceptance estimate: accepted / (accepted + rejecting rounds)), and the
  break-even acceptance for the cell's k.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Engine, select

from polspec.decoding.costmodel import Probe, break_even_acceptance, load_probe, predicted_speedup
from polspec.errors import PolspecError
from polspec.store.engine import session_scope
from polspec.store.schema import Batch, Cell, Item, Result

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom; the normal 1.96 beyond.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


@dataclass
class Row:
    dataset: str
    draft: str
    strategy: str
    k: str
    prefix: int
    prompts: int
    acceptance_per_candidate: float | None
    acceptance_per_draft_token: float | None
    tokens_per_round: float | None
    tokens_per_s: float | None
    baseline_tokens_per_s: float | None
    speedup: float | None
    speedup_low: float | None
    speedup_high: float | None
    joules_per_token: float | None
    translation_overhead: float | None
    predicted_speedup: float | None
    break_even_acceptance: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SweepReport:
    batch_id: int
    name: str
    target: str
    status: str
    rows: list[Row]
    probes: dict[str, Probe | None]
    missing_probe: list[str]


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and two-sided 95% t-interval; a single value has no interval (NaN bounds)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    quantile = _T95[len(values) - 2] if len(values) - 1 <= len(_T95) else 1.96
    half = quantile * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def sweep_report(engine: Engine, batch_id: int) -> SweepReport:
    """The report of sweep ``batch_id`` (see the module docstring for what each number means)."""
    with session_scope(engine) as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.kind != "sweep":
            raise PolspecError(f"no sweep {batch_id} (polspec status lists batches and sweeps)")
        rows = session.execute(select(Cell, Item, Result).join(Item, Item.cell_id == Cell.id)
                               .join(Result, Result.item_id == Item.id).where(Cell.batch_id == batch_id)).all()
        name, target, status = batch.name, batch.spec["target"], batch.status
    baseline: dict[tuple, float] = {}
    groups: dict[tuple, list[tuple[tuple, Result]]] = defaultdict(list)
    for cell, item, result in rows:
        config = cell.config
        # The item key is "<cell key>/<prompt id>/r<repeat>": pairs share dataset, seed and the rest.
        pair = (config["dataset"], config["seed"], item.item_key[len(cell.key) + 1:])
        if cell.baseline:
            baseline[pair] = result.decode_tokens_per_s
        else:
            key = (config["dataset"], config["draft"], config["strategy"], str(config["k"]), config["prefix"])
            groups[key].append((pair, result))
    probes = {draft: load_probe(target, draft) for draft in {key[1] for key in groups}}
    report_rows = [_row(key, members, baseline, probes[key[1]]) for key, members in sorted(groups.items())]
    missing = sorted(draft for draft, found in probes.items() if found is None)
    return SweepReport(batch_id, name, target, status, report_rows, probes, missing)


def _row(key: tuple, members: list[tuple[tuple, Result]], baseline: dict[tuple, float], probe: Probe | None) -> Row:
    dataset, draft, strategy, k, prefix = key
    metrics = [result.metrics for _, result in members]

    def total(name: str) -> float:
        return sum(m.get(name) or 0 for m in metrics)

    ratios, base_speeds = [], []
    for pair, result in members:
        paired = baseline.get(pair)
        if paired:
            ratios.append(result.decode_tokens_per_s / paired)
            base_speeds.append(paired)
    speedup, low, high = mean_interval(ratios) if ratios else (None, None, None)
    energies = [result.energy_joules for _, result in members]
    joules = (sum(energies) / total("generated_tokens")
              if energies and all(e is not None for e in energies) and total("generated_tokens") else None)
    accepted, rejections = total("candidates_accepted"), total("rejections")
    a_hat = accepted / (accepted + rejections) if accepted + rejections else None
    speculative_rounds = total("rounds") - total("plain_rounds")
    k_used = int(k) if k.isdigit() else max(1, round(total("draft_tokens") / speculative_rounds)) if speculative_rounds else 0
    ratio = total("candidates") / total("draft_tokens") if total("draft_tokens") else 1.0
    predicted = even = None
    if probe is not None and a_hat is not None and k_used:
        predicted = predicted_speedup(probe, a_hat, k_used, ratio)
        even = break_even_acceptance(probe, k_used, ratio)
    return Row(
        dataset, draft, strategy, k, prefix, len(members),
        accepted / total("candidates") if total("candidates") else None,
        total("draft_tokens_accepted") / total("draft_tokens") if total("draft_tokens") else None,
        total("generated_tokens") / total("rounds") if total("rounds") else None,
        statistics.median(result.decode_tokens_per_s for _, result in members),
        statistics.median(base_speeds) if base_speeds else None,
        speedup, low, high, joules,
        total("translate_s") / total("verify_s") if total("verify_s") else None,
        predicted, even,
    )
