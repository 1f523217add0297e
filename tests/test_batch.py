"""The batched decoder on real models: lossless per sequence at every batch size, continuous
batching (join, leave, cancel), ragged caches, the sampled distribution and per-sequence seeds."""

from __future__ import annotations

import time
from collections import Counter
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from polspec.decoding import DecodingParams, batch_kv, generate
from polspec.decoding import batch as batch_module
from polspec.decoding.acceptance import forget_estimates
from polspec.decoding.batch import BatchDecoder, kv_bytes_per_sequence, max_batch_size, stream_batch
from polspec.decoding.costmodel import BatchCost, Probe
from polspec.decoding.draft_vocab import polish_texts
from polspec.decoding.run import encode_prompt
from polspec.decoding.translate import STRATEGIES
from polspec.errors import PolspecError
from polspec.models.loader import load_model

from decoding_checks import (
    OPEN_PROMPT, assert_same_or_float_tie, chi_square_critical, goodness_of_fit, sampled_sequences, two_token_bins,
)

pytestmark = pytest.mark.slow

# Prompts of different lengths; each asks for its own number of tokens, so sequences finish
# (and free their slots) at different rounds.
PROMPTS = [
    "Kraków jest", "Stolicą Polski jest Warszawa, która leży nad Wisłą i od wieków", "W lesie rosną",
    "Maria Skłodowska-Curie była", "Najlepszy przepis na pierogi z kapustą i grzybami zaczyna się od",
    "Gdańsk", "Fryderyk Chopin skomponował", "Źródła Wisły leżą w Beskidzie Śląskim, a sama rzeka",
]


# Prompts decoded at B = 1: each joins an empty batch and leaves it, as the first did (the
# later prompts differ in length, which matters only beside other rows).
ONE_AT_A_TIME = 2


def max_tokens(index: int) -> int:
    return 5 + 2 * (index % 4)


@pytest.fixture(scope="module")
def single():
    """Single-sequence target-only greedy ids per (target, prompt index), computed once."""
    results: dict[tuple[str, int], list[int]] = {}

    def ids(target, index: int) -> list[int]:
        key = (target.entry.alias, index)
        if key not in results:
            params = DecodingParams(max_tokens=max_tokens(index))
            results[key] = generate(target, None, PROMPTS[index], params, chat=False).token_ids
        return results[key]

    return ids


def decode_all(target, draft, batch: int, prompts: int = len(PROMPTS), rows: tuple[dict, ...] = ({},),
               **params) -> tuple[dict[int, list[int]], dict[int, object]]:
    """The first ``prompts`` of PROMPTS decoded ``batch`` at a time: tokens and metrics by index.
    Each request has ``params`` and the settings of ``rows`` in turn (rows of one batch decoding
    with different settings)."""
    requests = [(prompt, DecodingParams(max_tokens=max_tokens(i), **params, **rows[i % len(rows)]))
                for i, prompt in enumerate(PROMPTS[:prompts])]
    tokens: dict[int, list[int]] = {i: [] for i in range(prompts)}
    metrics = {}
    for event in stream_batch(target, draft, requests, max_batch=batch, chat=False):
        if event.commit is not None:
            tokens[event.key] += event.commit.tokens
        if event.finished:
            metrics[event.key] = event.metrics
    return tokens, metrics


def assert_lossless(target, single, tokens) -> None:
    for index, ids in tokens.items():
        assert_same_or_float_tie(target, PROMPTS[index], single(target, index), ids)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_batched_target_only_equals_single_sequence_decoding(gemma3, single, batch):
    tokens, metrics = decode_all(gemma3, None, batch, prompts=ONE_AT_A_TIME if batch == 1 else len(PROMPTS))
    assert_lossless(gemma3, single, tokens)
    assert max(m.batch_size for m in metrics.values()) == pytest.approx(min(batch, len(PROMPTS)))


# Each strategy's settings, as rows of a batch.
STRATEGY_ROWS = tuple({"strategy": name, "partial_word": partial_word or "verify"}
                      for name, _, partial_word in (s.partition("/") for s in (*STRATEGIES, "aligned/hold")))


