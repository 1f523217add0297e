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


def _headline(headline: Headline) -> str:
    parts = []
    if (best := headline.best) is not None:
        parts.append(f"fastest: {best.draft} {best.strategy} k={best.k} at {_speedup(best)}")
    if headline.auto_vs_best:
        lowest = min(headline.auto_vs_best, key=headline.auto_vs_best.get)
        ratios = headline.auto_vs_best.values()
        parts.append(f"auto at {min(ratios):.2f}-{max(ratios):.2f} of the best fixed k of its draft and strategy "
                     f"(lowest: {lowest})")
    if (worst := headline.worst_prediction) is not None:
        parts.append(f"predictions for k <= 3 within {headline.prediction_error:.0%} (largest miss: {worst.draft} "
                     f"{worst.strategy} k={worst.k}, {worst.predicted_speedup:.2f}x predicted, "
                     f"{worst.speedup:.2f}x measured)")
    return f"- **{headline.dataset}**: " + ("; ".join(parts) if parts else "no cell has a paired baseline yet") + "."


def markdown(report: SweepReport) -> str:
    lines = [f"# Sweep {report.batch_id}: {report.name}", "",
             f"Target `{report.target}`, status {report.status}, {report.done:,} of {report.total:,} generations "
             "done. Speedup is speculative tokens/s over the "
             "target-only baseline on the same prompt, mean over prompts with its 95% interval; "
             "predicted speedup comes from the probe (`polspec models probe`) of the machine that ran each "
             "result, or this machine's where a result recorded none; break-even acceptance is this "
             "machine's, and \"never\" means no acceptance makes that k pay here. "
             "Rows with k auto report what the policy did (it may decode without the draft).", ""]
    if report.missing_probe:
        lines += [f"No probe on this machine for {', '.join(report.missing_probe)}: run "
                  f"`polspec models probe {report.target} DRAFT` for the break-even acceptance and the "
                  "predictions of results that recorded no probe.", ""]
    if report.cross_run_pairs:
        lines += [f"{report.cross_run_pairs} speculative results are paired with a baseline that another worker "
                  "process ran (a restart, a resumed sweep, another machine): their speedups compare runs under "
                  "different conditions.", ""]
    if report.rows:
        lines += ["## Summary", "", *(_headline(headline) for headline in report.headlines), ""]
    if report.batched:
        lines += ["Batch B is how many of a cell's items decoded together; aggregate tok/s counts every token "
                  "of the cell over the wall time its items were decoding, and aggregate speedup divides it by "
                  "the target-only baseline's at the same B: the gain of a bulk run.", ""]
    batched = " B | agg tok/s | agg speedup |" if report.batched else ""
    for dataset in sorted({row.dataset for row in report.rows}):
        lines += [f"## {dataset}", "",
                  "| draft | strategy | k | prompts | accept/cand | accept/draft tok | tok/round | tok/s | "
                  "speedup (95% CI) | predicted | break-even | J/tok | translate/verify |" + batched,
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * batched.count("|")]
        for row in (r for r in report.rows if r.dataset == dataset):
            lines.append(
                f"| {row.draft} | {row.strategy} | {row.k} | {row.prompts} | {_fmt(row.acceptance_per_candidate, '{:.0%}')} | "
                f"{_fmt(row.acceptance_per_draft_token, '{:.0%}')} | {_fmt(row.tokens_per_round)} | "
                f"{_fmt(row.tokens_per_s, '{:.1f}')} | {_speedup(row)} | {_fmt(row.predicted_speedup, '{:.2f}x')} | "
                f"{_break_even(row)} | {_fmt(row.joules_per_token, '{:.3f}')} | "
                f"{_fmt(row.translation_overhead, '{:.1%}')} |"
                + (f" {row.batch} | {_fmt(row.aggregate_tokens_per_s, '{:.1f}')} | "
                   f"{_fmt(row.aggregate_speedup, '{:.2f}x')} |" if report.batched else ""))
        lines.append("")
    return "\n".join(lines)


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
