"""The hardware cost model: what one round costs on this machine, and which k pays.

Per round, a draft of ``k`` tokens costs ``k c`` target steps (``c`` = draft step / target step),
verifying ``k'`` translated candidates costs ``rho(k' + 1)`` target steps (``rho(m)`` = time of
a target forward over ``m`` tokens / over one; above 1 on bandwidth-bound hardware) and the
translation ``tau`` target steps. With per-candidate acceptance ``a`` a round commits

    E[N] = (1 - a^(k'+1)) / (1 - a)

target tokens, so the speedup over target-only decoding is

    S(a, k) = E[N] / (k c + d + rho(k'+1) + tau)

and speculation pays when ``S > 1``. ``d`` is the draft's work per round beyond its k steps:
its first forward also feeds the text committed last round, and every proposal is a host
sync. ``k'`` follows from ``k`` through the pair's ratio of target candidates to draft tokens
(1 for a same-tokenizer pair). The ``auto`` draft length (:mod:`polspec.decoding.policy`)
picks the k with the highest predicted S each round, and plain decoding when none exceeds 1.

This module is the :class:`Probe` data and arithmetic on it, free of models and files:
:func:`~polspec.decoding.measure.measure_probe` measures a probe on loaded models, and
:mod:`polspec.decoding.probe_files` stores probes per machine and model pair under
``$POLSPEC_HOME/probes``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

RHO_SIZES = 9  # rho(m) is measured for m = 1..9 and extrapolated linearly beyond
# 2: the draft step measured as it decodes (last-position logits, its default draft vocabulary)
# 3: the draft's feed of text measured (before: priced at a draft step a token, 16x what a feed
#    costs on a 2-core CPU, or at the batch table's widest draft step per sequence, 1.7x)
# 4: the batch table runs to B = 64 and records the largest size it tried (an earlier polspec
#    skips such a probe as unknown instead of failing on the new key)
PROBE_FORMAT = 4
# Formats decoding reads: 3 lacks only largest_batch_tried (read as 0: its table stops at 16).
STORED_FORMATS = (3, PROBE_FORMAT)
# Formats a prediction from recorded rounds can read: 2 lacks only the draft's feed, which it leaves out.
PREDICTION_FORMATS = (2, *STORED_FORMATS)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)  # sequences per forward in the probe's batch table
BATCH_POSITIONS = (1, 2, 3, 5, 9)  # positions per sequence measured at each batch size

# A larger batch is worth it for bulk work while it raises plain throughput by this much.
BATCH_GAIN = 1.10
# The batch size for bulk work where no probe says (target-only work has none). On a 2-core CPU
# a plain step over 32 sequences gives 1.4x the tokens/s of one over 16 for both a 270M and a
# 1.5B target, and 64 gives 1.6-1.7x (BENCHMARKS.md), but 64's step on a 1.5B target (1.8 s)
# would leave a long item little of its job timeout's 2 s a token: a blind choice stays at 32
# (and the worker times a step at it first, see polspec.worker.batching.STEP_SHARE_OF_TIMEOUT).
UNPROBED_BATCH_SIZE = 32


@dataclass(frozen=True)
class BatchCost:
    """Forward times over ``size`` sequences at once, in seconds, with a context cached."""

    size: int
    target_s: tuple[float, ...]  # the target over m positions per sequence, m in BATCH_POSITIONS
    draft_s: float  # the draft over one position per sequence


@dataclass(frozen=True)
class Probe:
    """Measured costs of one target/draft pair on one machine, in target steps."""

    target: str
    draft: str
    c: float
    rho: tuple[float, ...]  # rho[m - 1] for m = 1..RHO_SIZES; rho[0] == 1
    tau: float
    draft_overhead: float = 0.0  # d: draft work per round beyond k c, in target steps
    target_step_s: float = 0.0
    draft_step_s: float = 0.0
    machine: dict[str, str] = field(default_factory=dict)
    batch: tuple[BatchCost, ...] = ()  # the batch table; empty in probes measured before it existed
    draft_vocab: int | None = None  # the draft's pruned vocabulary when measured; None: its full one
    draft_feed_s: float = 0.0  # seconds a token of text the draft reads in one forward (its prompt)
    # The largest batch size the batch table was asked for (sizes memory could not hold are left
    # out of it); 0 in probes of format 3.
    largest_batch_tried: int = 0

    def at_batch(self, size: int) -> Probe:
        """The costs of a round over ``size`` sequences, in steps of a plain batched step of that size.

        The batch table is interpolated linearly between measured sizes (extrapolated beyond the
        largest). Translation runs once per sequence, so tau grows with ``size``; the draft's
        per-round work ``d`` is taken as the same time at every size. Without a batch table
        (or at size 1) the probe itself.
        """
        if size < 1:
            raise ValueError(f"a batch holds at least one sequence, got {size}")
        if size == 1 or not self.batch:
            return self
        target = [_interpolate([(b.size, b.target_s[i]) for b in self.batch], size) for i in range(len(BATCH_POSITIONS))]
        step = target[0]
        rho = tuple(_interpolate(list(zip(BATCH_POSITIONS, target)), m) / step for m in range(1, RHO_SIZES + 1))
        draft = _interpolate([(b.size, b.draft_s) for b in self.batch], size)
        seconds = self.target_step_s
        return Probe(self.target, self.draft, c=draft / step, rho=rho, tau=self.tau * seconds * size / step,
                     draft_overhead=self.draft_overhead * seconds / step, target_step_s=step, draft_step_s=draft,
                     machine=self.machine, draft_vocab=self.draft_vocab, draft_feed_s=self.draft_feed_s)

    def draft_feed_steps(self, tokens: int, size: int) -> float:
        """Estimated cost of the draft taking in ``tokens`` tokens of text, as a row's first
        proposal feeds it the row's prompt, in plain steps of a batch of ``size``: the feed
        time per token the probe measured for one prompt fed alone, at every batch size (rows
        that first propose together are fed in groups, 1.2-2.4x cheaper a token, so this is an
        upper bound there; a plain stretch rides along the batch's first draft step, where this
        is a rough price). For a probe as measured, not one :meth:`at_batch` made; 0 for one
        made without it."""
        if not self.draft_feed_s:
            return 0.0
        return tokens * self.draft_feed_s / self.at_batch(size).target_step_s

    def rho_at(self, m: int) -> float:
        """rho(m), extrapolated linearly from the last two measured sizes beyond them."""
        if m < 1:
            raise ValueError(f"rho is defined for m >= 1, got {m}")
        if m <= len(self.rho):
            return self.rho[m - 1]
        slope = self.rho[-1] - self.rho[-2] if len(self.rho) > 1 else 0.0
        return self.rho[-1] + slope * (m - len(self.rho))

    def as_dict(self) -> dict:
        return asdict(self) | {"rho": list(self.rho), "format": PROBE_FORMAT,
                               "batch": [asdict(b) | {"target_s": list(b.target_s)} for b in self.batch]}

    @classmethod
    def from_dict(cls, data: dict) -> Probe:
        """The probe ``as_dict`` wrote; ValueError when a cost is missing, not a number or negative."""
        fields = {key: value for key, value in data.items() if key != "format"}
        batch = tuple(BatchCost(b["size"], tuple(b["target_s"]), b["draft_s"]) for b in data.get("batch", ()))
        probe = cls(**fields | {"rho": tuple(data["rho"]), "batch": batch})
        if any(len(b.target_s) != len(BATCH_POSITIONS) or not isinstance(b.size, int) or b.size < 1
               or not all(_is_cost(value) and value > 0 for value in (*b.target_s, b.draft_s)) for b in batch):
            raise ValueError(f"a probe's batch table needs a size and {len(BATCH_POSITIONS)} target times and a draft time > 0")
        costs = (probe.c, probe.tau, probe.draft_overhead, probe.draft_feed_s, *probe.rho)
        if not probe.rho or not all(_is_cost(value) for value in costs):
            raise ValueError("a probe needs c, tau, draft_overhead, draft_feed_s and rho values, all numbers >= 0")
        if probe.draft_feed_s and not (_is_cost(probe.target_step_s) and probe.target_step_s > 0):
            raise ValueError("a probe with the draft's feed needs the target step it is counted in")
        if not isinstance(probe.largest_batch_tried, int) or probe.largest_batch_tried < 0:
            raise ValueError("a probe's largest_batch_tried is a whole number >= 0")
        return probe


def _interpolate(points: list[tuple[int, float]], x: int) -> float:
    """y at ``x`` on the polyline through ``points`` (sorted by x), extended linearly past both ends."""
    points = sorted(points)
    if len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1 or (x1, y1) == points[-1]:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise AssertionError("unreachable")


def _is_cost(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def expected_tokens(a: float, candidates: int) -> float:
    """E[N]: target tokens one round commits with ``candidates`` candidates of acceptance ``a``."""
    if not 0 <= a <= 1:
        raise ValueError(f"acceptance must be in [0, 1], got {a}")
    if a == 1:
        return candidates + 1.0
    return (1 - a ** (candidates + 1)) / (1 - a)


def candidates_for(k: int, ratio: float) -> int:
    """k': target candidates that ``k`` draft tokens become, at ``ratio`` candidates per draft token."""
    return 0 if k == 0 else max(1, round(k * ratio))


