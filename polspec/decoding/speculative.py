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

A sampled round can instead verify by speculative sampling (``params.verify``): the draft
samples over the draft tokens whose text starts with a target token, each maps to the target
tokens of its text, and the target accepts each with probability min(1, p/q)
(:mod:`polspec.decoding.speculative_sampling`); steps 3 and 4 stay as they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx

from polspec.decoding.commit import Commit, RoundState
from polspec.decoding.draft_head import DraftHead
from polspec.decoding.draft_vocab import draft_head
from polspec.decoding.kv import PREFILL_STEP, cached_length, new_cache, prefill, trim
from polspec.decoding.metrics import DecodeMetrics
from polspec.decoding.params import DecodingParams
from polspec.decoding.policy import DraftLength, candidates_that_count
from polspec.decoding.sampling import sequence_seed, token_sampler
from polspec.decoding.speculative_sampling import shared_draft, speculative_choices
from polspec.decoding.translate import (
    TokenBytes, common_prefix, follow_text, same_tokenizer, token_bytes, translate_draft_to_target,
)
from polspec.models.loader import LoadedModel

# A draft step's sampler: (logits, step) -> (the sampled logit index, the distribution drawn from).
DraftDraw = Callable[[mx.array, int], tuple[mx.array, mx.array]]


def _hf(loaded: LoadedModel):
    """The transformers tokenizer inside mlx-lm's wrapper."""
    return loaded.tokenizer._tokenizer


def translation_tables(target: LoadedModel, draft: LoadedModel) -> tuple[TokenBytes, TokenBytes] | None:
    """(draft, target) raw-byte tables of a cross-tokenizer pair; None when the two share a tokenizer."""
    if same_tokenizer(target, draft):
        return None
    return token_bytes(_hf(draft)), token_bytes(_hf(target))


def translate_proposal(
    params: DecodingParams,
    tables: tuple[TokenBytes, TokenBytes] | None,
    proposal: list[int],
    context: list[int],
    lag: bytes,
    metrics: DecodeMetrics,
) -> list[int]:
    """The target candidates for a draft ``proposal`` (capped; none for an empty proposal).

    ``context`` ends with the committed target ids, ``lag`` are committed bytes the draft
    has not seen; ``metrics`` counts boundary misses.
    """
    if not proposal:
        return []
    if tables is None:
        return proposal[: params.candidate_cap]
    translation = translate_draft_to_target(params.strategy, tables[0], tables[1], proposal, context, params.prefix,
                                            params.candidate_cap, lag, params.partial_word)
    metrics.boundary_misses += translation.boundary_miss
    return translation.candidates


class DraftText:
    """The draft's token sequence, kept in step with the committed text (the cache is the caller's).

    ``sequence`` is what the draft's cache should hold plus the tokens still to feed, and
    ``fed`` how many of ``sequence`` are in the cache; ``context`` is the draft's context
    length (None: unbounded).
    """

    def __init__(self, prompt: list[int], table: TokenBytes | None, fed: int = 0, context: int | None = None):
        self.table = table
        self.prompt = prompt
        self.context = context
        self.generated: list[int] = []  # draft ids of the committed text
        self.lag = b""  # committed bytes not yet given to the draft (an incomplete character)
        self.sequence = list(prompt)
        self.fed = fed

    @property
    def unfed(self) -> int:
        """Tokens of the text the draft has not been fed beyond the next proposal's first
        position: the prompt before the first proposal, the committed text since the last."""
        return len(self.sequence) - 1 - self.fed

    def room(self) -> int | None:
        """The most tokens the next proposal may hold with the draft's cache inside its context
        (None: no bound). The prompt check counts target tokens, and the draft may take two for
        one, so a long generation can reach the draft's end; past it its positions are untrained
        and its proposals worthless."""
        # A proposal of n tokens leaves the sequence and n - 1 of them in the cache.
        return None if self.context is None else max(0, self.context + 1 - len(self.sequence))

    def resync(self, committed: list[int], committed_bytes: bytes) -> int:
        """Follow the target: re-tokenize the new text; returns how many cached entries stay valid.

        The caller trims the draft's cache to that length; the rest of ``sequence`` is fed
        with the next proposal.
        """
        if self.table is None:
            self.generated = list(committed)
        else:
            self.generated, self.lag = follow_text(self.table, self.generated, self.lag, committed_bytes)
        wanted = self.prompt + self.generated
        common = min(common_prefix(self.sequence[: self.fed], wanted), len(wanted) - 1)
        self.sequence, self.fed = wanted, common
        return common


