"""Draft length per round: fixed k, the heuristic schedule, the draft's confidence, or auto."""

from __future__ import annotations

import math

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx

from polspec.decoding.acceptance import AcceptanceEstimate
from polspec.decoding.costmodel import (Probe, best_k, best_shared_k, pays_back, predicted_speedup,
                                        shared_speedup, smallest_paying_k)
from polspec.decoding.params import DecodingParams

# ``auto`` drafts past its k, up to k_max, while the draft gives its last token at least this
# probability. Chosen by replaying the policies on recorded acceptance (bench/replay_auto.py,
# BENCHMARKS.md): at 0.9 the long sure runs of structured text pay (pl-struct replayed 1.35x -> 1.50x)
# and prose keeps its speed; at 0.6-0.7 prose drafted long rejected runs and went plain.
EXTEND_ABOVE = 0.9


def candidates_that_count(remaining: int) -> int:
    """The most candidates a round can use with ``remaining`` tokens to go: it commits at most
    ``remaining``, the last of them the target's own choice after the accepted candidates, so a
    candidate past ``remaining - 1`` would be drafted and verified for nothing (with one token
    to go, a round is a plain step)."""
    return max(remaining - 1, 0)


class DraftLength:
    """Decides how many tokens the draft proposes next round.

    - a number: always that many;
    - ``heuristic``: +2 after a round whose candidates were all accepted, -1 otherwise,
      between 1 and ``k_max`` (Hugging Face's schedule);
    - ``confidence``: up to ``k_max`` tokens, stopping after a token whose draft
      probability is below ``confidence`` (costs one host sync per draft token);
    - ``auto``: the k in 0..``k_max`` with the highest speedup the cost model predicts from
      the machine's ``probe`` and the sequence's own running acceptance estimate, which
      starts from the pair's ``pooled`` one, adds to it what it sees and ages it back toward
      the pool in plain rounds; 0 means a plain target step (see
      :mod:`polspec.decoding.costmodel`). Past its k a round goes on drafting, up to
      ``k_max``, while the draft is sure of its last token (probability at least
      :data:`EXTEND_ABOVE`): the cost model prices the average round, and a run the draft is
      sure of accepts well above the average. In a batch of several sequences the batch
      decoder sets k for all its ``auto`` rows at once (:func:`shared_auto_k`), without the
      extension: one row's longer proposal would widen every row's verification.
    """

    def __init__(self, params: DecodingParams, probe: Probe | None = None,
                 pooled: AcceptanceEstimate | None = None):
        self.mode = params.k if isinstance(params.k, str) else "fixed"
        self.k_max = params.k_max
        self.threshold = EXTEND_ABOVE if self.mode == "auto" else params.confidence
        if self.mode == "auto":
            if probe is None or pooled is None:
                raise ValueError("the auto draft length needs a probe and the pair's pooled acceptance estimate")
            self.probe, self.pooled = probe, pooled
            self.estimate = pooled.prior()  # this sequence's own, which its rounds soon outweigh
            self.candidates, self.proposed = 4.0, 4.0  # prior: one candidate per draft token
            self.k = self._choose()
        else:
            self.k = params.k_max if self.mode == "confidence" else params.initial_k

    def unsure(self, logits: mx.array, index: mx.array) -> mx.array:
        """Whether the confidence policy stops drafting after the token at ``index`` of
        ``logits``, or ``auto`` stops extending its proposal there (its draft probability is
        below the threshold), lazily: a boolean array."""
        return mx.softmax(logits, axis=-1)[index] < self.threshold

    def observe(self, accepted: int, candidates: int, proposed: int) -> None:
        if self.mode == "heuristic":
            self.k = min(self.k + 2, self.k_max) if candidates and accepted == candidates else max(self.k - 1, 1)
        elif self.mode == "auto":
            if candidates:
                self.estimate.observe(accepted, candidates)
                self.pooled.observe(accepted, candidates)
            if proposed:
                self.candidates += candidates
                self.proposed += proposed
            else:
                self.estimate.age(self.pooled.prior())
            self.k = self._choose()

    def k_within(self, remaining: int, unfed: int) -> int:
        """This round's k for a sequence with ``remaining`` tokens to go whose draft has not
        yet been fed ``unfed`` tokens of its text beyond the round's first position (its prompt
        before the first proposal, a plain stretch after one): at most what those tokens can use
        (:func:`candidates_that_count`), and under
        ``auto`` 0 unless the speedup k could plausibly give (at the estimate's upper bound)
        pays back that feed within the tokens left
        (:func:`~polspec.decoding.costmodel.pays_back`).

        Plausibly, not on average: a plain round teaches the sequence nothing, and ages its
        estimate toward the pool's, so a sequence the pool says barely pays would otherwise
        stay plain to its end on the pool's word alone, its catch-up growing with every plain
        step (replayed on ``pl-instruct``: 5 of 8 prompts plain throughout)."""
        k = min(self.k, candidates_that_count(remaining))
        if self.mode != "auto" or k == 0:
            return k
        speedup = predicted_speedup(self.probe, self.estimate.upper_bound(), k, self.ratio)
        return k if pays_back(speedup, remaining, self.probe.draft_feed_steps(unfed, 1)) else 0

    def most_within(self, k: int, remaining: int) -> int:
        """The most tokens a round of ``k`` may draft with ``remaining`` tokens to go: under
        ``auto`` (k > 0) up to ``k_max`` while the draft stays sure (:meth:`unsure`), else k."""
        return max(k, min(self.k_max, candidates_that_count(remaining))) if self.mode == "auto" and k else k

    @property
    def ratio(self) -> float:
        """Target candidates per draft token so far."""
        return self.candidates / self.proposed

    def _choose(self) -> int:
        """The best k at the sequence's estimated acceptance; where that is 0, the smallest k
        that would pay at the estimate's upper bound (exploring: a rejected round is one
        failure whatever its k, so the cheapest round that can pay tests the draft).

        Each failed exploration lowers the bound, so a text that keeps rejecting soon decodes
        plain; its plain rounds age that evidence toward the pool's
        (:meth:`AcceptanceEstimate.age`), so it explores again after a plain stretch, later
        each time as failures pile up, and pays the draft's catch-up on the stretch then
        (:meth:`k_within` counts it). Where even an optimistic acceptance cannot pay it never
        explores (the demo pair on a CPU, where the draft step is most of a target step): the
        bound never rises above the pool's own."""
        k = best_k(self.probe, self.estimate.a, self.k_max, self.ratio)
        return k or smallest_paying_k(self.probe, self.estimate.upper_bound(), self.k_max, self.ratio)


