"""The sampler's distribution and draws, and speculative sampling across tokenizers (TLI):
the acceptance rule keeps the target's distribution exactly, the shared vocabulary maps tokens
to their byte twins, and seeds give the same samples alone and in a batch. The chi-square tests
through the decoders on real models are beside the other sampled-distribution tests
(test_decoding, test_batch, test_draft_vocab)."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_top_p

from polspec.decoding import DecodingParams, generate, sampling
from polspec.decoding.batch import stream_batch
from polspec.decoding.sampling import NUCLEUS_BOUND, draw_in_proportion, fine_uniform, nucleus, sampling_probabilities
from polspec.decoding.draft_vocab import draft_head
from polspec.decoding.speculative_sampling import (SharedDraft, _byte_twins, accept_in_proportion, shared_vocabulary,
                                                   speculative_choices)

from decoding_checks import OPEN_PROMPT, chi_square_critical, goodness_of_fit, sampled_sequences, two_token_bins

DRAWS = 4000


def first_token_fit(tokens: np.ndarray, p: np.ndarray) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of drawn tokens against the distribution ``p``."""
    observed = np.bincount(tokens, minlength=len(p))
    likely = p * len(tokens) >= 5
    cells = [(observed[likely], len(tokens) * p[likely])]
    rest = (observed[~likely].sum(), len(tokens) * p[~likely].sum())
    statistic = float(((cells[0][0] - cells[0][1]) ** 2 / cells[0][1]).sum())
    if rest[1] > 1e-9:
        statistic += (rest[0] - rest[1]) ** 2 / rest[1]
    return statistic, int(likely.sum()) - (0 if rest[1] > 1e-9 else 1)


