"""A sweep report as Markdown (one table per dataset), CSV (one row per cell) or JSON."""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import fields

from polspec.report.summary import Row, SweepReport


def _fmt(value, pattern: str = "{:.2f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return pattern.format(value)


def _break_even(row: Row) -> str:
    if row.break_even_acceptance is not None:
        return f"{row.break_even_acceptance:.0%}"
    return "never" if row.predicted_speedup is not None else "-"  # a prediction was made: no a pays


def markdown(report: SweepReport) -> str:
    lines = [f"# Sweep {report.batch_id}: {report.name}", "",
             f"Target `{report.target}`, status {report.status}. Speedup is speculative tokens/s over the "
             "target-only baseline on the same prompt, mean over prompts with its 95% interval; "
             "predicted speedup and break-even acceptance come from this machine's probe "
             "(`polspec models probe`); break-even \"never\" means no acceptance makes that k pay here. "
             "Rows with k auto report what the policy did (it may decode without the draft).", ""]
    if report.missing_probe:
        lines += [f"No probe on this machine for {', '.join(report.missing_probe)}: run "
                  f"`polspec models probe {report.target} DRAFT` for the predictions.", ""]
    for dataset in sorted({row.dataset for row in report.rows}):
        lines += [f"## {dataset}", "",
                  "| draft | strategy | k | prompts | accept/cand | accept/draft tok | tok/round | tok/s | "
                  "speedup (95% CI) | predicted | break-even | J/tok | translate/verify |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in (r for r in report.rows if r.dataset == dataset):
            interval = (f"{_fmt(row.speedup)}x ({_fmt(row.speedup_low)}-{_fmt(row.speedup_high)})"
                        if row.speedup is not None else "-")
            lines.append(
                f"| {row.draft} | {row.strategy} | {row.k} | {row.prompts} | {_fmt(row.acceptance_per_candidate, '{:.0%}')} | "
                f"{_fmt(row.acceptance_per_draft_token, '{:.0%}')} | {_fmt(row.tokens_per_round)} | "
                f"{_fmt(row.tokens_per_s, '{:.1f}')} | {interval} | {_fmt(row.predicted_speedup, '{:.2f}x')} | "
                f"{_break_even(row)} | {_fmt(row.joules_per_token, '{:.3f}')} | "
                f"{_fmt(row.translation_overhead, '{:.1%}')} |")
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
                       "status": report.status, "missing_probe": report.missing_probe,
                       "rows": [row.as_dict() for row in report.rows]}, ensure_ascii=False)
