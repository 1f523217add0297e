"""What a decoder yields: the tokens committed in one round."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoundState:
    """The speculative decoder's caches after a round, for checks and debugging."""

    target_cached: int  # entries in the target's KV cache
    draft_cached: int  # entries in the draft's KV cache
    draft_fed: int  # draft tokens the decoder believes are cached
    draft_generated: list[int]  # the draft's tokens for the committed text
    draft_lag: bytes  # committed bytes the draft has not seen yet (an incomplete character)


@dataclass(frozen=True)
class Commit:
    """Tokens committed in one round; the first ``drafted`` of them were proposed by the draft."""

    tokens: list[int]
    drafted: int = 0
    state: RoundState | None = None
