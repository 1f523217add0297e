"""Draft length per round: fixed k, the heuristic schedule, or the draft's confidence."""

from __future__ import annotations

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx

from polspec.decoding.params import DecodingParams


class DraftLength:
    """Decides how many tokens the draft proposes next round.

    - a number: always that many;
    - ``heuristic``: +2 after a round whose candidates were all accepted, -1 otherwise,
      between 1 and ``k_max`` (Hugging Face's schedule);
    - ``confidence``: up to ``k_max`` tokens, stopping after a token whose draft
      probability is below ``confidence`` (costs one host sync per draft token).
    """

    def __init__(self, params: DecodingParams):
        self.mode = params.k if isinstance(params.k, str) else "fixed"
        self.k = params.k_max if self.mode == "confidence" else params.initial_k
        self.k_max = params.k_max
        self.threshold = params.confidence

    def stop_after(self, step: int, logits: mx.array, token: mx.array) -> bool:
        """Whether to stop drafting after this token (only the confidence policy stops early)."""
        if self.mode != "confidence":
            return False
        probability = mx.softmax(logits, axis=-1)[token]
        return probability.item() < self.threshold

    def observe(self, accepted: int, candidates: int) -> None:
        if self.mode == "heuristic":
            self.k = min(self.k + 2, self.k_max) if candidates and accepted == candidates else max(self.k - 1, 1)
