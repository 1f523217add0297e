"""The running acceptance estimates that the ``auto`` draft length feeds on: one pooled per pair
and translation for the life of the process, and one per sequence that starts from it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from polspec.decoding.params import DecodingParams

# A sequence's own estimate starts from the pooled one's mean with at most this many
# pseudo-counts: it starts near what the pair usually does, but its upper bound stays wide
# enough to try drafting, and a few rounds of its own text outweigh it (prose and tables
# accept at rates far apart, and a pool that prose taught would otherwise keep a table from
# ever drafting).
PRIOR_WEIGHT = 2.0

# In a plain round a sequence's own evidence ages: its weight beyond the pooled prior halves
# over this many plain rounds. Acceptance within one text is not stationary (an answer's first
# words may defeat the draft and its later lists not), and plain rounds bring no evidence of
# their own, so without ageing a few early rejections would keep a sequence plain for good.
PLAIN_HALF_LIFE = 16.0


@dataclass
class AcceptanceEstimate:
    """A running estimate of per-candidate acceptance: pooled for a pair and strategy, or one
    sequence's own.

    Each round adds its accepted candidates as successes and, if it stopped at a rejection,
    one failure: the maximum-likelihood estimate of a geometric acceptance process, which a
    plain accepted/proposed ratio underestimates. Starts from a weak prior of ``a = 0.5``.
    :meth:`upper_bound` is how high ``a`` may plausibly be given the evidence so far.
    """

    successes: float = 1.0
    failures: float = 1.0
    rounds: int = 0  # rounds observed, not counting the prior

    @property
    def a(self) -> float:
        return self.successes / (self.successes + self.failures)

    def upper_bound(self, z: float = 1.2816) -> float:
        """An optimistic acceptance: the Beta(successes, failures) posterior's mean plus ``z``
        standard deviations (about its 90% quantile), at most 1. It falls as evidence grows."""
        total = self.successes + self.failures
        spread = math.sqrt(self.successes * self.failures / (total * total * (total + 1)))
        return min(1.0, self.a + z * spread)

    def observe(self, accepted: int, candidates: int) -> None:
        self.successes += accepted
        self.failures += 1 if accepted < candidates else 0
        self.rounds += 1

    def age(self, toward: AcceptanceEstimate, rounds: float = 1.0) -> None:
        """Let ``rounds`` plain rounds pass: move the counts toward ``toward``'s (the pooled
        prior), halving the distance every :data:`PLAIN_HALF_LIFE` rounds."""
        keep = 0.5 ** (rounds / PLAIN_HALF_LIFE)
        self.successes = toward.successes + keep * (self.successes - toward.successes)
        self.failures = toward.failures + keep * (self.failures - toward.failures)

    def prior(self, weight: float = PRIOR_WEIGHT) -> AcceptanceEstimate:
        """A new estimate with this one's mean and at most ``weight`` pseudo-counts."""
        total = self.successes + self.failures
        scale = weight / total if total > weight else 1.0
        return AcceptanceEstimate(self.successes * scale, self.failures * scale)


# One pooled estimate per (target, draft, translation) for the life of the process, so that a
# worker's later generations start from what earlier ones saw.
_ESTIMATES: dict[tuple[str, str, str], AcceptanceEstimate] = {}


def acceptance_estimate(target: str, draft: str, params: DecodingParams) -> AcceptanceEstimate:
    """The pooled running estimate for a pair and the translation ``params`` choose: its strategy, and
    for ``aligned`` its partial-word rule too (``aligned/hold`` apart from ``aligned/verify``,
    whose candidates are accepted at different rates); speculative sampling (``tli``) apart
    from them all."""
    if params.verification == "tli":
        translation = "tli"
    else:
        translation = f"aligned/{params.partial_word}" if params.strategy == "aligned" else params.strategy
    return _ESTIMATES.setdefault((target, draft, translation), AcceptanceEstimate())


def forget_estimates() -> None:
    """Drop every pooled estimate, as a fresh process starts (for benchmarks and tests that
    measure a cold start)."""
    _ESTIMATES.clear()