# The default strategy one at a time and at B = 8; every strategy as rows of one batch of
# B = 3, each row its own, with late joins (translation is per row, so the default strategy's
# rows among them are what it would do alone at B = 3; joining does not depend on the strategy).
@pytest.mark.parametrize("strategy, batch", [("aligned", 1), ("aligned", 8), ("each row its own", 3)])
def test_batched_speculative_is_lossless_for_every_strategy(gemma3, smollm2, single, strategy, batch):
    rows = STRATEGY_ROWS if strategy == "each row its own" else ({"strategy": strategy},)
    tokens, metrics = decode_all(gemma3, smollm2, batch, prompts=ONE_AT_A_TIME if batch == 1 else len(PROMPTS), k=2,
                                 rows=rows)
    assert_lossless(gemma3, single, tokens)
    assert sum(m.draft_tokens for m in metrics.values()) > 0
    assert all(m.finish_reason in ("length", "stop") for m in metrics.values())


def test_batched_speculative_with_a_sliding_window_draft_and_every_policy(smollm2, gemma3, single):
    """Rows of one batch under each k policy in turn and a late join, the draft a sliding-window model."""
    tokens, metrics = decode_all(smollm2, gemma3, 3, prompts=4, rows=({"k": "heuristic"}, {"k": "confidence"}, {"k": 3}))
    assert_lossless(smollm2, single, tokens)
    assert all(metrics[index].draft_tokens > 0 for index in range(3)), [m.draft_tokens for m in metrics.values()]


def test_the_confidence_policy_drafts_no_step_past_what_every_row_proposes(gemma3, smollm2, single, monkeypatch):
    """A row sure of its tokens stops at its k (2); a row unsure of them stops after its first.
    Each round the batch drafts as many steps as its longest proposal (it drafted up to the
    second row's k, 8, while the first stayed sure), and both rows decode what the target alone does."""
    steps, rounds = [], []
    draft_step, propose = batch_module._draft_step, BatchDecoder._propose

    def counted(heads, features, sequences, step, ks, confidence_needed):
        steps.append(step)
        return draft_step(heads, features, sequences, step, ks, confidence_needed)

    def recorded(self, ks, floors):
        before = len(steps)
        proposals = propose(self, ks, floors)
        rounds.append((len(steps) - before, max(map(len, proposals))))
        return proposals

    monkeypatch.setattr(batch_module, "_draft_step", counted)
    monkeypatch.setattr(BatchDecoder, "_propose", recorded)
    requests = [(PROMPTS[index], DecodingParams(max_tokens=max_tokens(index), k="confidence", k_max=k_max,
                                                 confidence=confidence))
                for index, k_max, confidence in [(0, 2, 0.001), (1, 8, 0.999)]]
    tokens: dict[int, list[int]] = {0: [], 1: []}
    for event in stream_batch(gemma3, smollm2, requests, max_batch=2, chat=False):
        if event.commit is not None:
            tokens[event.key] += event.commit.tokens
    assert rounds and all(drafted == longest for drafted, longest in rounds), rounds
    assert_lossless(gemma3, single, tokens)


def test_a_half_precision_draft_keeps_its_dtype_for_the_confidence_cut_through_several_heads(gemma3, single,
                                                                                              monkeypatch):
    """Rows drafting through different output layers (the full vocabulary and a pruned one) of a
    bfloat16 draft: each step's confidences stay bfloat16, the dtype the cut compares a row's
    threshold in, as the single-sequence decoder does (they were gathered into float32, where
    bfloat16's 0.8984375 is below a threshold of 0.9), and both rows decode what the target
    alone does."""
    draft = load_model("smollm2-135m")
    draft.model.set_dtype(mx.bfloat16)
    seen = set()  # (heads, dtype of the confidences) of each draft step
    draft_step = batch_module._draft_step

    def recorded(heads, features, sequences, step, ks, confidence_needed):
        token, confidence = draft_step(heads, features, sequences, step, ks, confidence_needed)
        if confidence_needed:
            seen.add((len(heads), confidence.dtype))
        return token, confidence

    monkeypatch.setattr(batch_module, "_draft_step", recorded)
    requests = [(PROMPTS[index], DecodingParams(max_tokens=max_tokens(index), k="confidence", confidence=0.9,
                                                draft_vocab=vocabulary))
                for index, vocabulary in [(0, "full"), (1, 8192)]]
    tokens: dict[int, list[int]] = {0: [], 1: []}
    for event in stream_batch(gemma3, draft, requests, max_batch=2, chat=False):
        if event.commit is not None:
            tokens[event.key] += event.commit.tokens
    assert (2, mx.bfloat16) in seen and {dtype for _, dtype in seen} == {mx.bfloat16}, seen
    assert_lossless(gemma3, single, tokens)


