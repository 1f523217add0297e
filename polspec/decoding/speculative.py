"""Cross-tokenizer speculative decoding, lossless by construction.

One round:

1. the draft proposes up to ``k`` tokens from its own cache (greedy);
2. the proposal is translated into target candidates (:mod:`polspec.decoding.translate`),
   capped at ``params.candidate_cap``; a same-family pair skips translation;
3. the target scores ``pending + candidates`` in one forward and samples its own token at
   every position with its own sampler; candidates are accepted while they equal the
   target's choice, then the target's choice at the first mismatch is committed too.
   Every committed token is the target's own, so greedy output equals target-only greedy
   output and sampled output follows the target's distribution;
4. the target cache is trimmed to the committed length, and the draft is re-synced: the
   newly committed text is re-tokenized in the draft's tokenizer with a window of context,
   the draft cache is trimmed to the common prefix and the rest is fed next round.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx

from polspec.decoding.commit import Commit, RoundState
from polspec.decoding.kv import PREFILL_STEP, cached_length, new_cache, prefill, trim
from polspec.decoding.metrics import DecodeMetrics
from polspec.decoding.params import DecodingParams
from polspec.decoding.policy import DraftLength
from polspec.decoding.sampling import token_sampler
from polspec.decoding.translate import (
    TokenBytes, common_prefix, follow_text, token_bytes, translate_draft_to_target,
)
from polspec.models.loader import LoadedModel



def _hf(loaded: LoadedModel):
    """The transformers tokenizer inside mlx-lm's wrapper."""
    return loaded.tokenizer._tokenizer


def same_tokenizer(target: LoadedModel, draft: LoadedModel) -> bool:
    return target.entry.tokenizer_family == draft.entry.tokenizer_family


class _DraftSide:
    """The draft's token sequence and cache, kept in step with the committed text."""

    def __init__(self, draft: LoadedModel, prompt: list[int], longest: int, table: TokenBytes | None):
        self.model = draft.model
        self.table = table
        self.cache = new_cache(draft.model, draft.entry.alias, longest)
        self.prompt = prompt
        self.generated: list[int] = []  # draft ids of the committed text
        self.lag = b""  # committed bytes not yet given to the draft (an incomplete character)
        self.sequence = list(prompt)  # what the cache should hold, plus tokens still to feed
        # The prompt is fed on the first proposal, not here: when the auto draft length starts
        # with plain target steps, a draft that never proposes costs nothing.
        self.fed = 0  # how many of `sequence` are in the cache

    def propose(self, k: int, policy: DraftLength) -> list[int]:
        """Up to ``k`` greedy draft tokens; the last one is not fed to the cache."""
        if k == 0:
            return []
        if len(self.sequence) - self.fed > PREFILL_STEP:  # the prompt, in prefill-sized chunks
            prefill(self.model, self.cache, self.sequence[self.fed:-1])
            self.fed = len(self.sequence) - 1
        # The text committed since the last round goes in with the first draft step: one
        # forward and no host sync of its own.
        inputs = mx.array([self.sequence[self.fed:]])
        proposal = []
        for step in range(k):
            logits = self.model(inputs, cache=self.cache)[0, -1]
            token = mx.argmax(logits)
            proposal.append(token)
            if policy.stop_after(step, logits, token):
                break
            inputs = token.reshape(1, 1)
        mx.eval(proposal)
        ids = [int(t.item()) for t in proposal]
        self.sequence = self.sequence + ids
        self.fed = cached_length(self.cache)
        return ids

    def resync(self, committed: list[int], committed_bytes: bytes) -> None:
        """Follow the target: re-tokenize the new text, trim the cache to the common prefix."""
        if self.table is None:
            self.generated = list(committed)
        else:
            self.generated, self.lag = follow_text(self.table, self.generated, self.lag, committed_bytes)
        wanted = self.prompt + self.generated
        common = min(common_prefix(self.sequence[: self.fed], wanted), len(wanted) - 1)
        trim(self.cache, self.fed - common)
        self.sequence, self.fed = wanted, common