def tempered_top_k(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """The sampler's distribution without top-p, in float64: the ``top_k`` most likely tokens
    (all where 0), then the temperature."""
    scores = logits.astype(np.float64)
    if top_k:
        scores = np.where(scores < np.sort(scores, axis=-1)[:, [-top_k]], -np.inf, scores)
    weights = np.exp((scores - scores.max(axis=-1, keepdims=True)) / temperature)
    return weights / weights.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("temperature, top_p, top_k", [(0.7, 1.0, 0), (1.3, 1.0, 40), (0.7, 0.9, 0), (1.0, 0.95, 50)])
def test_the_sampler_distribution_is_the_same_with_numpy_or_mlx_computing_exp(monkeypatch, temperature, top_p, top_k):
    """Rows over a 262k vocabulary, some tokens masked (as the draft's are under TLI): the
    distribution is the float64 reference's without top-p, and the same to float rounding
    whether exp runs through numpy (Linux CPU) or MLX (elsewhere)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (3, 262_144)).astype(np.float32)
    logits[:, rng.integers(0, 2, 262_144).astype(bool)] = -np.inf
    logits[:, :5] += 20  # a few likely tokens, so top-p keeps a nucleus smaller than the vocabulary
    params = DecodingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    computed = {}
    for numpy_exp in (True, False):
        monkeypatch.setattr(sampling, "NUMPY_EXP", numpy_exp)
        computed[numpy_exp] = np.array(sampling_probabilities(mx.array(logits), params))
        assert (computed[numpy_exp][np.isinf(logits)] == 0).all()
    np.testing.assert_allclose(computed[True], computed[False], rtol=1e-5, atol=1e-12)
    if top_p == 1:
        np.testing.assert_allclose(computed[True], tempered_top_k(logits, temperature, top_k), rtol=1e-4, atol=1e-12)


@pytest.mark.parametrize("top_k", [262_144, 300_000])
def test_a_top_k_of_the_vocabulary_or_more_keeps_every_token(top_k):
    logits = np.random.default_rng(1).normal(0, 3, (2, 262_144)).astype(np.float32)
    logits[:, :5] += 20  # as in the test above: float32 sums over a flat 262k row drift by 1e-4
    computed = sampling_probabilities(mx.array(logits), DecodingParams(temperature=0.7, top_k=top_k))
    np.testing.assert_allclose(np.array(computed), tempered_top_k(logits, 0.7, 0), rtol=1e-4, atol=1e-12)


def test_a_draw_in_proportion_follows_the_weights_and_never_draws_a_zero_weight():
    weights = np.array([0.0, 5.0, 0.0, 2.0, 3.0, 0.0])  # unnormalized; the last index weighs nothing
    drawn = np.array(draw_in_proportion(mx.broadcast_to(mx.array(weights), (DRAWS, 6)), mx.random.key(1)))
    assert set(drawn.tolist()) == {1, 3, 4}
    statistic, df = first_token_fit(drawn, weights / weights.sum())
    assert statistic < chi_square_critical(df), (statistic, np.bincount(drawn))
    statistic, df = first_token_fit(drawn, np.array([0.0, 0.2, 0.0, 0.5, 0.3, 0.0]))  # the check can fail
    assert statistic > chi_square_critical(df)
    # A row of zeros (p = q in the residual) gives the last index, which is never used.
    assert np.array(draw_in_proportion(mx.zeros((2, 6)), mx.random.key(1))).tolist() == [5, 5]


def test_a_draw_in_proportion_reaches_the_tail_of_a_large_vocabulary():
    """A million tokens each 2**-24 as likely as a leading one hold 6% of the mass. Summed in
    float32 after the leader they added nothing, and were never drawn."""
    tail = 2**20
    weights = mx.concatenate([mx.array([1.0]), mx.full((tail,), 2.0**-24)])
    drawn = np.concatenate([np.array(draw_in_proportion(mx.broadcast_to(weights, (16, tail + 1)), mx.random.key(seed)))
                            for seed in range(20)])
    in_tail = tail * 2.0**-24 / (1 + tail * 2.0**-24)
    observed = np.array([(drawn == 0).sum(), (drawn > 0).sum()])
    expected = len(drawn) * np.array([1 - in_tail, in_tail])
    assert ((observed - expected) ** 2 / expected).sum() < chi_square_critical(1), observed
    assert drawn.max() > tail // 2  # the far end of the tail too


@pytest.mark.slow
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95])
def test_the_nucleus_is_mlx_lms_whether_or_not_the_bounded_sort_holds_it(gemma3, top_p):
    """Gemma-3's real next-token distributions (262k tokens) at every position of a Polish
    sentence, next to one too flat for its most likely tokens to hold top_p, in one call:
    every row keeps what mlx-lm's full-sort ``apply_top_p`` keeps, but for the one token at
    the edge where the two sums of top_p of the mass round apart, and exactly what it keeps
    when filtered alone."""
    ids = gemma3.tokenizer.encode("Wisła jest najdłuższą rzeką Polski i płynie przez Kraków oraz Warszawę.")
    logits = gemma3.model(mx.array([ids]))[0]
    rows = mx.concatenate([logits, logits[-1:] * 0.02])
    rows = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    filtered = nucleus(rows, top_p)
    ours, reference = np.isfinite(np.array(filtered)), np.isfinite(np.array(apply_top_p(rows, top_p)))
    assert reference[-1].sum() > NUCLEUS_BOUND and (ours[-1] == reference[-1]).all()
    for kept, expected, probabilities in zip(ours, reference, np.exp(np.array(rows))):
        if (kept != expected).any():
            assert (kept != expected).sum() == 1 and abs(probabilities[kept & expected].sum() - top_p) < 1e-3
    for i in (0, len(ids) - 1, len(ids)):
        assert mx.array_equal(filtered[i], nucleus(rows[i : i + 1], top_p)[0]).item()


@pytest.mark.parametrize("temperature, top_p, top_k", [(0.7, 0.9, 0), (1.0, 1.0, 3)])
def test_speculative_choices_commit_exactly_the_target_distribution(temperature, top_p, top_k):
    """Many independent candidate positions in one call: each position's choice (the draft's
    token where accepted, else a residual draw) must follow the sampler's ``p``, whatever the
    draft's ``q``; and accepting everything the draft drew (the negative control) must not."""
    params = DecodingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    target_logits = mx.array([[2.0, 1.5, 1.0, 0.4, 0.0, -0.5, -1.0, -3.0]])
    p = np.array(sampling_probabilities(target_logits, params)[0], dtype=np.float64)
    q = np.array([0.05, 0.4, 0.1, 0.2, 0.05, 0.1, 0.05, 0.05])  # a draft that likes the wrong tokens
    drafted = np.random.default_rng(0).choice(len(q), size=DRAWS, p=q)
    logits = mx.repeat(target_logits, DRAWS + 1, axis=0)
    draft_probabilities = mx.repeat(mx.array(q[None], dtype=mx.float32), DRAWS, axis=0)
    choices = np.array(speculative_choices(logits, drafted.tolist(), draft_probabilities, params, seed=5, position=0))

    statistic, df = first_token_fit(choices[:DRAWS], p)
    assert statistic < chi_square_critical(df), (statistic, df, np.bincount(choices[:DRAWS]), p)
    accepted = (choices[:DRAWS] == drafted).mean()
    overlap = np.minimum(p, q).sum()  # the acceptance speculative sampling promises
    assert abs(accepted - overlap) < 4 * np.sqrt(overlap * (1 - overlap) / DRAWS), (accepted, overlap)
    assert 0 < p[choices[DRAWS]]  # the bonus token after the last candidate comes from p too

    statistic, df = first_token_fit(drafted, p)
    assert statistic > chi_square_critical(df), "the check cannot tell the draft's distribution from the target's"


