"""Batched decoding: many sequences share every forward, target-only or speculative.

    decoder = BatchDecoder(target, draft, max_batch=8)
    decoder.add("q1", "Kraków jest", DecodingParams(k=2))
    while decoder:
        for event in decoder.step():
            ...  # event.key, event.commit (tokens this round), event.finished, event.metrics

On bandwidth-bound hardware one forward over B sequences costs little more than over one,
so a round runs every sequence at once: one batched draft forward per draft step, one
batched target forward for verification (or for a plain step). Each sequence keeps its own
prompt length, parameters, acceptance and KV length (and draft length, bar ``auto``, whose
rows share one k per round): the caches are ragged
(:mod:`polspec.decoding.batch_kv`), rows are trimmed one by one after verification.

Continuous batching: :meth:`BatchDecoder.add` queues a sequence, which is prefilled and joins
at the start of the next round while a slot is free; a finished (or :meth:`removed
<BatchDecoder.remove>`) sequence leaves at the end of its round and frees its slot.

Lossless per sequence, as the single-sequence decoders: every committed token is the
target's own choice at its position (greedy, or sampled with the sequence's own sampler and
seed, or accepted by speculative sampling with draws keyed by the sequence's seed), so a sequence's output does not depend on what else the batch holds, up to float
rounding of batched matrix products (ties, shown by the tests); sampled output so only for a
fixed ``k``, as ``k = auto`` rows share one draft length a round.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from polspec.cpu_share import release_cores, share_cores
from polspec.decoding import batch_kv
from polspec.decoding.acceptance import acceptance_estimate
from polspec.decoding.commit import Commit
from polspec.decoding.costmodel import Probe, can_pay, throughput_batch_size
from polspec.decoding.draft_head import DraftHead, vocabulary_size
from polspec.decoding.draft_vocab import draft_head, polish_texts
from polspec.decoding.measure import plain_step_s
from polspec.decoding.metrics import DecodeMetrics
from polspec.decoding.params import DecodingParams
from polspec.decoding.policy import DraftLength, candidates_that_count, shared_auto_k
from polspec.decoding.prompts import Prompt, draft_cannot_take, encode_request
from polspec.decoding.sampling import sequence_seed, token_sampler
from polspec.decoding.speculative import (DraftText, candidates_to_verify, settle_round, translate_proposal,
                                         translation_tables, within_draft_context)
from polspec.decoding.speculative_sampling import SharedDraft, shared_draft, speculative_choices
from polspec.errors import PolspecError
from polspec.models.loader import LoadedModel


@dataclass
class SequenceEvent:
    """What one round did for one sequence."""

    key: Hashable
    commit: Commit | None  # the tokens committed this round; None when the round added none (EOS)
    finished: bool
    metrics: DecodeMetrics  # the sequence's own metrics so far


@dataclass
class _Sequence:
    key: Hashable
    params: DecodingParams
    prompt: list[int]
    metrics: DecodeMetrics
    policy: DraftLength | None  # None: target-only
    draft_text: DraftText | None
    head: DraftHead | None = None  # the draft's output layer for this row (its draft_vocab)
    seed: int = 0
    sample: Callable[[mx.array], mx.array] | None = None
    shared: SharedDraft | None = None  # under speculative sampling: the head over the shared vocabulary
    probabilities: list[mx.array] = field(default_factory=list)  # what this round's draft tokens were drawn from
    eos: set[int] = field(default_factory=set)
    committed: list[int] = field(default_factory=list)
    pending: int = 0
    draft_cached: int = 0  # entries of this row in the draft cache, valid or not
    draft_warm: bool = False  # its draft prompt is cached: it has proposed at least once

    @property
    def lag(self) -> bytes:
        """Committed bytes its draft has not seen (an incomplete character), which its next
        proposal repeats; none without a draft."""
        return self.draft_text.lag if self.draft_text else b""

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.committed)

    @property
    def k_this_round(self) -> int:
        """Its policy's k as far as the tokens left can use it (:func:`candidates_that_count`);
        0 target-only."""
        return min(self.policy.k, candidates_that_count(self.remaining)) if self.policy else 0

    @property
    def past_draft_context(self) -> bool:
        """Its text leaves the draft no room (:meth:`DraftText.room`): from here it decodes plainly
        and its draft row is fed nothing more."""
        return self.draft_text is not None and self.draft_text.room() == 0


class BatchDecoder:
    """A long-lived decoder that sequences join and leave between rounds.

    ``draft=None`` decodes target-only; with a draft every sequence is speculative with its
    own ``params.k`` policy. ``auto`` rows share one k per round, chosen from ``probe`` viewed
    at the round's batch size on what the pair has shown, and only where it pays back the
    draft's feed of the text it has not seen (:func:`~polspec.decoding.policy.shared_auto_k`).
    A row alone makes its own choice, and a sequence decodes without the draft where no k
    can pay at any batch size.
    ``max_batch`` caps how many sequences decode together (default: what memory holds
    for ``longest`` tokens a sequence, see :func:`max_batch_size`).
    """

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None, max_batch: int | None = None,
                 probe: Probe | None = None, longest: int = 1024):
        self.target, self.draft, self.probe = target, draft, probe
        self.target_layers = batch_kv.check_batchable(target.model, target.entry.alias)
        self.draft_layers = batch_kv.check_batchable(draft.model, draft.entry.alias) if draft else 0
        self.tables = translation_tables(target, draft) if draft else None
        self.max_batch = max_batch if max_batch is not None else max_batch_size(target, draft, longest)
        if self.max_batch < 1:
            raise PolspecError(f"max_batch must be at least 1, got {self.max_batch}")
        self.waiting: list[_Sequence] = []
        self.rows: list[_Sequence] = []
        self.target_cache: list | None = None
        self.draft_cache: list | None = None
        self._removed: set[Hashable] = set()

    def __bool__(self) -> bool:
        """Whether any sequence decodes or waits to join: ``while decoder: decoder.step()`` runs all."""
        return bool(self.rows or self.waiting)

    def __len__(self) -> int:
        """The sequences decoding now; those added since the last round join at the next."""
        return len(self.rows)

    def add(self, key: Hashable, prompt: Prompt, params: DecodingParams, chat: bool | None = None) -> None:
        """Queue a sequence to join at the next round; a request that cannot run raises PolspecError now."""
        if any(s.key == key for s in self.rows + self.waiting):
            raise PolspecError(f"a sequence {key!r} is already in this batch")
        target_ids, draft_ids = encode_request(self.target, self.draft, prompt, params, chat)
        metrics = DecodeMetrics(prompt_tokens=len(target_ids))
        policy = None
        if self.draft is not None and (reason := draft_cannot_take(self.draft, draft_ids, params)):
            metrics.k_policy_note = reason
        elif self.draft is not None:
            policy = self._policy(params, metrics)
        sequence = _Sequence(key, params, target_ids, metrics, policy,
                             DraftText(draft_ids, self.tables and self.tables[0], context=self.draft.context_length)
                             if policy else None)
        if policy is not None:
            sequence.head = draft_head(self.draft, params.draft_vocab)
            metrics.draft_vocab = sequence.head.size
            metrics.verify = params.verification
            if params.verification == "tli":
                sequence.shared = shared_draft(sequence.head, self.target, self.draft)
        sequence.seed = sequence_seed(params)
        sequence.sample = token_sampler(params, sequence.seed)
        metrics.seed = sequence.seed if params.temperature > 0 else None
        sequence.eos = set(self.target.tokenizer.eos_token_ids)
        self.waiting.append(sequence)

    def remove(self, key: Hashable) -> None:
        """Stop a sequence: it leaves at the end of the next round (or at once if still waiting)."""
        self.waiting = [s for s in self.waiting if s.key != key]
        if any(s.key == key for s in self.rows):
            self._removed.add(key)

    def step(self) -> list[SequenceEvent]:
        """One round for every sequence in the batch; new sequences join first."""
        share_cores()
        self._join()
        if not self.rows:
            return []
        batch = len(self.rows)
        auto = [s for s in self.rows if s.policy is not None and s.policy.mode == "auto" and not s.past_draft_context]
        if auto and batch > 1:
            k = self._shared_k(auto, batch)
            for sequence in auto:
                sequence.policy.k = min(k, sequence.policy.k_max)
        elif auto:  # a row alone: its own k, as one sequence decoded on its own
            sequence = auto[0]
            sequence.policy.k = sequence.policy.k_within(sequence.remaining, sequence.draft_text.unfed)

        cold = [row for row, s in enumerate(self.rows) if s.k_this_round and not s.draft_warm and not s.past_draft_context]
        if cold:
            self._warm(cold)  # which reorders the rows
        clock = time.perf_counter()
        remaining = [s.remaining for s in self.rows]
        ks = [within_draft_context(s.k_this_round, s.draft_text, s.metrics, len(s.committed)) if s.policy else 0
              for s in self.rows]
        floors = [_floor(s, k) for s, k in zip(self.rows, ks)]
        if auto and batch == 1:
            ks = [within_draft_context(auto[0].policy.most_within(ks[0], remaining[0]), auto[0].draft_text)]
        proposals = self._propose(ks, floors) if any(ks) else [[] for _ in self.rows]
        draft_s = time.perf_counter() - clock

        clock = time.perf_counter()
        candidates = []
        for sequence, proposal, left in zip(self.rows, proposals, remaining):
            context = sequence.prompt[-sequence.params.prefix - 8:] + sequence.committed
            if sequence.shared is not None:
                found = sequence.shared.candidates(proposal, sequence.params.candidate_cap)
            else:
                found = translate_proposal(sequence.params, self.tables, proposal, context, sequence.lag,
                                           sequence.metrics)
            candidates.append(candidates_to_verify(found, left, sequence.eos))
        translate_s = time.perf_counter() - clock

        clock = time.perf_counter()
        choices = self._verify(candidates, proposals)
        width = 1 + max(map(len, candidates))  # positions every row fed the target this round
        events, trims, finished = [], [], []
        for row, sequence in enumerate(self.rows):
            new, accepted, stopped = settle_round(
                candidates[row], choices[row], proposals[row], len(sequence.committed), sequence.params,
                sequence.eos, sequence.metrics, sequence.policy or _PLAIN, self.tables, sequence.lag)
            trims.append(width - 1 - accepted)
            sequence.metrics.plain_rounds += not proposals[row] and self.draft is not None
            sequence.committed += new
            sequence.pending = new[-1] if new else sequence.pending
            sequence.metrics.generated_tokens = len(sequence.committed)
            done = stopped or len(sequence.committed) >= sequence.params.max_tokens or sequence.key in self._removed
            if done:
                sequence.metrics.finish_reason = (
                    "stop" if stopped else "length" if len(sequence.committed) >= sequence.params.max_tokens
                    else "cancelled")
                sequence.metrics.note_if_never_drafted(sequence.params.k)
            finished.append(done)
            events.append(SequenceEvent(sequence.key, Commit(new, drafted=min(accepted, len(new))) if new else None,
                                        done, sequence.metrics))
        batch_kv.trim_each(self.target_cache, trims)
        verify_s = time.perf_counter() - clock

        clock = time.perf_counter()
        if self.draft_cache is not None:
            self._resync(finished, [event.commit.tokens if event.commit else [] for event in events])
        resync_s = time.perf_counter() - clock

        for sequence in self.rows:
            metrics = sequence.metrics
            metrics.draft_s += draft_s
            metrics.translate_s += translate_s
            metrics.verify_s += verify_s
            metrics.resync_s += resync_s
            metrics.decode_s = metrics.draft_s + metrics.translate_s + metrics.verify_s + metrics.resync_s
            metrics.batch_size += (batch - metrics.batch_size) / metrics.rounds
        self._leave(finished)
        if not self:
            release_cores()  # until a sequence joins again: the cores are the others' meanwhile
        return events

    # --- the round's parts -------------------------------------------------------------------

    def _policy(self, params: DecodingParams, metrics: DecodeMetrics) -> DraftLength | None:
        if params.k != "auto":
            return DraftLength(params)
        if self.probe is None:
            raise PolspecError("k=auto in a batch needs the pair's probe (polspec models probe TARGET DRAFT)")
        if not self.probe.batch and self.max_batch > 1:
            # auto would price a round of many rows at one row's costs: drafting where it cannot pay
            raise PolspecError(f"the probe of {self.probe.target} with {self.probe.draft} has no batch table; take it "
                               "with stored_probe(target, draft, batched=True)")
        if not any(can_pay(self.probe.at_batch(b), params.k_max) for b in range(1, self.max_batch + 1)):
            metrics.k_policy_note = "auto: plain decoding, no k can pay on this machine at any batch size"
            return None
        estimate = acceptance_estimate(self.target.entry.alias, self.draft.entry.alias, params)
        return DraftLength(params, self.probe.at_batch(1), estimate)

    def _shared_k(self, auto: list[_Sequence], batch: int) -> int:
        """The k of this round's ``auto`` rows in a batch of ``batch``
        (:func:`~polspec.decoding.policy.shared_auto_k`), over the tokens the rows have left on
        average, with the draft's warm-up: the text it has not been fed beyond each row's
        first position (the prompt of a row that has not proposed yet, the plain stretch of
        one that has)."""
        unfed = sum(s.draft_text.unfed for s in auto)
        remaining = statistics.fmean(s.remaining for s in auto)
        return shared_auto_k([s.policy for s in auto], self.probe.at_batch(batch), batch, remaining,
                             self.probe.draft_feed_steps(unfed, batch))

    def _join(self) -> None:
        joining = []
        while self.waiting and len(self.rows) + len(joining) < self.max_batch:
            joining.append(self.waiting.pop(0))
        if not joining:
            return
        self.target_cache, order, seconds = batch_kv.append_prompts(
            self.target_cache, self.target.model, self.target_layers, [s.prompt[:-1] for s in joining])
        for index, share in zip(order, seconds):
            joining[index].pending = joining[index].prompt[-1]
            joining[index].metrics.prefill_s = share
        if self.draft is not None:
            # The draft's prompt is fed on the row's first proposal (:meth:`_warm`), not here: a
            # row that ``auto`` keeps plain never pays for it. Until then its draft row is empty.
            self.draft_cache = batch_kv.extend(self.draft_cache, batch_kv.empty_rows(self.draft_layers, len(order)))
        self.rows += [joining[index] for index in order]

    def _warm(self, cold: list[int]) -> None:
        """Feed the draft the text of rows about to propose for the first time, in groups of
        similar length (:func:`~polspec.decoding.batch_kv.prefill_groups`: a catch-up over all
        of them at once would pad every row to the longest prompt) and once however many rows
        share it; they move to the end of the batch, in both caches."""
        texts = [self.rows[row].draft_text.sequence[:-1] for row in cold]
        stay = [row for row in range(len(self.rows)) if row not in cold]
        if stay:
            batch_kv.keep_rows(self.draft_cache, stay)
        self.draft_cache, warmed, seconds = batch_kv.append_prompts(
            self.draft_cache if stay else None, self.draft.model, self.draft_layers, texts)
        for index, share in zip(warmed, seconds):
            sequence = self.rows[cold[index]]
            # Each feed is its row's own draft time, as a joining row's target prefill is its
            # own: the rows beside it would otherwise pay for it in their decode time.
            sequence.metrics.draft_s += share
            text = sequence.draft_text
            text.fed = sequence.draft_cached = len(text.sequence) - 1
            sequence.draft_warm = True
        order = stay + [cold[index] for index in warmed]
        batch_kv.keep_rows(self.target_cache, order)
        self.rows = [self.rows[row] for row in order]

    def _propose(self, ks: list[int], floors: list[int]) -> list[list[int]]:
        """Every row's greedy draft tokens, in one batched forward per draft step: at least
        ``floors[row]`` of them, and up to ``ks[row]`` while the row's policy is sure of each
        token past its floor (:meth:`DraftLength.unsure`: the confidence policy, and ``auto``
        drafting past its k).

        The first step feeds each row's text committed since its last proposal (right-padded to
        the longest); rows with k = 0 catch up in it too, at little cost, and propose nothing.
        A row that has not proposed yet, is target-only or is past the draft's context feeds one
        padding token, which :meth:`_resync` cuts.
        """
        fed = [s.draft_warm and not s.past_draft_context for s in self.rows]
        feeds = [s.draft_text.sequence[s.draft_text.fed:] if feeding else [0] for s, feeding in zip(self.rows, fed)]
        width = max(map(len, feeds))
        inputs = mx.array([feed + [0] * (width - len(feed)) for feed in feeds])
        heads = self._heads()
        features = next(iter(heads)).features(inputs, self.draft_cache, mx.array([len(feed) - 1 for feed in feeds]))
        batch_kv.trim_each(self.draft_cache, [width - len(feed) for feed in feeds])
        steps = max(ks)
        # Every row needs its floor's steps; beyond those, the rows that may stop early decide,
        # at one host sync per step, as the single-sequence decoder does. A deciding row is done
        # at its first unsure token past its floor or at its k, whichever comes first.
        fixed = max(floors)
        deciding = [row for row in range(len(self.rows)) if floors[row] < ks[row]]
        thresholds = mx.array([self.rows[row].policy.threshold for row in deciding])
        counted_from = mx.array([floors[row] - 1 for row in deciding])
        deciding_ks = mx.array([ks[row] for row in deciding])
        tokens, confidences = [], []
        for sequence in self.rows:
            sequence.probabilities = []
        for step in range(steps):
            token, confidence = _draft_step(heads, features, self.rows, step, ks, bool(deciding))
            tokens.append(token)
            confidences.append(confidence)
            if step + 1 == steps:
                break
            if step + 1 >= fixed and deciding:
                done = mx.any(_stops(confidences, deciding, thresholds, counted_from, deciding_ks), axis=1)
                if mx.all(done | (deciding_ks <= step + 1)).item():
                    break
            features = next(iter(heads)).features(token[:, None], self.draft_cache)
        steps = len(tokens)
        mx.eval(tokens, confidences)
        drafted = mx.stack(tokens, axis=1).tolist()
        stops = (dict(zip(deciding, _stops(confidences, deciding, thresholds, counted_from, deciding_ks).tolist()))
                 if deciding else {})
        proposals = []
        for row, sequence in enumerate(self.rows):
            text = sequence.draft_text
            proposal = drafted[row][: ks[row]]
            if row in stops:
                low = next((i for i, stop in enumerate(stops[row]) if stop), None)
                proposal = proposal if low is None else proposal[: low + 1]
            if fed[row]:
                text.fed = len(text.sequence) + max(len(proposal) - 1, 0)
                text.sequence = text.sequence + proposal
            sequence.draft_cached += len(feeds[row]) + steps - 1
            proposals.append(proposal)
        return proposals

    def _heads(self) -> dict[DraftHead, list[int]]:
        """The rows of each draft head in the batch (a target-only row rides with the first)."""
        heads: dict[DraftHead, list[int]] = {}
        for row, sequence in enumerate(self.rows):
            if sequence.head is not None:
                heads.setdefault(sequence.head, []).append(row)
        if not heads:
            return {draft_head(self.draft, "auto"): list(range(len(self.rows)))}
        first = next(iter(heads))
        heads[first] += [row for row, sequence in enumerate(self.rows) if sequence.head is None]
        return heads

    def _verify(self, candidates: list[list[int]], proposals: list[list[int]]) -> list[list[int]]:
        """The target's own token at every position of every row, from one batched forward
        (``proposals``: the draft tokens each row's candidates came from)."""
        inputs = [[s.pending] + found for s, found in zip(self.rows, candidates)]
        width = max(map(len, inputs))
        logits = self.target.model(mx.array([row + [0] * (width - len(row)) for row in inputs]), cache=self.target_cache)
        if all(s.params.temperature == 0 for s in self.rows):
            chosen = mx.argmax(logits, axis=-1).tolist()
            return [row[: len(fed)] for row, fed in zip(chosen, inputs)]
        picks = []
        for row, (sequence, found, proposal) in enumerate(zip(self.rows, candidates, proposals)):
            scores = logits[row, : len(found) + 1]
            if sequence.shared is None:
                picks.append(sequence.sample(scores))
                continue
            drawn_from = (sequence.shared.distributions(proposal, sequence.probabilities, len(found), scores.shape[-1])
                          if found else None)
            picks.append(speculative_choices(scores, found, drawn_from, sequence.params, sequence.seed,
                                             len(sequence.committed)))
        mx.eval(picks)
        return [pick.tolist() for pick in picks]

    def _resync(self, finished: list[bool], new: list[list[int]]) -> None:
        """Every draft row follows its committed text; its cache row is cut to what stays valid."""
        trims = []
        for sequence, done, tokens in zip(self.rows, finished, new):
            text = sequence.draft_text
            keep = sequence.draft_cached
            if text is not None and not done:
                keep = text.resync(sequence.committed, self.tables[1].text(tokens) if self.tables else b"")
            elif text is None:  # a target-only row: its draft row only ever holds padding
                keep = 0
            trims.append(sequence.draft_cached - keep)
            sequence.draft_cached = keep
        batch_kv.trim_each(self.draft_cache, trims)

    def _leave(self, finished: list[bool]) -> None:
        stay = [row for row, done in enumerate(finished) if not done]
        for row, done in enumerate(finished):
            if done:
                self._removed.discard(self.rows[row].key)
                self.rows[row].metrics.peak_memory_gb = mx.get_peak_memory() / 1e9
        if len(stay) == len(self.rows):
            return
        self.rows = [self.rows[row] for row in stay]
        if not stay:
            self.target_cache = self.draft_cache = None
            return
        batch_kv.keep_rows(self.target_cache, stay)
        if self.draft_cache is not None:
            batch_kv.keep_rows(self.draft_cache, stay)

    def cached_lengths(self) -> tuple[list[int], list[int]]:
        """(target, draft) cache entries per row, for checks."""
        return (batch_kv.row_lengths(self.target_cache) if self.target_cache else [],
                batch_kv.row_lengths(self.draft_cache) if self.draft_cache else [])


def _draft_step(heads: dict[DraftHead, list[int]], features: mx.array, sequences: list[_Sequence], step: int,
                ks: list[int], confidence_needed: bool) -> tuple[mx.array, mx.array]:
    """Each row's draft token through the row's own head, and its draft probability (zeros
    unless ``confidence_needed``). Greedy, except that a row under speculative sampling
    samples over its shared vocabulary in the steps it proposes from (keeping what it drew
    from in its ``probabilities``)."""
    size = len(sequences)
    token, confidence = mx.zeros(size, mx.int32), None
    for head, rows in heads.items():
        logits = head.logits(features if len(rows) == size else features[mx.array(rows)])
        index = mx.argmax(logits, axis=-1)
        sampled = [i for i, row in enumerate(rows) if sequences[row].shared is not None and step < ks[row]]
        if sampled:
            picks = list(index)
            for i in sampled:
                sequence = sequences[rows[i]]
                picks[i], drawn_from = sequence.shared.sample(logits[i], sequence.params, sequence.seed,
                                                              len(sequence.committed), step)
                sequence.probabilities.append(drawn_from)
            index = mx.stack(picks)
        chosen = head.vocabulary_ids(index).astype(mx.int32)
        sure = (mx.take_along_axis(mx.softmax(logits, axis=-1), index[:, None], axis=-1)[:, 0] if confidence_needed
                else mx.zeros(len(rows)))
        if len(rows) == size:
            return chosen, sure
        if confidence is None:  # in the draft's dtype, which _stops compares in
            confidence = mx.zeros(size, sure.dtype)
        token[mx.array(rows)] = chosen
        confidence[mx.array(rows)] = sure
    return token, confidence


def _stops(confidences: list[mx.array], deciding: list[int], thresholds: mx.array, counted_from: mx.array,
           ks: mx.array) -> mx.array:
    """For each deciding row (``deciding``, with its ``thresholds``, first counted step and k)
    and each draft step so far, whether the row stops at that step's token: the token is below
    the row's threshold, past its floor and within its k. One comparison for the loop's early
    stop and for the proposal's cut, in the draft's own dtype, as the single-sequence decoder
    compares (a threshold rounds to it: bfloat16's 0.9 is 0.8984375)."""
    so_far = mx.stack(confidences, axis=1)[mx.array(deciding)]
    step = mx.arange(so_far.shape[1])[None, :]
    below = so_far < thresholds.astype(so_far.dtype)[:, None]
    return below & (step >= counted_from[:, None]) & (step < ks[:, None])


def _floor(sequence: _Sequence, k: int) -> int:
    """The draft tokens a row proposes this round whatever the draft's confidence: one under
    the confidence policy, which decides on every token after it; its k otherwise."""
    return min(k, 1) if sequence.policy is not None and sequence.policy.mode == "confidence" else k


class _Plain:
    """The draft-length policy of a target-only row: it learns nothing."""

    mode = "plain"

    def observe(self, accepted: int, candidates: int, proposed: int) -> None:
        pass


_PLAIN = _Plain()


def stream_batch(
    target: LoadedModel,
    draft: LoadedModel | None,
    requests: list[tuple[Prompt, DecodingParams]],
    max_batch: int | None = None,
    probe: Probe | None = None,
    chat: bool | None = None,
) -> Iterator[SequenceEvent]:
    """Decode every request (prompt, params) in continuous batches; events keyed by request index."""
    longest = max((params.max_tokens for _, params in requests), default=0) + 512
    decoder = BatchDecoder(target, draft, max_batch, probe, longest)
    for index, (prompt, params) in enumerate(requests):
        decoder.add(index, prompt, params, chat)
    while decoder:
        yield from decoder.step()


def kv_bytes_per_sequence(target: LoadedModel, draft: LoadedModel | None, longest: int) -> int:
    """The bytes of KV cache one sequence of ``longest`` target tokens fills in both models: the
    draft's holds its own tokens of the same text (:func:`draft_tokens_per_target_token`, at
    least one a target token), and a cache grows past its prompt a step of entries at a time.
    Left padding the rows share (under 64 entries, see :mod:`~polspec.decoding.batch_kv`) and a
    round's draft proposals are left to the slack of :data:`~polspec.decoding.batch_kv.MEMORY_SHARE`."""
    def entries(tokens: float) -> int:
        return math.ceil(tokens) + BatchKVCache.step

    size = batch_kv.kv_bytes_per_token(target.model, target.entry.alias) * entries(longest)
    if draft is not None:
        per_token = batch_kv.kv_bytes_per_token(draft.model, draft.entry.alias)
        size += per_token * entries(longest * max(1.0, draft_tokens_per_target_token(target, draft)))
    return size


def draft_tokens_per_target_token(target: LoadedModel, draft: LoadedModel) -> float:
    """The most tokens the draft takes for one of the target's on a text of Polish prose (the
    dozen shipped in ``polish-texts.jsonl``, each on its own: a batch is sized for its longest
    sequence). SmolLM2 takes 1.4-1.9 for one of Gemma-3's, 1.6 over all of them."""
    texts = polish_texts()

    def tokens(loaded: LoadedModel) -> list[int]:
        return [len(ids) for ids in loaded.tokenizer._tokenizer(texts, add_special_tokens=False)["input_ids"]]

    return max(ours / theirs for ours, theirs in zip(tokens(draft), tokens(target)))


def max_batch_size(target: LoadedModel, draft: LoadedModel | None, longest: int, cap: int = 64) -> int:
    """The most sequences of ``longest`` tokens (prompt plus generation) that memory holds at once.

    Counts each sequence's KV cache in both models (:func:`kv_bytes_per_sequence`) and its
    logits over the widest round; a PolspecError when not even one sequence fits.
    """
    logits = 4 * (vocabulary_size(target.model) + (vocabulary_size(draft.model) if draft else 0)) * 2 * (DecodingParams().k_max + 1)
    per_sequence = kv_bytes_per_sequence(target, draft, longest) + logits
    budget = batch_kv.free_memory_bytes() * batch_kv.MEMORY_SHARE
    fits = int(budget // per_sequence)
    if fits < 1:
        raise PolspecError(
            f"one sequence of {longest} tokens needs {per_sequence / 1e9:.2f} GB of KV cache and logits, "
            f"but only {budget / 1e9:.2f} GB is free here: shorten the prompt or max_tokens, or free memory")
    return min(fits, cap)


def best_batch_size(target: LoadedModel, draft: LoadedModel | None, probe: Probe | None, longest: int,
                    max_step_s: float | None = None) -> int:
    """The batch size for bulk decoding: the probe's
    :func:`~polspec.decoding.costmodel.throughput_batch_size` (with plain steps of at most
    ``max_step_s``), capped by what memory holds for ``longest`` tokens a sequence. Without a
    probe's batch table to read the step from, a plain step is timed at that size, which halves
    until its step takes at most ``max_step_s``."""
    size = min(throughput_batch_size(probe, max_step_s), max_batch_size(target, draft, longest))
    if max_step_s is not None and not (probe and probe.batch):
        while size > 1 and plain_step_s(target, size) > max_step_s:
            size //= 2
    return size