def round_cost(probe: Probe, k: int, ratio: float = 1.0) -> float:
    """Cost of one round with ``k`` draft tokens, in target steps (k = 0: plain decoding, 1)."""
    if k == 0:
        return 1.0
    return k * probe.c + probe.draft_overhead + probe.rho_at(candidates_for(k, ratio) + 1) + probe.tau


def predicted_speedup(probe: Probe, a: float, k: int, ratio: float = 1.0) -> float:
    """S(a, k) over target-only decoding; k = 0 is target-only decoding itself (S = 1)."""
    if k == 0:
        return 1.0
    return expected_tokens(a, candidates_for(k, ratio)) / round_cost(probe, k, ratio)


def predicted_speedup_of_rounds(probe: Probe, a: float, k: int, ratio: float, speculative: int, plain: int) -> float:
    """S over a generation of ``speculative`` rounds with ``k`` draft tokens and ``plain``
    target-only steps (``auto`` at k = 0): its expected tokens over its cost, in target steps."""
    tokens = plain + speculative * expected_tokens(a, candidates_for(k, ratio))
    return tokens / (plain + speculative * round_cost(probe, k, ratio))


def accepted_share(a: float, candidates: int) -> float:
    """The share of a round's ``candidates`` accepted on average at acceptance ``a`` (each
    accepted with probability ``a`` up to the first rejection): what a report's acceptance per
    candidate counts. Below ``a`` for more than one candidate: the later ones are verified
    only after the earlier ones were accepted."""
    return (expected_tokens(a, candidates) - 1) / candidates