def generate_speculative(
    target: LoadedModel,
    draft: LoadedModel,
    target_prompt: list[int],
    draft_prompt: list[int],
    params: DecodingParams,
    metrics: DecodeMetrics,
    policy: DraftLength | None = None,
) -> Iterator[Commit]:
    """Yield committed target tokens round by round until EOS or ``params.max_tokens``.

    ``policy`` decides the draft length (default: from ``params``); a round with k = 0 is a
    plain target step, and the draft catches up on the text when it next proposes.
    """
    sample = token_sampler(params)
    eos = set(target.tokenizer.eos_token_ids)
    translate = not same_tokenizer(target, draft)
    target_table = token_bytes(_hf(target)) if translate else None
    draft_table = token_bytes(_hf(draft)) if translate else None
    policy = policy or DraftLength(params)
    cap = params.candidate_cap
    metrics.prompt_tokens = len(target_prompt)

    start = time.perf_counter()
    target_cache = new_cache(target.model, target.entry.alias, len(target_prompt) + params.max_tokens + cap + 1)
    prefill(target.model, target_cache, target_prompt[:-1])
    draft_side = _DraftSide(draft, draft_prompt, len(draft_prompt) + 2 * params.max_tokens + cap, draft_table)
    metrics.prefill_s = time.perf_counter() - start

    committed: list[int] = []
    pending = target_prompt[-1]
    while len(committed) < params.max_tokens:
        clock = time.perf_counter()
        k = min(policy.k, params.max_tokens - len(committed))
        proposal = draft_side.propose(k, policy)
        now = time.perf_counter()
        metrics.draft_s += now - clock

        clock = now
        if not proposal:
            candidates = []
            metrics.plain_rounds += 1
        elif translate:
            translation = translate_draft_to_target(
                params.strategy, draft_table, target_table, proposal,
                target_prompt[-params.prefix - 8:] + committed, params.prefix, cap, draft_side.lag,
                params.partial_word,
            )
            candidates = translation.candidates
            metrics.boundary_misses += translation.boundary_miss
        else:
            candidates = proposal[:cap]
        candidates = candidates[: params.max_tokens - len(committed)]
        now = time.perf_counter()
        metrics.translate_s += now - clock

        clock = now
        logits = target.model(mx.array([[pending] + candidates]), cache=target_cache)[0]
        choices = sample(logits).tolist()
        accepted = 0
        while accepted < len(candidates) and choices[accepted] == candidates[accepted]:
            accepted += 1
        trim(target_cache, len(candidates) - accepted)
        new = candidates[:accepted] + [choices[accepted]]
        now = time.perf_counter()
        metrics.verify_s += now - clock

        new = new[: params.max_tokens - len(committed)]
        stop = next((i for i, token in enumerate(new) if token in eos), None)
        if stop is not None:
            new = new[:stop]
        metrics.rounds += 1
        metrics.draft_tokens += len(proposal)
        metrics.candidates += len(candidates)
        metrics.rejections += accepted < len(candidates)
        metrics.candidates_accepted += min(accepted, len(new))
        metrics.draft_tokens_accepted += _draft_tokens_inside(
            draft_table, proposal, target_table, new[: min(accepted, len(new))]
        ) if translate else min(accepted, len(new))
        policy.observe(accepted, len(candidates), len(proposal))
        committed += new
        pending = new[-1] if new else pending
        metrics.generated_tokens = len(committed)
        finished = stop is not None or len(committed) >= params.max_tokens
        if not finished:
            clock = time.perf_counter()
            draft_side.resync(committed, target_table.text(new) if translate else b"")
            metrics.resync_s += time.perf_counter() - clock
        if new:
            state = RoundState(cached_length(target_cache), cached_length(draft_side.cache), draft_side.fed,
                               list(draft_side.generated), draft_side.lag)
            yield Commit(new, drafted=min(accepted, len(new)), state=state)
        if finished:
            metrics.finish_reason = "stop" if stop is not None else "length"
            break
    metrics.decode_s = metrics.draft_s + metrics.translate_s + metrics.verify_s + metrics.resync_s
    metrics.peak_memory_gb = mx.get_peak_memory() / 1e9


def _draft_tokens_inside(draft: TokenBytes, proposal: list[int], target: TokenBytes, accepted: list[int]) -> int:
    """How many leading draft tokens lie wholly inside the accepted target text."""
    budget = len(target.text(accepted))
    count = 0
    for token in proposal:
        size = len(draft.raw[token] or b"")
        if size > budget or draft.is_special(token):
            break
        budget -= size
        count += 1
    return count