def test_acceptance_resolves_chances_finer_than_float32():
    """A candidate is accepted exactly where the 46-bit uniform number times q falls below p: a
    p 1e-12 above or below that product decides it (MLX's float32 uniform numbers would not)."""
    key = mx.random.key(3)
    threshold = np.array(fine_uniform((DRAWS,), key)) * 0.25
    for scale, accepted in ((1 + 1e-12, True), (1 - 1e-12, False)):
        decided = np.array(accept_in_proportion(mx.array(threshold * scale, dtype=mx.float64),
                                                mx.full((DRAWS,), 0.25), key))
        assert (decided == accepted).all(), (scale, decided.mean())


def test_a_rejection_that_leaves_no_residual_draws_from_p():
    """A q at least p everywhere (rounding can make p and q so) leaves max(0, p - q) empty; a
    rejected candidate is then replaced by a draw from p, not by the last token, which p can
    rule out. Here q puts twice p's mass on token 0: choices follow half token 0, half p."""
    params = DecodingParams(temperature=1.0, top_k=3)
    target_logits = mx.array([[1.0, 0.9, 0.8, 0.4, 0.0, -3.0]])
    p = np.array(sampling_probabilities(target_logits, params)[0], dtype=np.float64)
    assert p[-1] == 0
    q = p.copy()
    q[0] *= 2
    draft_probabilities = mx.repeat(mx.array(q[None], dtype=mx.float32), DRAWS, axis=0)
    choices = np.array(speculative_choices(mx.repeat(target_logits, DRAWS + 1, axis=0), [0] * DRAWS,
                                           draft_probabilities, params, seed=2, position=0))[:DRAWS]
    expected = 0.5 * p + 0.5 * np.eye(len(p))[0]
    statistic, df = first_token_fit(choices, expected)
    assert statistic < chi_square_critical(df), (statistic, np.bincount(choices, minlength=len(p)), expected)
    assert p[choices].min() > 0


def test_draws_depend_on_seed_and_position_only():
    params = DecodingParams(temperature=1.0)
    logits = mx.zeros((3, 50))
    q = mx.full((2, 50), 1 / 50)
    same = [np.array(speculative_choices(logits, [1, 2], q, params, seed=3, position=7)) for _ in range(2)]
    assert (same[0] == same[1]).all()
    for seed, position in [(4, 7), (3, 8)]:  # another seed, another position: each alone changes the draws
        assert (np.array(speculative_choices(logits, [1, 2], q, params, seed=seed, position=position)) != same[0]).any()


