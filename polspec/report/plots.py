"""PNG plots of a sweep: speedup against k per dataset, acceptance by strategy and draft, the
cost model's predicted speedup against the measured one, and for a sweep over batch sizes the
aggregate speedup against the batch size per draft. Cells at a prefix other than the default,
and sampled cells per temperature and verification, are drawn apart (Row.variant)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a worker or in CI

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from polspec.files import write_file_atomically  # noqa: E402
from polspec.report.summary import SweepReport  # noqa: E402


def write_plots(report: SweepReport, directory: Path) -> list[Path]:
    """Write the plots into ``directory`` (created) and return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    plots = [_speedup_by_k(report, directory), _acceptance(report, directory), _predicted(report, directory)]
    if report.batched:
        plots.append(_speedup_by_batch(report, directory))
    return plots


def _speedup_by_k(report: SweepReport, directory: Path) -> Path:
    datasets = sorted({row.dataset for row in report.rows})
    figure, axes = plt.subplots(1, max(len(datasets), 1), figsize=(5 * max(len(datasets), 1), 4), squeeze=False)
    for axis, dataset in zip(axes[0], datasets, strict=False):
        lines = defaultdict(list)
        for row in report.rows:
            if row.dataset == dataset and row.k.isdigit() and row.speedup is not None:
                low, high = (math.nan, math.nan) if row.speedup_low is None else (row.speedup_low, row.speedup_high)
                lines[(row.draft, row.strategy, row.variant, row.batch)].append((int(row.k), row.speedup, low, high))
        for (draft, strategy, variant, batch), points in sorted(lines.items()):
            points.sort()
            ks = [p[0] for p in points]
            label = f"{draft} / {strategy}{variant}" + (f" / B={batch}" if report.batched else "")
            axis.plot(ks, [p[1] for p in points], marker="o", label=label)
            axis.fill_between(ks, [p[2] for p in points], [p[3] for p in points], alpha=0.15)
        for row in report.rows:
            if row.dataset == dataset and row.k == "auto" and row.speedup is not None:
                axis.axhline(row.speedup, linestyle=":", linewidth=1, color="grey")
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set(title=dataset, xlabel="k (draft tokens per round)", ylabel="speedup over target-only")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        _legend(axis)
    figure.suptitle(f"{report.target}: speedup by k (dotted: auto)")
    figure.tight_layout()
    return _save(figure, directory / "speedup-by-k.png")


def _speedup_by_batch(report: SweepReport, directory: Path) -> Path:
    datasets = sorted({row.dataset for row in report.rows})
    figure, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4), squeeze=False)
    for axis, dataset in zip(axes[0], datasets, strict=True):
        lines = defaultdict(list)
        for row in report.rows:
            if row.dataset == dataset and row.aggregate_speedup is not None:
                lines[(row.draft, row.strategy, row.k, row.variant)].append((row.batch, row.aggregate_speedup))
        for (draft, strategy, k, variant), points in lines.items():  # the rows' order: k by number
            points.sort()
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                      label=f"{draft} / {strategy} / k={k}{variant}")
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set(title=dataset, xlabel="batch size (items decoded together)",
                 ylabel="aggregate speedup over target-only at that batch size")
        axis.set_xticks(sorted({row.batch for row in report.rows}))
        _legend(axis)
    figure.suptitle(f"{report.target}: what speculation adds to batching")
    figure.tight_layout()
    return _save(figure, directory / "speedup-by-batch.png")


def _acceptance(report: SweepReport, directory: Path) -> Path:
    groups = defaultdict(list)
    for row in report.rows:
        if row.acceptance_per_candidate is not None:
            groups[(row.draft, row.strategy, row.variant)].append(row.acceptance_per_candidate)
    labels = [f"{draft}\n{strategy}{variant}" for draft, strategy, variant in sorted(groups)]
    values = [sum(groups[key]) / len(groups[key]) for key in sorted(groups)]
    figure, axis = plt.subplots(figsize=(max(4, 1.2 * len(labels)), 4))
    axis.bar(range(len(values)), values, color="tab:blue")
    axis.set_xticks(range(len(values)), labels, fontsize=7)
    axis.set(ylabel="acceptance per candidate (mean over cells)", ylim=(0, 1),
             title=f"{report.target}: acceptance by draft and strategy")
    figure.tight_layout()
    return _save(figure, directory / "acceptance.png")


def _predicted(report: SweepReport, directory: Path) -> Path:
    pairs = [(row.predicted_speedup, row.speedup, row.k) for row in report.rows
             if row.predicted_speedup is not None and row.speedup is not None]
    figure, axis = plt.subplots(figsize=(4.5, 4.5))
    if pairs:
        axis.scatter([p[0] for p in pairs], [p[1] for p in pairs], c="tab:orange")
        top = max(max(p[0] for p in pairs), max(p[1] for p in pairs)) * 1.1
        axis.plot([0, top], [0, top], color="grey", linewidth=0.8)
    else:
        axis.text(0.5, 0.5, "no predictions: run polspec models probe", ha="center", transform=axis.transAxes)
    axis.set(xlabel="predicted speedup (cost model)", ylabel="measured speedup", title="predicted vs measured")
    figure.tight_layout()
    return _save(figure, directory / "predicted-vs-measured.png")


def _save(figure, path: Path) -> Path:
    """Write ``figure`` whole or not at all: a failure part-way (a full disk, Ctrl+C) must not
    leave a broken PNG where the last report's plot was."""
    try:
        write_file_atomically(path, lambda handle: figure.savefig(handle, dpi=120, format="png"), binary=True)
    finally:
        plt.close(figure)
    return path


def _legend(axis) -> None:
    """A legend where the axis has labelled lines (a sweep with only ``auto`` rows has none, and
    matplotlib would warn on the user's terminal)."""
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=7)