def test_a_sliding_window_target_in_a_batch_is_lossless_past_its_window(gemma3, smollm2, gemma3_window):
    """Rows of different lengths past Gemma-3's window (shrunk to 8): its mask over the batch's
    ragged caches attends to what each row's own rotating cache would hold. Four rows, three
    at a time: one joins late."""
    expected = [generate(gemma3, None, prompt, DecodingParams(max_tokens=max_tokens(index)), chat=False).token_ids
                for index, prompt in enumerate(PROMPTS[:4])]
    for draft in (None, smollm2):
        tokens, _ = decode_all(gemma3, draft, 3, prompts=4, k=2)
        for index, ids in tokens.items():
            assert_same_or_float_tie(gemma3, PROMPTS[index], expected[index], ids)


def test_a_model_drafting_for_itself_in_a_batch_has_every_candidate_accepted(gemma3, single):
    """Full acceptance every round: the bonus token, EOS and trimming of whole rows all run."""
    tokens, metrics = decode_all(gemma3, gemma3, 4, k=3)
    assert_lossless(gemma3, single, tokens)
    for m in metrics.values():
        assert m.candidates_accepted == m.candidates > 0
        assert m.tokens_per_round > 2


def test_sequences_join_and_leave_between_rounds(gemma3, smollm2, single, monkeypatch):
    """Continuous batching: late joins, a cancelled sequence, ragged caches that stay exact, the
    padding every row has cut whenever there is some (past 64 entries in real use)."""
    monkeypatch.setattr(batch_kv, "PADDING_CUT", 1)
    decoder = BatchDecoder(gemma3, smollm2, max_batch=3)
    tokens: dict[int, list[int]] = {}
    finished: dict[int, str] = {}
    prompts = {i: encode_prompt(gemma3, PROMPTS[i], chat=False) for i in range(5)}

    def add(index: int) -> None:
        decoder.add(index, PROMPTS[index], DecodingParams(max_tokens=max_tokens(index), k=2), chat=False)
        tokens[index] = []

    add(0)
    add(1)
    rounds = 0
    while decoder:
        if rounds == 1:
            add(2)
            add(3)
            add(4)  # waits: the batch holds 3
        if rounds == 2:
            decoder.remove(1)
        events = decoder.step()
        rounds += 1
        assert len(decoder) <= 3
        for event in events:
            if event.commit:
                tokens[event.key] += event.commit.tokens
            if event.finished:
                finished[event.key] = event.metrics.finish_reason
        target_rows, _ = decoder.cached_lengths()
        expected = [len(prompts[s.key]) + len(tokens[s.key]) - 1 for s in decoder.rows]
        assert target_rows == expected
    assert finished[1] == "cancelled"
    assert tokens[1] == single(gemma3, 1)[: len(tokens[1])] and len(tokens[1]) < max_tokens(1)
    assert set(finished) == {0, 1, 2, 3, 4}
    for index in (0, 2, 3, 4):
        assert_same_or_float_tie(gemma3, PROMPTS[index], single(gemma3, index), tokens[index])