@pytest.mark.slow
def test_the_shared_vocabulary_maps_tokens_to_their_byte_twins(gemma3, smollm2):
    shared = shared_vocabulary(gemma3, smollm2)
    draft, target = smollm2.tokenizer._tokenizer, gemma3.tokenizer._tokenizer
    for word in (" w", " na", ".", " i", " the"):
        [draft_id], [target_id] = draft.encode(word, add_special_tokens=False), target.encode(word, add_special_tokens=False)
        assert shared.to_target[draft_id] == target_id, word
    assert shared.to_target[smollm2.tokenizer.eos_token_id] == gemma3.tokenizer.eos_token_id
    assert 0.8 < shared.size / len(shared.to_target) < 1  # SmolLM2's tokens are mostly in Gemma-3's large vocabulary
    # Every end-of-sequence token of the draft stands for the target's: q there is their sum.
    draft_eos = sorted(set(smollm2.tokenizer.eos_token_ids))
    head = draft_head(smollm2, "full")
    sampler = SharedDraft(head, shared, smollm2)
    q = mx.zeros(sampler.shared.size).at[mx.array(draft_eos)].add(1 / len(draft_eos))
    in_target = np.array(sampler.in_target_space([q], 262_144)[0])
    assert in_target[gemma3.tokenizer.eos_token_id] == pytest.approx(1.0) and in_target.sum() == pytest.approx(1.0)
    # Gemma-3's one-token words that SmolLM2 splits propose all of SmolLM2's tokens of them, and
    # the proposal goes on after them.
    reverse = shared_vocabulary(smollm2, gemma3)
    [polska] = target.encode(" Polska", add_special_tokens=False)
    pieces = draft.encode(" Polska", add_special_tokens=False)
    assert len(pieces) > 1 and reverse.to_target[polska] == pieces[0] and not reverse.twin[polska]
    assert reverse.pieces[polska][: len(pieces)].tolist() == pieces and reverse.whole[polska]
    [w] = target.encode(" w", add_special_tokens=False)
    proposer = SharedDraft(draft_head(gemma3, "full"), reverse, gemma3)
    [draft_w] = draft.encode(" w", add_special_tokens=False)
    assert proposer.candidates([w, polska, w], cap=10) == [draft_w, *pieces, draft_w]
    assert proposer.candidates([w, polska, w], cap=2) == [draft_w, pieces[0]]
    identity = shared_vocabulary(gemma3, gemma3)
    assert (identity.to_target == np.arange(len(identity.to_target))).all()


def test_a_sentencepiece_target_s_dummy_prefix_is_no_proposal(tokenizer_of):
    """Bielik-11B's Mistral tokenizer puts a dummy-prefix ``▁`` in front of any text it encodes
    alone: every SmolLM2 token without a twin there (`` Warsaw``) proposed that lone ``▁``, which
    the target all but never samples, and no proposal went on after one."""
    draft, target = tokenizer_of("smollm2-135m"), tokenizer_of("tok:mistral-32k")
    shared = _byte_twins(draft, target, (), None)
    [warsaw] = draft.encode(" Warsaw", add_special_tokens=False)
    assert target.convert_ids_to_tokens(shared.pieces[warsaw][shared.pieces[warsaw] >= 0].tolist()) == ["▁Wars", "aw"]
    assert shared.whole[warsaw]
    lone_prefix = target.convert_tokens_to_ids("▁")
    assert not (shared.to_target[~shared.twin] == lone_prefix).any()
    assert shared.whole[~shared.twin & (shared.to_target >= 0)].mean() > 0.95  # SmolLM2's split tokens go on


@pytest.mark.slow
def test_a_split_draft_tokens_later_pieces_are_drawn_from_the_drafts_conditional(gemma3, smollm2):
    """Gemma-3 proposing for SmolLM2, which splits its Polish words: the distribution each
    candidate was drawn from is, for a word's first piece, the draft's mass on every token that
    starts with it, and for a later piece the draft's mass on the tokens that start with the
    pieces before it and go on, by their next piece; counted here token by token."""
    shared = shared_vocabulary(smollm2, gemma3)
    proposer = SharedDraft(draft_head(gemma3, "full"), shared, gemma3)
    target = gemma3.tokenizer._tokenizer
    [polska] = target.encode(" Polska", add_special_tokens=False)
    [w] = target.encode(" w", add_special_tokens=False)
    ids = gemma3.tokenizer.encode("Najdłuższa rzeka w")
    logits = gemma3.model(mx.array([ids]))[0, -1:].astype(mx.float32)
    probabilities = [mx.softmax(mx.where(proposer.shared, logits[0], -mx.inf))] * 2
    candidates = proposer.candidates([polska, w], cap=10)
    rows = np.array(proposer.distributions([polska, w], probabilities, len(candidates), 49_152))
    assert rows.shape == (len(candidates), 49_152) and np.allclose(rows.sum(axis=1), 1, atol=1e-3)
    q = np.array(probabilities[0], dtype=np.float64)
    pieces = shared.pieces[: len(q)]
    for index, piece in enumerate(candidates[:-1]):
        starts = (pieces[:, :index] == candidates[:index]).all(axis=1) & (pieces[:, index] >= 0)
        expected = np.bincount(pieces[starts, index], weights=q[starts], minlength=49_152)
        assert np.allclose(rows[index], expected / expected.sum(), rtol=1e-3, atol=1e-6), index
        assert rows[index][piece] > 0
    first = np.bincount(np.maximum(pieces[:, 0], 0), weights=q * (pieces[:, 0] >= 0), minlength=49_152)
    assert np.allclose(rows[-1], first, rtol=1e-3, atol=1e-6)  # " w": the next draft token's first piece
    assert 0 < rows[1][candidates[1]] < 1  # other words start with " Pol" too, and go on otherwise