class DraftSide:
    """The draft's :class:`DraftText`, its single-sequence cache and its output layer."""

    def __init__(self, draft: LoadedModel, prompt: list[int], table: TokenBytes | None, head: DraftHead):
        self.model = draft.model
        self.head = head
        self.cache = new_cache(draft.model, draft.entry.alias)
        # The prompt is fed on the first proposal, not here: when the auto draft length starts
        # with plain target steps, a draft that never proposes costs nothing.
        self.text = DraftText(prompt, table, context=draft.context_length)
        self.probabilities: list[mx.array] = []  # what the last proposal was drawn from, under a draw

    def propose(self, k: int, policy: DraftLength, draw: DraftDraw | None = None, most: int | None = None) -> list[int]:
        """Up to ``k`` draft tokens, greedy or from ``draw``; the last one is not fed to the cache.

        ``draw(logits, step)`` samples a logit index and gives the distribution it was drawn
        from, kept in :attr:`probabilities` for verification (speculative sampling). One host
        sync per round: the tokens stay lazy until the proposal is complete. The confidence
        policy decides on each token while the next step already runs (one step of lookahead),
        and takes that step back when it stops. Past ``k``, up to ``most`` tokens, the proposal
        goes on while the policy is sure of its last token (``auto``), at one sync per token
        past ``k``: a round that stops at ``k`` pays no more than before.
        """
        self.probabilities = []
        if k == 0:
            return []
        text = self.text
        if len(text.sequence) - text.fed > PREFILL_STEP:  # the prompt, in prefill-sized chunks
            prefill(self.model, self.cache, text.sequence[text.fed:-1])
            text.fed = len(text.sequence) - 1
        # The text committed since the last round goes in with the first draft step: one
        # forward and no host sync of its own.
        inputs = mx.array([text.sequence[text.fed:]])
        proposal, probabilities, unsure = [], [], None
        for step in range(most or k):
            if step >= k and policy.unsure(logits, index).item():
                break
            logits = self.head(inputs, self.cache)[0]
            if draw is None:
                index = mx.argmax(logits)
            else:
                index, drawn_from = draw(logits, step)
            token = self.head.vocabulary_ids(index)
            inputs = token.reshape(1, 1)
            if policy.mode == "confidence":
                mx.async_eval(token)
                if unsure is not None and unsure.item():
                    trim(self.cache, 1)  # the step that fed the last kept token
                    break
                unsure = policy.unsure(logits, index)
            proposal.append(token)
            if draw is not None:
                probabilities.append(drawn_from)
        mx.eval(proposal, probabilities)
        ids = [int(t.item()) for t in proposal]
        text.sequence = text.sequence + ids
        text.fed = cached_length(self.cache)
        self.probabilities = probabilities
        return ids

    def resync(self, committed: list[int], committed_bytes: bytes) -> None:
        fed = self.text.fed
        trim(self.cache, fed - self.text.resync(committed, committed_bytes))


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
    plain target step, and the draft catches up on the text when it next proposes. Sampled
    rounds verify as ``params.verification`` says: by exact match of translated candidates,
    or by speculative sampling over the shared vocabulary (:mod:`polspec.decoding.speculative_sampling`).
    """
    seed = sequence_seed(params)
    sample = token_sampler(params, seed)
    metrics.seed = seed if params.temperature > 0 else None
    eos = set(target.tokenizer.eos_token_ids)
    tables = translation_tables(target, draft)
    target_table = tables[1] if tables else None
    policy = policy or DraftLength(params)
    metrics.prompt_tokens = len(target_prompt)
    metrics.verify = params.verification

    start = time.perf_counter()
    target_cache = new_cache(target.model, target.entry.alias)
    prefill(target.model, target_cache, target_prompt[:-1])
    head = draft_head(draft, params.draft_vocab)
    metrics.draft_vocab = head.size
    draft_side = DraftSide(draft, draft_prompt, tables and tables[0], head)
    shared = shared_draft(head, target, draft) if params.verification == "tli" else None
    metrics.prefill_s = time.perf_counter() - start

    committed: list[int] = []
    pending = target_prompt[-1]
    try:
        while len(committed) < params.max_tokens:
            clock = time.perf_counter()
            remaining = params.max_tokens - len(committed)
            k = within_draft_context(policy.k_within(remaining, draft_side.text.unfed), draft_side.text, metrics,
                                     len(committed))
            position = len(committed)
            draw = shared and (lambda logits, step: shared.sample(logits, params, seed, position, step))
            proposal = draft_side.propose(k, policy, draw, within_draft_context(policy.most_within(k, remaining),
                                                                                draft_side.text))
            now = time.perf_counter()
            metrics.draft_s += now - clock

            clock = now
            metrics.plain_rounds += not proposal
            if shared is None:
                context = target_prompt[-params.prefix - 8:] + committed
                candidates = translate_proposal(params, tables, proposal, context, draft_side.text.lag, metrics)
            else:
                candidates = shared.candidates(proposal, params.candidate_cap)
            candidates = candidates_to_verify(candidates, remaining, eos)
            now = time.perf_counter()
            metrics.translate_s += now - clock

            clock = now
            logits = target.model(mx.array([[pending] + candidates]), cache=target_cache)[0]
            if shared is None:
                choices = sample(logits).tolist()
            else:
                drawn_from = shared.distributions(proposal, draft_side.probabilities, len(candidates),
                                                  logits.shape[-1]) if candidates else None
                choices = speculative_choices(logits, candidates, drawn_from, params, seed, position).tolist()
            new, accepted, stopped = settle_round(candidates, choices, proposal, len(committed), params, eos, metrics,
                                                  policy, tables, draft_side.text.lag)
            trim(target_cache, len(candidates) - accepted)
            now = time.perf_counter()
            metrics.verify_s += now - clock

            committed += new
            pending = new[-1] if new else pending
            metrics.generated_tokens = len(committed)
            finished = stopped or len(committed) >= params.max_tokens
            if not finished:
                clock = time.perf_counter()
                draft_side.resync(committed, target_table.text(new) if tables else b"")
                metrics.resync_s += time.perf_counter() - clock
            # Per round, not once at the end: a caller that stops early (a stop string) reads it too.
            metrics.decode_s = metrics.draft_s + metrics.translate_s + metrics.verify_s + metrics.resync_s
            if new:
                state = RoundState(cached_length(target_cache), cached_length(draft_side.cache), draft_side.text.fed,
                                   list(draft_side.text.generated), draft_side.text.lag)
                yield Commit(new, drafted=min(accepted, len(new)), state=state)
            if finished:
                metrics.finish_reason = "stop" if stopped else "length"
                metrics.note_if_never_drafted(params.k)
                break
    finally:
        metrics.peak_memory_gb = mx.get_peak_memory() / 1e9


def within_draft_context(k: int, text: DraftText, metrics: DecodeMetrics | None = None, position: int = 0) -> int:
    """``k`` cut to the room the draft's context leaves (:meth:`DraftText.room`). Where that
    leaves no room, decoding goes on plainly, and ``metrics`` (given) notes from which token."""
    room = text.room()
    if room is None or k <= room:
        return k
    if room == 0 and metrics is not None and not metrics.k_policy_note:
        metrics.k_policy_note = (f"plain decoding from token {position}: the draft's text reached its context of "
                                 f"{text.context} tokens")
    return room


def candidates_to_verify(candidates: list[int], remaining: int, eos: set[int]) -> list[int]:
    """The candidates a round verifies: none past what ``remaining`` tokens to go can use
    (:func:`~polspec.decoding.policy.candidates_that_count`), nor past the first end of sequence,
    after which nothing is committed."""
    usable = candidates[: candidates_that_count(remaining)]
    stop = next((i for i, token in enumerate(usable) if token in eos), None)
    return usable if stop is None else usable[: stop + 1]


def settle_round(
    candidates: list[int],
    choices: list[int],
    proposal: list[int],
    committed: int,
    params: DecodingParams,
    eos: set[int],
    metrics: DecodeMetrics,
    policy: DraftLength,
    tables: tuple[TokenBytes, TokenBytes] | None,
    lag: bytes,
) -> tuple[list[int], int, bool]:
    """Accept candidates against the target's ``choices``; returns (new tokens, accepted, stopped).

    Candidates are accepted while they equal the target's choice at their position, then the
    target's choice at the first mismatch is committed too; the round stops at EOS and at
    ``params.max_tokens`` (``committed`` tokens are already in). ``metrics`` and ``policy``
    learn the round; ``tables`` (draft, target) count the accepted draft tokens of a
    cross-tokenizer pair, whose proposal starts by repeating ``lag``, the committed bytes the
    draft had not seen (an incomplete character): ``aligned`` leaves them out of its candidates,
    so they count as accepted with the text after them; the other strategies and TLI keep them.
    """
    accepted = 0
    while accepted < len(candidates) and choices[accepted] == candidates[accepted]:
        accepted += 1
    new = (candidates[:accepted] + [choices[accepted]])[: params.max_tokens - committed]
    stop = next((i for i, token in enumerate(new) if token in eos), None)
    if stop is not None:
        new = new[:stop]
    inside = min(accepted, len(new) + (stop is not None))  # an accepted end of sequence is an accepted candidate
    metrics.rounds += 1
    metrics.draft_tokens += len(proposal)
    metrics.candidates += len(candidates)
    metrics.rejections += accepted < len(candidates)
    metrics.candidates_accepted += inside
    repeated = lag if params.strategy == "aligned" and params.verification == "exact" else b""
    metrics.draft_tokens_accepted += (
        _draft_tokens_inside(tables[0], proposal, tables[1], new[:inside], repeated) if tables is not None else inside)
    policy.observe(accepted, len(candidates), len(proposal))
    return new, accepted, stop is not None


def _draft_tokens_inside(draft: TokenBytes, proposal: list[int], target: TokenBytes, accepted: list[int],
                         lag: bytes) -> int:
    """How many leading draft tokens lie wholly inside the accepted target text, after the
    ``lag`` the proposal repeats (none when no candidate was accepted)."""
    budget = len(lag) + len(target.text(accepted)) if accepted else 0
    count = 0
    for token in proposal:
        size = len(draft.piece(token) or b"")
        if size > budget or draft.is_special(token):
            break
        budget -= size
        count += 1
    return count