def test_a_prompt_repeated_in_a_batch_is_fed_once_and_each_of_its_rows_decodes_as_if_alone(gemma3, smollm2, single,
                                                                                            monkeypatch):
    """A sweep's repeats share their prompt's prefill (the target's when they join, the draft's
    when they first propose), and each row still decodes what the prompt gives alone: the
    repeated rows draft at different k, so their caches part after the first round."""
    fed: list[int] = []
    prefill_one, prefill_left_padded = batch_kv.prefill_one, batch_kv._prefill_left_padded

    def counted_alone(model, layers, ids):
        fed.append(len(ids))
        return prefill_one(model, layers, ids)

    def counted_together(model, layers, prompts):
        fed.extend(map(len, prompts))
        return prefill_left_padded(model, layers, prompts)

    monkeypatch.setattr(batch_kv, "prefill_one", counted_alone)
    monkeypatch.setattr(batch_kv, "_prefill_left_padded", counted_together)
    rows = [(0, 1), (2, 2), (0, 2), (0, 3)]  # (prompt index, k)
    requests = [(PROMPTS[i], DecodingParams(max_tokens=max_tokens(i), k=k)) for i, k in rows]
    tokens: dict[int, list[int]] = {key: [] for key in range(len(rows))}
    for event in stream_batch(gemma3, smollm2, requests, max_batch=len(rows), chat=False):
        tokens[event.key] += event.commit.tokens if event.commit else []
    assert len(fed) == 4, fed  # each of the two prompts once for the target, once for the draft
    for key, (index, _) in enumerate(rows):
        assert_same_or_float_tie(gemma3, PROMPTS[index], single(gemma3, index), tokens[key])


def test_a_row_feeds_the_draft_its_prompt_only_when_it_first_proposes(gemma3, smollm2, single):
    """auto on a probe where speculation pays alone but not two at a time: while two rows share
    the batch neither proposes and the draft holds nothing of theirs; once the short one
    leaves, the other's draft is fed its text and it proposes, still lossless."""
    # Verifying two rows at once is dear; feeding the draft is cheap (the row alone pays it back).
    table = (BatchCost(1, (0.10, 0.10, 0.10, 0.10, 0.10), 0.001), BatchCost(2, (0.10, 0.30, 0.40, 0.60, 1.00), 0.002))
    probe = Probe(gemma3.entry.alias, smollm2.entry.alias, c=0.01, rho=(1.0,) * 9, tau=0.0,
                  target_step_s=0.10, draft_step_s=0.001, batch=table, draft_feed_s=0.001)
    decoder = BatchDecoder(gemma3, smollm2, max_batch=2, probe=probe)
    decoder.add(0, PROMPTS[0], DecodingParams(max_tokens=max_tokens(0), k="auto"), chat=False)
    decoder.add(1, PROMPTS[1], DecodingParams(max_tokens=16, k="auto"), chat=False)
    tokens: dict[int, list[int]] = {0: [], 1: []}
    metrics = {}
    while decoder:
        together = len(decoder) == 2 or not tokens[0]
        for event in decoder.step():
            tokens[event.key] += event.commit.tokens if event.commit else []
            metrics[event.key] = event.metrics
        if together:
            assert decoder.cached_lengths()[1] == [0] * len(decoder)
    assert metrics[0].draft_tokens == 0 and metrics[0].plain_rounds == metrics[0].rounds == max_tokens(0)
    assert metrics[0].k_policy_note.startswith("auto: plain decoding every round")  # results say why
    # Plain while together, and in a last round with one token to go (the target's own), if it had one.
    assert metrics[1].draft_tokens > 0 and metrics[1].plain_rounds - max_tokens(0) in (0, 1)
    assert not metrics[1].k_policy_note
    assert tokens[0] == single(gemma3, 0)
    assert_same_or_float_tie(gemma3, PROMPTS[1], generate(gemma3, None, PROMPTS[1], DecodingParams(max_tokens=16),
                                                         chat=False).token_ids, tokens[1])


