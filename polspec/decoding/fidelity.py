"""Oracle fidelity: how much of a perfect draft's work survives translation.

A perfect draft proposes exactly the true continuation of a text, ``k`` draft tokens at a
time, and a perfect target accepts exactly its own tokenization of that text. What is lost
in between is lost to translation alone, separated from any disagreement between models.
The rounds run as in the decoder: translate, accept the longest matching prefix plus one
target token, re-sync the draft's tokens to the committed text.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerFast

from polspec.decoding.translate import (
    RESYNC_WINDOW, TokenBytes, complete_utf8, encode_after, extend_tokens, follow_text, token_bytes,
    translate_draft_to_target, window_start,
)

PROMPT_TOKENS = 4


@dataclass(frozen=True)
class Fidelity:
    rounds: int
    candidates: int
    accepted: int
    committed: int

    @property
    def acceptance(self) -> float:
        """Fraction of target candidates the perfect target accepted."""
        return self.accepted / self.candidates if self.candidates else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.committed / self.rounds if self.rounds else 0.0

    def __add__(self, other: "Fidelity") -> "Fidelity":
        return Fidelity(*(getattr(self, f) + getattr(other, f) for f in ("rounds", "candidates", "accepted", "committed")))


def _perfect_proposal(draft: TokenBytes, context: list[int], remaining: bytes, k: int) -> list[int]:
    """The next ``k`` draft tokens of the true continuation, tokenized after the draft's context."""
    text = complete_utf8(remaining[: 64 * k]) or remaining[: 64 * k]
    encoded = encode_after(draft, draft.text(context[window_start(draft, context, RESYNC_WINDOW):]), text)
    tokens = encoded[1] if encoded is not None else draft.encode(complete_utf8(text))
    return tokens[:k]


def oracle_fidelity(
    target_tokenizer: PreTrainedTokenizerFast,
    draft_tokenizer: PreTrainedTokenizerFast,
    text: str,
    k: int,
    strategy: str,
    prefix: int = 5,
    partial_word: str = "verify",
) -> Fidelity:
    """Run the decoder's rounds on ``text`` with a perfect draft and a perfect target.

    With ``partial_word="hold"`` every candidate ``aligned`` proposes is one the text's final
    tokenization keeps, so the acceptance measures translation alone; ``verify`` also proposes
    the tokens of a word the proposal stops inside, which commits more tokens per round.
    """
    target, draft = token_bytes(target_tokenizer), token_bytes(draft_tokenizer)
    truth = target.encode(text.encode())
    committed = truth[:PROMPT_TOKENS]
    _, draft_ids = extend_tokens(draft, [], target.text(committed), RESYNC_WINDOW)
    lag = b""
    full = target.text(truth)
    rounds = candidates = accepted = 0
    while len(committed) < len(truth):
        done = len(target.text(committed))
        proposal = _perfect_proposal(draft, draft_ids, full[done - len(lag):] if lag else full[done:], k)
        translation = translate_draft_to_target(strategy, draft, target, proposal, committed, prefix, 2 * k + 2,
                                                lag=lag, partial_word=partial_word)
        expected = truth[len(committed):]
        n = 0
        while n < len(translation.candidates) and n < len(expected) and translation.candidates[n] == expected[n]:
            n += 1
        new = expected[: n + 1]
        rounds += 1
        candidates += len(translation.candidates)
        accepted += n
        committed = committed + new
        draft_ids, lag = follow_text(draft, draft_ids, lag, target.text(new))
    return Fidelity(rounds, candidates, accepted, len(committed) - PROMPT_TOKENS)