def shared_auto_k(policies: list[DraftLength], probe: Probe, rows: int, remaining: float = math.inf,
                  warm_up: float = 0.0) -> int:
    """One k for the ``auto`` rows of a batch of ``rows`` sequences, ``probe`` seen at that
    size: the best for the batch at each row's estimated acceptance, the other rows counted
    as drafting nothing (see :func:`~polspec.decoding.costmodel.best_shared_k`), and 0
    unless it pays back ``warm_up`` within the ``remaining`` tokens a row has left, both in
    batched plain steps (:func:`~polspec.decoding.costmodel.pays_back`).

    ``warm_up`` is the draft's feed of the text it has not seen (the prompts of rows that
    have not drafted yet, the plain stretches of rows that have), which a batch pays once
    and a short generation or a slim speedup cannot earn back. A row that has seen no round
    counts at the pool's acceptance as it stands: in a fresh process the pair's weak prior
    (a = 0.5), so a batch of new rows drafts where that would pay with room for the warm-up.
    It does not explore past its estimates, as a row alone does
    (:meth:`DraftLength._choose`): in a batch one row's exploration costs every row a wider
    verification. Rows are costed at the largest ``k_max`` among them (one batch's rows
    usually share their parameters)."""
    k_max = max(policy.k_max for policy in policies)
    ratio = sum(policy.ratio for policy in policies) / len(policies)
    acceptances = [policy.estimate.a if policy.estimate.rounds else policy.pooled.a for policy in policies]
    acceptances += [0.0] * (rows - len(policies))
    k = best_shared_k(probe, acceptances, k_max, ratio)
    if k and not pays_back(shared_speedup(probe, acceptances, k, ratio), remaining, warm_up):
        return 0
    return k