def test_prompts_fed_together_hold_what_each_holds_fed_alone(gemma3):
    """prefill_groups: prompts within the padding share of each other share a forward, a longer
    one is fed alone, a repeated one is fed once and copied; every row holds the keys and values
    its prompt gets fed alone, its left padding aside (up to float rounding)."""
    text = encode_prompt(gemma3, " ".join(PROMPTS), chat=False)
    prompts = [text[:20], text[1:20], text[2:20], text[:20], text[:45]]  # 20, 19, 18 together; 45 alone
    layers = batch_kv.check_batchable(gemma3.model, gemma3.entry.alias)
    groups = list(batch_kv.prefill_groups(gemma3.model, layers, prompts))
    assert sorted(sorted(rows) for rows, _, _ in groups) == [[0, 1, 2, 3], [4]]
    for rows, cache, _ in groups:
        for position, index in enumerate(rows):
            alone = batch_kv.prefill_one(gemma3.model, layers, prompts[index])
            length = len(prompts[index])
            assert cache[0].offset.tolist()[position] == length
            assert cache[0].left_padding.tolist()[position] + length == cache[0].size()
            for fed, want in zip(cache, alone):
                keys, values = (part[position, :, -length:] for part in fed.keys_and_values())
                assert np.allclose(np.array(keys), np.array(want.keys[0, :, :want.offset]), atol=1e-3)
                assert np.allclose(np.array(values), np.array(want.values[0, :, :want.offset]), atol=1e-3)


# Prompts of (nearly) one length in both tokenizers, so that they are fed together.
SIMILAR = ["Miasto Kraków leży nad Wisłą i jest", "Miasto Gdańsk leży nad morzem i jest",
           "Miasto Poznań leży nad Wartą i jest", "Miasto Wrocław leży nad Odrą i jest"]


def test_prompts_of_similar_length_are_fed_together_and_each_decodes_as_if_alone(gemma3, smollm2, monkeypatch):
    """Rows joining a running batch at once are prefilled in one left-padded forward (the
    target's prompts when they join, the draft's when they first propose), a repeated prompt
    once; every row's cache holds its own text and each decodes what it gives alone."""
    together: list[tuple[object, int]] = []  # (model, prompts) of each forward over several
    prefill_left_padded = batch_kv._prefill_left_padded

    def counted(model, layers, prompts):
        together.append((model, len(prompts)))
        return prefill_left_padded(model, layers, prompts)

    monkeypatch.setattr(batch_kv, "_prefill_left_padded", counted)
    prompts = [PROMPTS[4]] + SIMILAR + SIMILAR[:1]
    ids = [encode_prompt(gemma3, prompt, chat=False) for prompt in prompts]
    params = DecodingParams(max_tokens=6, k=2)
    decoder = BatchDecoder(gemma3, smollm2, max_batch=len(prompts))
    decoder.add(0, prompts[0], params, chat=False)
    tokens: dict[int, list[int]] = {key: [] for key in range(len(prompts))}
    round_ = 0
    while decoder:
        for event in decoder.step():
            tokens[event.key] += event.commit.tokens if event.commit else []
        if round_ == 0:  # the others join a running row
            assert 0 < len(tokens[0]) < 6
            for key in range(1, len(prompts)):
                decoder.add(key, prompts[key], params, chat=False)
        round_ += 1
        target_rows, _ = decoder.cached_lengths()
        assert target_rows == [len(ids[s.key]) - 1 + len(tokens[s.key]) for s in decoder.rows]
    similar = f"the SIMILAR prompts were not fed together (their token counts must stay within {batch_kv.PADDING_SHARE:.0%})"
    assert (gemma3.model, len(SIMILAR)) in together, similar
    assert (smollm2.model, len(SIMILAR)) in together, similar
    for key, prompt in enumerate(prompts):
        alone = generate(gemma3, None, prompt, DecodingParams(max_tokens=6), chat=False).token_ids
        assert len(tokens[key]) == 6
        assert_same_or_float_tie(gemma3, prompt, alone, tokens[key])