def break_even_acceptance(probe: Probe, k: int, ratio: float = 1.0) -> float | None:
    """The acceptance at which ``k`` starts to pay (S = 1); None if even a = 1 does not pay."""
    if predicted_speedup(probe, 1.0, k, ratio) <= 1.0:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if predicted_speedup(probe, middle, k, ratio) > 1.0:
            high = middle
        else:
            low = middle
    return high


def best_k(probe: Probe, a: float, k_max: int, ratio: float = 1.0) -> int:
    """The k in 0..k_max with the highest predicted speedup; 0 (plain decoding) when none pays."""
    return best_shared_k(probe, [a], k_max, ratio)


def best_shared_k(probe: Probe, acceptances: list[float], k_max: int, ratio: float = 1.0) -> int:
    """The one k for rows verified together (``probe`` seen at their batch size), each at its
    own acceptance (0 for a row that does not draft): a batched round costs the whole batch
    whichever rows draft, so it pays only if the tokens of all rows do. 0 when none pays."""
    if not acceptances:
        raise ValueError("a shared k needs the acceptance of at least one row")
    return max(range(k_max + 1), key=lambda k: (shared_speedup(probe, acceptances, k, ratio), -k))


def shared_speedup(probe: Probe, acceptances: list[float], k: int, ratio: float = 1.0) -> float:
    """S of rows verified together with ``k`` draft tokens each, at their own acceptances:
    the mean of their speedups, as every row pays the same round."""
    return statistics.fmean(predicted_speedup(probe, a, k, ratio) for a in acceptances)


def pays_back(speedup: float, tokens: float, warm_up: float) -> bool:
    """Whether decoding ``tokens`` more tokens at ``speedup`` over plain decoding saves more
    than a one-off ``warm_up`` costs, both in plain steps: ``tokens (1 - 1/S) > warm_up``."""
    return tokens * (1 - 1 / speedup) > warm_up


def smallest_paying_k(probe: Probe, a: float, k_max: int, ratio: float = 1.0) -> int:
    """The smallest k in 1..k_max that beats plain decoding at acceptance ``a``; 0 when none does."""
    return next((k for k in range(1, k_max + 1) if predicted_speedup(probe, a, k, ratio) > 1.0), 0)


def can_pay(probe: Probe, k_max: int, ratio: float = 1.0) -> bool:
    """Whether any k up to ``k_max`` beats plain decoding even with a perfect draft."""
    return smallest_paying_k(probe, 1.0, k_max, ratio) > 0


def throughput_batch_size(probe: Probe | None, max_step_s: float | None = None) -> int:
    """The largest measured batch size whose plain throughput beats the next smaller one's by
    ``BATCH_GAIN``, from the probe's batch table, and whose plain step takes at most
    ``max_step_s`` where given (the smallest size if none does); without a table,
    ``UNPROBED_BATCH_SIZE``."""
    if probe is None or not probe.batch:
        return UNPROBED_BATCH_SIZE
    costs = sorted(probe.batch, key=lambda cost: cost.size)
    best = costs[0].size
    for smaller, larger in zip(costs, costs[1:]):
        if larger.size / larger.target_s[0] < BATCH_GAIN * smaller.size / smaller.target_s[0]:
            break
        if max_step_s is not None and larger.target_s[0] > max_step_s:
            break
        best = larger.size
    return best