@pytest.mark.slow
def test_speculative_sampling_keeps_the_target_distribution_through_split_words(gemma3, smollm2):
    """SmolLM2 sampling (temperature 0.7) with Gemma-3 drafting, one draft token a round: the
    draft's Polish words are several SmolLM2 tokens, so a round verifies a word's pieces one
    after another; two-token samples still follow SmolLM2's exact joint distribution, and some
    were decided wholly by one split draft word (three tokens a sample: a round verifies no more
    candidates than the tokens left can use, one fewer than those)."""
    samples = 80
    bins = two_token_bins(smollm2, OPEN_PROMPT, 0.7, samples)
    params = [DecodingParams(seed=s, max_tokens=3, temperature=0.7, k=1, verify="tli") for s in range(samples)]
    metrics: list = []
    sequences = [ids[:2] for ids in sampled_sequences(smollm2, gemma3, OPEN_PROMPT, params, metrics=metrics)]
    assert any(m.rounds == 1 and m.draft_tokens == 1 and m.candidates_accepted == 2 for m in metrics)
    statistic, df = goodness_of_fit(sequences, bins)
    assert df >= 3, f"too few likely sequences to test the distribution: {bins}"
    assert statistic < chi_square_critical(df), (statistic, df, Counter(map(tuple, sequences)).most_common(5))


@pytest.mark.slow
def test_a_top_k_larger_than_the_pruned_draft_vocabulary_drafts_from_all_of_it(gemma3, smollm2):
    """smollm2-135m drafts from its 16,384 most frequent tokens, fewer than top-k 20,000 (under
    Gemma-3's 262k), which mlx-lm's top-k cannot take: the decoder still drafts and decodes.
    (That such a top-k keeps every token: the test of sampling_probabilities above.)"""
    params = DecodingParams(seed=1, max_tokens=6, temperature=0.7, top_k=20_000, k=2, verify="tli")
    result = generate(gemma3, smollm2, "Stolicą Polski jest Warszawa, która", params, chat=False)
    assert result.metrics.verify == "tli" and result.metrics.draft_tokens > 0 and len(result.token_ids) == 6


@pytest.mark.slow
def test_a_seed_gives_the_same_tli_samples_alone_and_in_any_batch(gemma3, smollm2):
    prompt = "Stolicą Polski jest Warszawa, która"
    params = DecodingParams(seed=11, max_tokens=8, temperature=0.7, k=2, verify="tli")
    alone = generate(gemma3, smollm2, prompt, params, chat=False)
    assert alone.metrics.verify == "tli" and alone.metrics.draft_tokens > 0
    others = [("Kraków jest", DecodingParams(seed=1, max_tokens=5, temperature=1.0, k=3, verify="tli")),
              ("W lesie rosną", DecodingParams(seed=2, max_tokens=9, temperature=0.8, k="confidence", verify="exact")),
              ("Gdańsk", DecodingParams(seed=3, max_tokens=4, k=1))]
    tokens: Counter = Counter()
    batched: dict[int, list[int]] = {}
    for event in stream_batch(gemma3, smollm2, [*others, (prompt, params)], max_batch=4, chat=False):
        batched.setdefault(event.key, [])
        if event.commit:
            batched[event.key] += event.commit.tokens
        if event.finished:
            tokens[event.metrics.verify] += 1
    assert batched[3] == alone.token_ids
    assert tokens == {"tli": 2, "exact": 2}  # greedy rows verify by exact match