def test_a_row_joining_pays_its_own_draft_prompt_feed_in_its_decode_time(gemma3, smollm2, monkeypatch):
    """The draft's feed of a joining row's prompt is that row's cost, as its target prefill is:
    the rows already decoding were charged it in their draft time (a long-lived row of a
    continuous batch paid for every row that joined, and its tokens/s read low). The decoder's
    clock is made to see each draft feed of a prompt take 1000 s, far above the rows' own
    rounds on any machine (a real 3 s sleep was not: on a slow VM a row's rounds took 3.3 s)."""
    perf_counter, feed_s = time.perf_counter, 1000.0
    skipped = [0.0]  # the seconds the decoder's clocks have been moved on
    prefill_one, prefill_left_padded = batch_kv.prefill_one, batch_kv._prefill_left_padded

    def slow_alone(model, layers, ids):
        skipped[0] += feed_s if model is smollm2.model else 0.0
        return prefill_one(model, layers, ids)

    def slow_together(model, layers, prompts):
        skipped[0] += feed_s * len(prompts) if model is smollm2.model else 0.0
        return prefill_left_padded(model, layers, prompts)

    monkeypatch.setattr(batch_kv, "prefill_one", slow_alone)
    monkeypatch.setattr(batch_kv, "_prefill_left_padded", slow_together)
    clock = SimpleNamespace(perf_counter=lambda: perf_counter() + skipped[0])
    monkeypatch.setattr(batch_module, "time", clock)
    monkeypatch.setattr(batch_kv, "time", clock)
    decoder = BatchDecoder(gemma3, smollm2, max_batch=3)
    decoder.add(0, PROMPTS[0], DecodingParams(max_tokens=12, k=2), chat=False)
    metrics = {}
    rounds = 0
    while decoder:
        rounds += 1
        if rounds == 3:  # two join at once: each pays its own feed, not both
            for key in (1, 2):
                decoder.add(key, PROMPTS[key], DecodingParams(max_tokens=4, k=2), chat=False)
        for event in decoder.step():
            metrics[event.key] = event.metrics
    assert all(feed_s <= metrics[key].draft_s < 2 * feed_s for key in (0, 1, 2)), [metrics[key].draft_s for key in (0, 1, 2)]


def test_a_row_alone_under_auto_drafts_past_its_k_while_the_draft_is_sure(gemma3, smollm2):
    """On a probe where verifying more than two positions is dear, ``auto`` chooses k = 1; a
    row alone in the batch still drafts past it on a counting prompt the draft is sure of, as
    a single sequence does, and stays lossless."""
    probe = Probe(gemma3.entry.alias, smollm2.entry.alias, c=0.01, rho=(1.0, 1.0) + (3.0,) * 7, tau=0.0,
                  target_step_s=0.10, draft_step_s=0.001, batch=(BatchCost(1, (0.10,) * 5, 0.001),))
    prompt, params = "1, 2, 3, 4, 5, 6, 7, 8,", DecodingParams(max_tokens=12, k="auto")
    decoder = BatchDecoder(gemma3, smollm2, max_batch=2, probe=probe)
    decoder.add(0, prompt, params, chat=False)
    tokens = []
    while decoder:
        for event in decoder.step():
            tokens += event.commit.tokens if event.commit else []
            metrics = event.metrics
    assert_same_or_float_tie(gemma3, prompt, generate(gemma3, None, prompt, DecodingParams(max_tokens=12),
                                                      chat=False).token_ids, tokens)
    assert metrics.draft_tokens > metrics.rounds - metrics.plain_rounds > 0  # some round drafted more than its k


def test_a_fresh_batch_drafts_on_the_prior_only_where_it_pays_back_the_draft_warm_up(gemma3, smollm2, single):
    """auto on a probe where the pair's prior (a = 0.5) pays two at a time: with nothing seen
    yet, both rows draft from the first round, still lossless; but not where feeding the
    draft their prompts costs more than that speedup saves over the tokens they ask for."""
    def first_round(feed_s: float) -> tuple[list, BatchDecoder]:
        table = (BatchCost(1, (0.10,) * 5, 0.001), BatchCost(2, (0.10, 0.11, 0.12, 0.13, 0.15), 0.002))
        probe = Probe(gemma3.entry.alias, smollm2.entry.alias, c=0.01, rho=(1.0,) * 9, tau=0.0,
                      target_step_s=0.10, draft_step_s=0.001, batch=table, draft_feed_s=feed_s)
        forget_estimates()
        decoder = BatchDecoder(gemma3, smollm2, max_batch=2, probe=probe)
        for index in (1, 4):
            decoder.add(index, PROMPTS[index], DecodingParams(max_tokens=max_tokens(index), k="auto"), chat=False)
        return decoder.step(), decoder

    events, decoder = first_round(0.001)  # 1 ms a prompt token: the warm-up is a fraction of a step
    assert [event.metrics.draft_tokens > 0 for event in events] == [True, True]
    tokens = {event.key: event.commit.tokens for event in events}
    while decoder:
        for event in decoder.step():
            tokens[event.key] += event.commit.tokens if event.commit else []
    for index in (1, 4):
        assert_same_or_float_tie(gemma3, PROMPTS[index], single(gemma3, index), tokens[index])

    events, decoder = first_round(0.010)  # 10 ms a token: several steps, more than a few tokens save
    assert [event.metrics.draft_tokens for event in events] == [0, 0]
    assert decoder.cached_lengths()[1] == [0, 0]


