"""A sweep report as Markdown (one table per dataset), CSV (one row per cell) or JSON."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import fields

from polspec.report.summary import Headline, Row, SweepReport


def _fmt(value, pattern: str = "{:.2f}") -> str:
    if value is None:
        return "-"
    return pattern.format(value)


def _break_even(row: Row) -> str:
    if row.break_even_acceptance is not None:
        return f"{row.break_even_acceptance:.0%}"
    return "never" if row.never_pays else "-"


def _speedup(row: Row) -> str:
    """Mean speedup with its 95% interval where there is one (a single prompt has none)."""
    if row.speedup is None:
        return "-"
    if row.speedup_low is None:
        return f"{row.speedup:.2f}x"
    return f"{row.speedup:.2f}x ({row.speedup_low:.2f}-{row.speedup_high:.2f})"


def _prompts(row: Row) -> str:
    """The cell's prompts; where fewer have a finished baseline, the speedup's first (15/20)."""
    return f"{row.prompts}" if row.paired_prompts == row.prompts else f"{row.paired_prompts}/{row.prompts}"


def _cell(row: Row) -> str:
    """A row in words: draft, strategy, k, a prefix other than the default, temperature and
    verify when it samples, and a batch size above 1 (the headline ranks rows of every size)."""
    prefix = f" prefix={row.prefix}" if row.custom_prefix else ""
    sampling = f" T={row.temperature:g} verify={row.verify}" if row.temperature else ""
    batch = f" B={row.batch}" if row.batch != 1 else ""
    return f"{row.draft} {row.strategy} k={row.k}{prefix}{sampling}{batch}"


def _headline(headline: Headline) -> str:
    parts = []
    if (best := headline.best) is not None:
        parts.append(f"fastest: {_cell(best)} at {_speedup(best)}")
    if headline.auto_vs_best:
        lowest = min(headline.auto_vs_best, key=headline.auto_vs_best.get)
        ratios = headline.auto_vs_best.values()
        parts.append(f"auto at {min(ratios):.2f}-{max(ratios):.2f} of the best fixed k of its draft and strategy "
                     f"(lowest: {lowest})")
    if (worst := headline.worst_prediction) is not None:
        parts.append(f"predictions for k <= 3 within {headline.prediction_error:.0%} (largest miss: {_cell(worst)}, "
                     f"{worst.predicted_speedup:.2f}x predicted, {worst.speedup:.2f}x measured)")
    if parts and headline.left_out:
        parts.append(f"{headline.left_out} {'cell' if headline.left_out == 1 else 'cells'} measured on fewer than "
                     f"{headline.prompts} prompts left out of these comparisons")
    return f"- **{headline.dataset}**: " + ("; ".join(parts) if parts else "no cell has a paired baseline yet") + "."


def markdown(report: SweepReport) -> str:
    lines = [f"# Sweep {report.batch_id}: {report.name}", "",
             f"Target `{report.target}`, status {report.status}, {report.done:,} of {report.total:,} generations "
             "done. Speedup is speculative tokens/s over the "
             "target-only baseline on the same prompt, mean over prompts with its 95% interval (prompts "
             "15/20: 15 of the cell's 20 prompts have a finished baseline, and the speedup is theirs; a "
             "generation that ended at its first token has no speed and pairs with nothing); "
             "predicted speedup comes from the probe (`polspec models probe`) of the machine that ran each "
             "result, or this machine's where a result recorded none this polspec can use, at the cell's "
             "batch size (batch 1's costs where the probe has no batch table). Break-even "
             "acceptance is this machine's, as a share of candidates accepted (the accept/cand column's "
             "measure), at the candidates per draft token the cell measured. `polspec models probe` gives "
             "it as each candidate's chance of acceptance instead, which is higher for k > 1 (a later "
             "candidate counts only after the earlier ones were accepted), and at one candidate per "
             "draft token; \"never\" means no acceptance makes that k pay here with that many candidates. "
             "Rows with k auto report what the policy did (it may decode without the draft). "
             "J/tok is measured energy per generated token: items decoded alone are measured one by one, "
             "items decoded together as their whole batch, which counts only where the batch held the "
             "cell's items and nothing else; \"-\" where some item has neither (no meter, or a batch that "
             "also decoded other work or never ended).", ""]
    if report.missing_probe:
        lines += [f"No probe on this machine for {', '.join(report.missing_probe)}: run "
                  f"`polspec models probe {report.target} DRAFT` for the break-even acceptance and the "
                  "predictions of results that recorded no probe this polspec can use (none, or one of "
                  "an older format, measured before the draft's costs were taken as it decodes).", ""]
    if report.cross_run_pairs:
        lines += [f"{report.cross_run_pairs} speculative results are paired with a baseline that another worker "
                  "process ran (a restart, a resumed sweep, another machine): their speedups compare runs under "
                  "different conditions.", ""]
    if report.rows:
        lines += ["## Summary", "", *(_headline(headline) for headline in report.headlines), ""]
    if report.batched:
        lines += ["Batch B is how many of a cell's items decoded together; aggregate tok/s counts every token "
                  "of the cell over the wall time its items were decoding, prefills included (tok/s leaves "
                  "them out), and aggregate speedup divides it by "
                  "the target-only baseline's at the same B: the gain of a bulk run (\"-\" until both have "
                  "run the same prompts).", ""]
    lines += _sampling_note(report)
    # Prefix, temperature and verify get columns only where the rows differ in them (greedy rows
    # verify exact, so a sweep over temperatures 0 and above shows verify): the tables stay as
    # narrow as the sweep.
    sampling = [(heading, value) for heading, value, varied in (
        ("prefix", lambda row: f"{row.prefix}", len(report.prefixes) > 1),
        ("T", lambda row: f"{row.temperature:g}", len(report.temperatures) > 1),
        ("verify", lambda row: row.verify, len(report.verifies) > 1)) if varied]
    sampled = "".join(f" {heading} |" for heading, _ in sampling)
    batched = " B | agg tok/s | agg speedup |" if report.batched else ""
    for dataset in sorted({row.dataset for row in report.rows}):
        lines += [f"## {dataset}", "",
                  f"| draft | strategy | k |{sampled} prompts | accept/cand | accept/draft tok | tok/round | tok/s | "
                  "speedup (95% CI) | predicted | break-even | J/tok | translate/verify |" + batched,
                  "|---" * (13 + len(sampling) + batched.count("|")) + "|"]
        for row in (r for r in report.rows if r.dataset == dataset):
            values = "".join(f" {value(row)} |" for _, value in sampling)
            lines.append(
                f"| {row.draft} | {row.strategy} | {row.k} |{values} {_prompts(row)} | "
                f"{_fmt(row.acceptance_per_candidate, '{:.0%}')} | "
                f"{_fmt(row.acceptance_per_draft_token, '{:.0%}')} | {_fmt(row.tokens_per_round)} | "
                f"{_fmt(row.tokens_per_s, '{:.1f}')} | {_speedup(row)} | {_fmt(row.predicted_speedup, '{:.2f}x')} | "
                f"{_break_even(row)} | {_fmt(row.joules_per_token, '{:.3f}')} | "
                f"{_fmt(row.translation_overhead, '{:.1%}')} |"
                + (f" {row.batch} | {_fmt(row.aggregate_tokens_per_s, '{:.1f}')} | "
                   f"{_fmt(row.aggregate_speedup, '{:.2f}x')} |" if report.batched else ""))
        lines.append("")
    return "\n".join(lines)


def _sampling_note(report: SweepReport) -> list[str]:
    """How the sampled rows verify, where any row samples (temperature > 0); none for a greedy sweep."""
    sampled = [temperature for temperature in report.temperatures if temperature]
    if not sampled:
        return []
    where = f"at temperature {sampled[0]:g}" if len(sampled) == 1 else "at temperatures above 0"
    verifies = {row.verify for row in report.rows if row.temperature}
    how = f"verify {verifies.pop()}" if len(verifies) == 1 else "the verify of their row"
    return [f"Rows {where} sample with {how} (auto is tli: speculative sampling over the shared vocabulary; "
            "exact keeps a candidate only where the target samples the same token), so acceptance per draft "
            "token is the number verification changes; greedy rows always verify by exact match.", ""]


def csv_text(report: SweepReport) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=[field.name for field in fields(Row)])
    writer.writeheader()
    for row in report.rows:
        writer.writerow(row.as_dict())
    return buffer.getvalue()


def json_text(report: SweepReport) -> str:
    return json.dumps({"sweep": report.batch_id, "name": report.name, "target": report.target,
                       "status": report.status, "done": report.done, "total": report.total,
                       "missing_probe": report.missing_probe, "cross_run_pairs": report.cross_run_pairs,
                       "headlines": [headline.as_dict() for headline in report.headlines],
                       "rows": [row.as_dict() for row in report.rows]}, ensure_ascii=False)