def test_batched_speculative_sampling_keeps_the_target_distribution(gemma3, smollm2):
    """Two-token samples at B = 16 under speculative sampling across tokenizers (TLI) at
    temperature 0.7 with top-p follow the target's exact joint distribution (on a prompt open
    enough at 0.7 for six likely bins besides the rest), and the draft decided some of them."""
    samples = 80
    bins = two_token_bins(gemma3, OPEN_PROMPT, 0.7, samples, top_p=0.9)
    params = [DecodingParams(seed=s, max_tokens=2, temperature=0.7, top_p=0.9, k=2, verify="tli") for s in range(samples)]
    metrics: list = []
    sequences = sampled_sequences(gemma3, smollm2, OPEN_PROMPT, params, metrics=metrics)
    assert sum(m.candidates_accepted for m in metrics) > 0
    statistic, df = goodness_of_fit(sequences, bins)
    assert df >= 3, f"too few likely sequences to test the distribution: {bins}"
    assert statistic < chi_square_critical(df), (statistic, df, Counter(map(tuple, sequences)).most_common(5))


def test_a_seed_gives_the_same_samples_whatever_the_batch_holds(gemma3, smollm2):
    """At a fixed k, by exact match, whose round draws as many numbers as it has candidates,
    which the batch does not change (speculative sampling: test_speculative_sampling)."""
    params = DecodingParams(seed=7, max_tokens=6, temperature=1.0, k=2, verify="exact")
    alone = generate(gemma3, smollm2, PROMPTS[1], params, chat=False).token_ids
    others = [(PROMPTS[i], DecodingParams(seed=100 + i, max_tokens=6, temperature=0.8, k=2, verify="exact"))
              for i in (2, 3, 4)]
    tokens: dict[int, list[int]] = {}
    for event in stream_batch(gemma3, smollm2, [*others, (PROMPTS[1], params)], max_batch=4, chat=False):
        tokens.setdefault(event.key, [])
        if event.commit:
            tokens[event.key] += event.commit.tokens
    assert tokens[3] == alone


def test_memory_bounds_the_batch_with_a_clear_error(gemma3, smollm2):
    assert max_batch_size(gemma3, smollm2, 1024) >= 1
    with pytest.raises(PolspecError, match=r"one sequence of 1000000000 tokens needs [\d.]+ GB of KV cache and logits, "
                                           r"but only [\d.]+ GB is free here"):
        max_batch_size(gemma3, smollm2, 10**9)


def test_the_caches_a_batch_fills_fit_the_memory_estimate_a_sequence(gemma3, smollm2):
    """Free memory over a sequence's estimate sizes a batch, so the caches a batch really fills
    must fit the estimate. It counted a draft token a target token (SmolLM2 takes 1.4-1.9 of
    its tokens for one of Gemma-3's on Polish prose) and no growth: a cache grows past its
    prompt by a step of 256 entries, so these rows held about twice what was counted."""
    prose = polish_texts()
    decoder = BatchDecoder(gemma3, smollm2, max_batch=2)
    for key, prompt in enumerate((" ".join(prose[:2]), prose[3])):  # rows of different lengths
        decoder.add(key, prompt, DecodingParams(max_tokens=8, k=2), chat=False)
    rounds = 0
    while decoder:
        decoder.step()
        if decoder.rows:
            held = sum(layer.keys.nbytes + layer.values.nbytes
                       for layer in decoder.target_cache + decoder.draft_cache) / len(decoder.rows)
            longest = max(len(row.prompt) + len(row.committed) for row in decoder.rows)
            assert held <= kv_bytes_per_sequence(gemma3, smollm2, longest)
            rounds += 1
    assert rounds > 1


def test_a_repeated_key_and_a_bad_prompt_are_refused_before_decoding(gemma3):
    decoder = BatchDecoder(gemma3, None, max_batch=2)
    decoder.add("a", PROMPTS[0], DecodingParams(max_tokens=2), chat=False)
    with pytest.raises(PolspecError, match="a sequence 'a' is already in this batch"):
        decoder.add("a", PROMPTS[1], DecodingParams(max_tokens=2), chat=False)
    with pytest.raises(PolspecError, match="the prompt is empty"):
        decoder.add("b", " ", DecodingParams(max_tokens=2), chat=False)
    with pytest.raises(PolspecError, match="k=auto in a batch needs the pair's probe"):
        BatchDecoder(gemma3, gemma3, max_batch=2).add("c", PROMPTS[0], DecodingParams(k="auto"), chat=False)


def test_the_probe_seen_at_a_batch_size_interpolates_its_batch_table():
    table = (BatchCost(1, (0.10, 0.11, 0.12, 0.14, 0.18), 0.05), BatchCost(4, (0.16, 0.20, 0.24, 0.32, 0.48), 0.08))
    probe = Probe("t", "d", c=0.5, rho=(1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8), tau=0.02,
                  draft_overhead=0.1, target_step_s=0.10, draft_step_s=0.05, batch=table)
    assert probe.at_batch(1) is probe
    at_two = probe.at_batch(2)
    assert at_two.target_step_s == pytest.approx(0.12)  # a third of the way from B=1 to B=4
    assert at_two.c == pytest.approx(0.06 / 0.12)
    assert at_two.rho_at(4) == pytest.approx((0.16 + 0.20) / 2 / 0.12)  # between m = 3 and m = 5
    assert at_two.tau == pytest.approx(0.02 * 0.10 * 2 / 0.12)  # one translation per sequence
    assert probe.at_batch(8).target_step_s == pytest.approx(0.16 + (0.16 - 0.10) / 3 * 4)
    assert Probe.from_dict(probe.as_dict()) == probe


@pytest.mark.slow
def test_an_unseeded_sampled_run_records_the_seed_that_reruns_it(gemma3, smollm2):
    """Without a seed each run draws one; the metrics keep it, and that seed given back repeats
    the text exactly, alone or in a batch, target-only or speculative. (A batch is rerun as the
    same batch: alone and batched forwards may differ by float rounding, which a random seed's
    draw can land on: test_a_seed_gives_the_same_samples_whatever_the_batch_holds checks that
    with fixed seeds.)"""
    def batch_run(draft, requests):
        tokens, seeds = {0: [], 1: []}, {}
        for event in stream_batch(gemma3, draft, requests, chat=False):
            tokens[event.key] += event.commit.tokens if event.commit else []
            seeds[event.key] = event.metrics.seed
        return tokens, seeds

    for draft in (None, smollm2):
        params = DecodingParams(max_tokens=3, temperature=1.0, k=2)
        first = generate(gemma3, draft, PROMPTS[0], params, chat=False)
        assert isinstance(first.metrics.seed, int)
        again = generate(gemma3, draft, PROMPTS[0], DecodingParams(**{**params.as_dict(), "seed": first.metrics.seed}),
                         chat=False)
        assert again.token_ids == first.token_ids and again.metrics.seed == first.metrics.seed
        tokens, seeds = batch_run(draft, [(PROMPTS[0], params), (PROMPTS[1], params)])
        assert seeds[0] != seeds[1]  # each sequence draws its own
        rerun = batch_run(draft, [(PROMPTS[key], DecodingParams(**{**params.as_dict(), "seed": seeds[key]}))
                                  for key in (0, 1)])
        assert rerun == (tokens, seeds)
    assert generate(gemma3, None, PROMPTS[0], DecodingParams(max_tokens=2), chat=False).metrics.seed is None
