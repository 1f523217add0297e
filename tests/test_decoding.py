"""The decoders on real models: lossless greedy output, the sampled distribution, KV caches."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections import Counter

import mlx.core as mx
import pytest
from click.testing import CliRunner

from polspec.cli import main
from polspec.decoding import DecodingParams, generate
from polspec.decoding.acceptance import AcceptanceEstimate
from polspec.decoding.batch import BatchDecoder, stream_batch
from polspec.decoding.costmodel import Probe
from polspec.decoding.draft_vocab import draft_head
from polspec.decoding import kv, speculative
from polspec.decoding.kv import new_cache
from polspec.decoding.metrics import DecodeMetrics
from polspec.decoding.policy import EXTEND_ABOVE, DraftLength
from polspec.decoding.run import encode_prompt, stream
from polspec.decoding.speculative import DraftSide
from polspec.decoding.translate import STRATEGIES, token_bytes
from polspec.errors import PolspecError
from polspec.models.files import model_config

from decoding_checks import (
    SAMPLED_PROMPT, assert_same_or_float_tie, chi_square_critical, goodness_of_fit, sampled_sequences, two_token_bins,
)

PROMPTS = [
    "Kraków jest", "Stolicą Polski jest Warszawa, która", "Wisła to najdłuższa rzeka", "W lesie rosną",
    "Maria Skłodowska-Curie była", "Najlepszy przepis na pierogi", "Zimą w górach", "Polska leży w",
    "Mój ulubiony poeta to", "Gdańsk słynie z", "Jutro rano pojadę", "Kot siedział na",
    "Historia Polski zaczyna się", "Najwyższym szczytem Tatr", "W szkole uczymy się", "Ryby żyją w",
    "Fryderyk Chopin skomponował", "Na śniadanie zjadłem", "Pociąg do Poznania", "Źródła Wisły leżą",
]
MAX_TOKENS = 8
# POLSPEC_TEST_FULL_GRID=1 runs all 20 prompts for every pair, strategy and k (about 30
# minutes here). By default the grid is sampled to keep the suite within minutes on a 2-core
# CPU: every strategy runs at k=2 on both pairs, the default configuration (gemma3 target,
# smollm2 draft, aligned, k=2) on 5 prompts (test_batch runs it over 8 more through the batched
# decoder: one at a time, at batch size 8, and as rows of a batch of 3) and the others on one
# or two; at each other k the default pair runs aligned on two prompts, and one more strategy
# per pair and k runs on one, so that each strategy meets a k other than 2 and k=5, the
# longest proposals, meets both pairs.
FULL_GRID = os.environ.get("POLSPEC_TEST_FULL_GRID") == "1"
PAIRS = ("gemma3>smollm2", "smollm2>gemma3")
GRID_STRATEGIES = (*STRATEGIES, "aligned/hold")
KS = (1, 2, 3, 5)
OTHER_K_STRATEGIES = {
    ("gemma3>smollm2", 1): ("aligned", "context"), ("gemma3>smollm2", 3): ("aligned", "naive"),
    ("gemma3>smollm2", 5): ("aligned", "aligned/hold"), ("smollm2>gemma3", 1): ("none",),
    ("smollm2>gemma3", 3): ("aligned/hold",), ("smollm2>gemma3", 5): ("context",),
}
GRID = [(pair, k, strategy) for pair in PAIRS for k in KS for strategy in GRID_STRATEGIES
        if FULL_GRID or k == 2 or strategy in OTHER_K_STRATEGIES[pair, k]]


def prompts_for(pair: str, k: int, strategy: str) -> list[str]:
    """The prompts of a grid case: two or five for the default strategy, else one, each case
    another of the default configuration's five (whose baselines are computed anyway)."""
    if FULL_GRID:
        return PROMPTS
    if strategy == "aligned":
        return PROMPTS[::4] if (pair, k) == ("gemma3>smollm2", 2) else PROMPTS[::10]
    return [PROMPTS[::4][GRID.index((pair, k, strategy)) % 5]]


@pytest.fixture(scope="module")
def baseline():
    """Target-only greedy token ids for (target, prompt), each computed once when first needed."""
    results: dict[tuple[str, str], list[int]] = {}

    def ids(target, prompt: str) -> list[int]:
        key = (target.entry.alias, prompt)
        if key not in results:
            results[key] = generate(target, None, prompt, DecodingParams(max_tokens=MAX_TOKENS), chat=False).token_ids
        return results[key]

    return ids


@pytest.mark.slow
@pytest.mark.parametrize(("pair", "k", "strategy"), [
    pytest.param(pair, k, strategy, id=f"{pair}-{k}-{strategy}") for pair, k, strategy in GRID])
def test_greedy_speculative_equals_greedy_baseline(request, baseline, pair, k, strategy):
    target_name, draft_name = pair.split(">")
    target, draft = request.getfixturevalue(target_name), request.getfixturevalue(draft_name)
    name, _, partial_word = strategy.partition("/")
    params = DecodingParams(max_tokens=MAX_TOKENS, k=k, strategy=name, partial_word=partial_word or "verify")
    for prompt in prompts_for(pair, k, strategy):
        tokens, metrics = decode_checking_caches(target, draft, prompt, params)
        assert_same_or_float_tie(target, prompt, baseline(target, prompt), tokens)
        assert metrics.rounds >= 1 and metrics.candidates_accepted <= metrics.candidates


def decode_checking_caches(target, draft, prompt: str, params: DecodingParams) -> tuple[list[int], DecodeMetrics]:
    """Speculative decoding of ``prompt``, checking after every round but the last (which stops
    before re-syncing the draft) that the caches hold exactly the committed and re-synced
    tokens: the target's the prompt and every committed token but the pending last, the
    draft's what it was fed, and the draft's text plus its lag the committed text."""
    target_bytes, draft_bytes = token_bytes(target.tokenizer._tokenizer), token_bytes(draft.tokenizer._tokenizer)
    prompt_tokens = len(encode_prompt(target, prompt, chat=False))
    metrics, committed, states = DecodeMetrics(), [], []
    for commit in stream(target, draft, prompt, params, metrics, chat=False):
        committed += commit.tokens
        states.append((len(committed), commit.state))
    assert len(states) > 1, "one round checks no cache"
    for length, state in states[:-1]:
        assert state.target_cached == prompt_tokens + length - 1
        assert state.draft_cached == state.draft_fed
        assert draft_bytes.text(state.draft_generated) + state.draft_lag == target_bytes.text(committed[:length])
    return committed, metrics


@pytest.mark.slow
def test_no_round_drafts_a_candidate_the_tokens_left_cannot_use(gemma3, smollm2, baseline):
    """A round with r tokens to go commits at most r, the last the target's own choice after the
    accepted candidates: an r-th candidate was drafted and verified for nothing, and with one
    token to go the whole round was (in a batch its draft prompt was prefilled for it too)."""
    prompt = PROMPTS[0]
    # The row that drafts is warmed and moved behind the other: each row keeps its own budget.
    requests = [(prompt, DecodingParams(max_tokens=tokens, k=4)) for tokens in (2, 1)]
    alone = [generate(gemma3, smollm2, prompt, params, chat=False) for _, params in requests]
    batched = {event.key: event.metrics for event in stream_batch(gemma3, smollm2, requests, max_batch=2, chat=False)
               if event.finished}
    for (_, params), result, metrics in zip(requests, alone, (batched[0], batched[1])):
        assert result.token_ids == baseline(gemma3, prompt)[: params.max_tokens]
        for measured in (result.metrics, metrics):
            assert measured.candidates <= params.max_tokens - 1 and measured.draft_tokens <= params.max_tokens - 1
    assert alone[1].metrics.plain_rounds == alone[1].metrics.rounds == batched[1].plain_rounds == 1
    assert batched[0].draft_tokens == alone[0].metrics.draft_tokens == 1  # the two-token row drafted its one


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["heuristic", "confidence"])
def test_adaptive_draft_lengths_are_lossless(gemma3, smollm2, baseline, policy):
    for prompt in PROMPTS[:3]:
        result = generate(gemma3, smollm2, prompt, DecodingParams(max_tokens=MAX_TOKENS, k=policy), chat=False)
        assert_same_or_float_tie(gemma3, prompt, baseline(gemma3, prompt), result.token_ids)
        assert result.metrics.draft_tokens > 0 and result.metrics.candidates > 0  # the policy drafted


@pytest.mark.slow
def test_auto_drafts_past_its_k_exactly_while_the_draft_is_sure(smollm2):
    """A round of k = 1 under ``auto`` goes on while the draft gives its last token at least
    EXTEND_ABOVE, up to ``most``: its tokens are the draft's greedy ones, every token before
    the last was sure, and the last was not (or the proposal is full). A counting prompt
    runs past k; free text stops at it."""
    auto = DraftLength(DecodingParams(k="auto"), Probe("t", "d", c=0.1, rho=(1.0,) * 9, tau=0.0), AcceptanceEstimate())
    head = draft_head(smollm2, DecodingParams().draft_vocab)

    def greedy_keeping_its_probability(logits: mx.array, step: int) -> tuple[mx.array, mx.array]:
        return mx.argmax(logits), mx.softmax(logits).max()

    lengths = []
    for prompt in ("1, 2, 3, 4, 5, 6, 7, 8,", "Najlepszy przepis na pierogi"):
        ids = encode_prompt(smollm2, prompt, chat=False)
        greedy = DraftSide(smollm2, ids, None, head).propose(8, DraftLength(DecodingParams(k=8)))
        side = DraftSide(smollm2, ids, None, head)
        proposal = side.propose(1, auto, greedy_keeping_its_probability, most=8)
        sure = [p.item() >= EXTEND_ABOVE for p in side.probabilities]
        assert proposal == greedy[: len(proposal)]
        assert all(sure[:-1]) and (len(proposal) == 8 or not sure[-1]), (prompt, sure)
        lengths.append(len(proposal))
    assert lengths[0] > 1 and lengths[1] == 1


@pytest.mark.slow
def test_a_model_drafting_for_itself_has_every_candidate_accepted(gemma3, baseline):
    """Same tokenizer family: the fast path without translation. A model agrees with itself."""
    result = generate(gemma3, gemma3, PROMPTS[0], DecodingParams(max_tokens=MAX_TOKENS, k=3), chat=False)
    assert result.token_ids == baseline(gemma3, PROMPTS[0])
    assert result.metrics.candidates_accepted == result.metrics.candidates > 0
    assert result.metrics.tokens_per_round > 2


@pytest.mark.slow
def test_exact_match_sampling_keeps_the_target_distribution(gemma3, smollm2):
    """Speculative samples of two tokens, verified by exact match of translated candidates,
    follow the target's exact joint distribution (speculative sampling: test_batch, test_draft_vocab)."""
    samples = 80
    bins = two_token_bins(gemma3, SAMPLED_PROMPT, 1.0, samples)
    params = [DecodingParams(seed=s, max_tokens=2, temperature=1.0, k=2, verify="exact") for s in range(samples)]
    speculative = sampled_sequences(gemma3, smollm2, SAMPLED_PROMPT, params)
    statistic, df = goodness_of_fit(speculative, bins)
    assert df >= 3, f"too few likely sequences to test the distribution: {bins}"
    assert statistic < chi_square_critical(df), (statistic, df, Counter(map(tuple, speculative)).most_common(5))


@pytest.mark.slow
def test_the_chi_square_check_detects_a_different_distribution(gemma3):
    """The distribution test can fail: samples at temperature 0.5 against the exact temperature-1 joint."""
    samples = 50
    bins = two_token_bins(gemma3, SAMPLED_PROMPT, 1.0, samples)
    cold = sampled_sequences(gemma3, None, SAMPLED_PROMPT,
                             [DecodingParams(seed=s, max_tokens=2, temperature=0.5) for s in range(samples)])
    statistic, df = goodness_of_fit(cold, bins)
    assert statistic > chi_square_critical(df), (statistic, df)


@pytest.mark.parametrize("kwargs, message", [
    (dict(k=0), "k must be between 1 and 16, got 0"),
    (dict(k=17), "k must be between 1 and 16, got 17"),
    (dict(k="auto-ish"), "k must be a number from 1 to 16 or one of heuristic, confidence"),
    (dict(prefix=-1), "prefix must be 0 or more, got -1"),
    (dict(temperature=-0.5), "temperature must be a finite number, 0 or more, got -0.5"),
    (dict(temperature=float("nan")), "temperature must be a finite number, 0 or more, got nan"),
    (dict(temperature=1e-40), "temperature must be 0 \\(greedy\\) or from 1e-06 to 1e\\+06, got 1e-40"),  # sampled token 0
    (dict(temperature=1e50), "temperature must be 0 \\(greedy\\) or from 1e-06 to 1e\\+06, got 1e\\+50"),
    (dict(temperature=0.7, seed=2**63), "seed must be between 0 and 9223372036854775807"),
    (dict(top_p=0.0), r"top_p must be from 1e-06 to 1 \(1: off\), got 0.0"),
    (dict(top_p=1.5), r"top_p must be from 1e-06 to 1 \(1: off\), got 1.5"),
    (dict(top_p=1e-46), r"top_p must be from 1e-06 to 1 \(1: off\), got 1e-46"),  # every draw was token 0
    (dict(max_tokens=0), "max_tokens must be at least 1 and at most 1,048,576, got 0"),
    (dict(max_tokens=2**20 + 1), "max_tokens must be at least 1 and at most 1,048,576, got 1048577"),
    (dict(strategy="magic"), "unknown strategy 'magic'"),
    (dict(partial_word="guess"), "partial_word must be one of verify, hold, got 'guess'"),
    (dict(k=2.5), "k must be a number from 1 to 16 or one of heuristic, confidence, auto, got 2.5"),
    (dict(k=True), "k must be a number from 1 to 16 or one of heuristic, confidence, auto, got true"),
    (dict(max_tokens=None), "max_tokens must be a whole number, got null"),
    (dict(max_tokens=32.0), "max_tokens must be a whole number, got 32.0"),
    (dict(seed="x"), "seed must be a whole number, got 'x'"),
    (dict(temperature="hot"), "temperature must be a number, got 'hot'"),
])
def test_invalid_parameters(kwargs, message):
    with pytest.raises(PolspecError, match=message):
        DecodingParams(**kwargs)


def test_numpy_numbers_are_taken_as_the_python_numbers_they_are():
    """A grid built with np.arange or np.linspace was refused: "max_tokens must be a whole
    number, got np.int64(5)"."""
    import numpy as np

    params = DecodingParams(max_tokens=np.int64(5), k=np.int8(3), temperature=np.float32(0.5), top_k=np.int32(3),
                            seed=np.uint64(7), top_p=np.float16(0.5))
    assert params.as_dict() == DecodingParams(max_tokens=5, k=3, temperature=0.5, top_k=3, seed=7,
                                                   top_p=0.5).as_dict()
    assert json.dumps(params.as_dict())  # stored as JSON with the item
    with pytest.raises(PolspecError, match="max_tokens must be a whole number"):
        DecodingParams(max_tokens=np.float64(5.0))  # a float is no count, numpy's or not
    with pytest.raises(PolspecError, match="k must be a number from 1 to 16"):
        DecodingParams(k=np.bool_(True))


def test_a_policy_starts_within_its_k_max():
    """heuristic with k_max 1 drafted 2 tokens in its first round, past the bound it promises."""
    assert [DecodingParams(k=policy, k_max=1).initial_k for policy in ("heuristic", "confidence", "auto")] == [1] * 3
    assert DecodingParams(k="heuristic").initial_k == 2 and DecodingParams(k=5, k_max=1).initial_k == 5


def test_the_bounds_themselves_are_valid():
    assert DecodingParams(max_tokens=2**20, seed=2**63 - 1, k=16, k_max=16, top_p=1.0).max_tokens == 2**20


@pytest.mark.parametrize("args, message", [
    (["--k", "0"], "--k must be between 1 and 16, got 0"),
    (["--top-p", "0"], "--top-p must be from 1e-06 to 1 (1: off), got 0.0"),
    (["--temperature", "-1"], "--temperature must be a finite number, 0 or more, got -1.0"),
])
def test_cli_rejects_bad_parameters_in_one_line(args, message):
    result = CliRunner().invoke(main, ["generate", "Kraków jest", "--draft", "smollm2-135m", *args])
    assert result.exit_code == 1
    assert result.output == f"polspec: error: {message}\n"


@pytest.mark.slow
def test_target_only_decode_time_leaves_out_the_callers_work_between_tokens(gemma3):
    """It timed the caller's work between tokens too (a worker's progress writes, a terminal's
    printing), where the speculative decoder sums its own phases: reported speedups leaned
    toward speculation."""
    metrics, inside = DecodeMetrics(), 0.0  # inside: the time the decoder held the thread
    tokens = stream(gemma3, None, "Stolicą Polski jest", DecodingParams(max_tokens=2), metrics, chat=False)
    while True:
        clock = time.perf_counter()
        commit = next(tokens, None)
        inside += time.perf_counter() - clock
        if commit is None:
            break
        time.sleep(0.2)
    assert metrics.generated_tokens == 2 and metrics.decode_s > 0
    assert metrics.prefill_s + metrics.decode_s <= inside, (metrics.prefill_s, metrics.decode_s, inside)


@pytest.mark.slow
def test_empty_prompt(gemma3):
    with pytest.raises(PolspecError, match="the prompt is empty"):
        generate(gemma3, None, "  \n", DecodingParams())


@pytest.mark.slow
def test_the_decoder_refuses_the_messages_enqueue_refuses(smollm2, tmp_path):
    # A message with a key besides role and content: enqueue refused it, the decoder let it through.
    messages = [{"role": "user", "content": "Napisz zdanie o Krakowie.", "name": "Ola"}]
    refusal = "messages[0] has 'name' besides 'role' and 'content'; polspec takes only those two: remove the rest"
    with pytest.raises(PolspecError, match=re.escape(refusal)):
        generate(smollm2, None, messages, DecodingParams(max_tokens=2))
    source = tmp_path / "p.jsonl"
    source.write_text(json.dumps({"id": "a", "messages": messages}) + "\n")
    result = CliRunner().invoke(main, ["enqueue", "generate", "--input", str(source), "--target", "smollm2-135m"])
    assert result.exit_code == 1 and result.output == f"polspec: error: {source}:1: {refusal}\n"


@pytest.mark.slow
def test_prompt_longer_than_the_context_gives_both_lengths(smollm2):
    with pytest.raises(PolspecError, match=r"the prompt has \d{4,} tokens and 10 more were asked for, but smollm2-135m takes at most 8192"):
        generate(smollm2, None, "kot " * 9000, DecodingParams(max_tokens=10), chat=False)


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["gemma3>smollm2", "smollm2>gemma3"])
def test_a_sliding_window_model_serves_past_its_window(request, pair, gemma3_window, monkeypatch):
    """Gemma-3's sliding layers see 512 tokens: a longer prompt used to be refused for it as a
    target and as a draft. Its window now comes from the attention mask over a plain cache, so
    its output must equal its own target-only output (rotating cache) past the window.

    At a window of 8 and prefill steps of 20 (not a multiple of it) the code is that of 512
    and 512, past the window many times and across prefill steps, at a sixth of the prompt."""
    for module in (kv, speculative):  # the target's prefill, and the draft's
        monkeypatch.setattr(module, "PREFILL_STEP", 20)
    target_name, draft_name = pair.split(">")
    target, draft = request.getfixturevalue(target_name), request.getfixturevalue(draft_name)
    prompt = " ".join(PROMPTS) + " Podsumowując, Kraków jest"
    assert min(len(encode_prompt(model, prompt, chat=False)) for model in (target, draft)) > 4 * kv.PREFILL_STEP
    expected = generate(target, None, prompt, DecodingParams(max_tokens=MAX_TOKENS), chat=False).token_ids
    result = generate(target, draft, prompt, DecodingParams(max_tokens=MAX_TOKENS, k=3), chat=False)
    assert_same_or_float_tie(target, prompt, expected, result.token_ids)


@pytest.mark.slow
def test_a_draft_stops_proposing_where_its_text_reaches_its_context(gemma3, smollm2, tmp_path, monkeypatch):
    """SmolLM2 writes Polish in about one and a half tokens for each of Gemma-3's, so a prompt
    and max_tokens within its context in target tokens can run its text past it: its positions
    there are untrained. Given a context of its prompt plus max_tokens (its own config, the
    rest of the model linked), each decoder drafts until the draft's cache would pass it, then
    decodes plainly and says from which token, with the target-only output; in a batch the
    row beside it, with room left, goes on drafting while the draft is fed nothing more of it."""
    prompt, max_tokens = "Wisła płynie przez Kraków i Warszawę, a potem", 12
    context = len(encode_prompt(smollm2, prompt, chat=False)) + max_tokens
    folder = tmp_path / "smollm2-short"
    folder.mkdir()
    for path in smollm2.path.iterdir():
        (folder / path.name).symlink_to(path)
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(model_config(smollm2.path) | {"max_position_embeddings": context}))
    draft = dataclasses.replace(smollm2, path=folder)
    params = DecodingParams(max_tokens=max_tokens)
    expected = generate(gemma3, None, prompt, params, chat=False).token_ids
    note = re.compile(rf"plain decoding from token (\d+): the draft's text reached its context of {context} tokens")
    fed = []  # the draft cache's entries of text after each proposal (the largest row's in a batch)
    propose, propose_rows = DraftSide.propose, BatchDecoder._propose

    def proposed(side, *args):
        ids = propose(side, *args)
        fed.append(kv.cached_length(side.cache))
        return ids

    def proposed_rows(decoder, *args):
        proposals = propose_rows(decoder, *args)
        fed.append(max(row.draft_text.fed for row in decoder.rows))
        return proposals

    monkeypatch.setattr(DraftSide, "propose", proposed)
    monkeypatch.setattr(BatchDecoder, "_propose", proposed_rows)

    metrics, tokens = DecodeMetrics(), []
    for commit in stream(gemma3, draft, prompt, params, metrics, chat=False):
        tokens += commit.tokens
    assert_same_or_float_tie(gemma3, prompt, expected, tokens)
    assert note.fullmatch(metrics.k_policy_note) and metrics.draft_tokens > 0
    assert max(fed) <= context and fed.count(max(fed)) > 1, fed  # it reached the end, and stayed there

    fed.clear()
    rows, finished = {0: [], 1: []}, {}
    for event in stream_batch(gemma3, draft, [(prompt, params), ("Kraków to", params)], max_batch=2, chat=False):
        rows[event.key] += event.commit.tokens if event.commit else []
        if event.finished:
            finished[event.key] = event.metrics
    assert_same_or_float_tie(gemma3, prompt, expected, rows[0])
    assert note.fullmatch(finished[0].k_policy_note) and finished[0].draft_tokens > 0
    assert max(fed) <= context and fed.count(max(fed)) > 1, fed
    # The short row had room to its end, and was still drafting when the long one ran out.
    assert finished[1].k_policy_note == "" and finished[1].rounds > int(note.fullmatch(finished[0].k_policy_note)[1])


def test_state_space_models_are_refused():
    from mlx_lm.models import mamba

    args = mamba.ModelArgs(model_type="mamba", vocab_size=32, hidden_size=16, intermediate_size=32, state_size=4,
                           num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=2)
    with pytest.raises(PolspecError, match="tiny-mamba has ArraysCache layers .* cannot be trimmed"):
        new_cache(mamba.Model(args), "tiny-mamba")


@pytest.mark.slow
def test_cli_streams_and_marks_accepted_text(gemma3, smollm2, resident_models):
    runner = CliRunner()
    args = ["generate", "Stolicą Polski jest Warszawa, która", "--draft", "smollm2-135m", "--max-tokens", "4"]
    plain = runner.invoke(main, args)
    marked = runner.invoke(main, args + ["--show-accepted"])
    as_json = runner.invoke(main, args + ["--json"])
    assert plain.exit_code == marked.exit_code == as_json.exit_code == 0, plain.output + marked.output
    result = json.loads(as_json.output)
    assert plain.output.strip() == result["text"].strip()
    accepted = "".join(text for text, from_draft in result["spans"] if from_draft)
    assert marked.output.replace("[", "").replace("]", "") == plain.output
    assert ("[" in marked.output) == bool(accepted)
    assert result["metrics"]["generated_tokens"] == len(result["token_ids"]) == 4


@pytest.mark.slow
def test_spans_join_to_the_text_when_a_letter_is_split_between_runs(smollm2):
    """SmolLM2's byte-level tokens split Polish letters; a draft run that ends inside one must not
    leave half a letter on each side."""
    from polspec.decoding.run import _spans

    tokens = smollm2.tokenizer.encode("Zażółć gęślą jaźń, źdźbło", add_special_tokens=False)
    text = smollm2.tokenizer.decode(tokens)
    assert any("\ufffd" in smollm2.tokenizer.decode(tokens[:end]) for end in range(1, len(tokens)))  # splits exist
    for phase in (0, 1):
        spans = _spans(smollm2, tokens, [(index + phase) % 2 == 0 for index in range(len(tokens))])
        assert "".join(span for span, _ in spans) == text
        assert not any("\ufffd" in span for span, _ in spans)
        assert len(spans) > 1


@pytest.mark.slow
def test_a_prompt_longer_than_the_draft_takes_decodes_target_only_and_says_why(gemma3, smollm2):
    """SmolLM2 reads 8,192 positions, Gemma-3 32,768: asked for more than the draft can read,
    a request decodes without it (alone and in a batch) rather than fail or feed it garbage."""
    prompt, limit = "Kot siedzi na płocie. " * 20, smollm2.context_length
    draft_ids = encode_prompt(smollm2, prompt, False)
    fits = DecodingParams(max_tokens=limit - len(draft_ids), k=2)
    too_long = DecodingParams(max_tokens=limit - len(draft_ids) + 1, k=2)
    metrics = DecodeMetrics()
    stream(gemma3, smollm2, prompt, fits, metrics, chat=False)  # lazy: nothing decodes until iterated
    assert metrics.k_policy_note == ""
    stream(gemma3, smollm2, prompt, too_long, metrics, chat=False)
    assert metrics.k_policy_note.startswith(f"plain decoding: the prompt has {len(draft_ids)} of smollm2-135m's tokens")
    decoder = BatchDecoder(gemma3, smollm2, max_batch=2)
    decoder.add("long", prompt, too_long, chat=False)
    decoder.add("short", prompt, DecodingParams(max_tokens=4, k=2), chat=False)
    events = {event.key: event for event in decoder.step()}
    assert events["long"].metrics.draft_tokens == 0 and "takes at most 8192" in events["long"].metrics.k_policy_note
    assert events["long"].metrics.plain_rounds == events["long"].metrics.rounds == 1  # a report prices it plain
    assert events["short"].metrics.draft_tokens > 0 and events["short"].metrics.k_policy_note == ""


@pytest.mark.slow
@pytest.mark.parametrize("draft", [None, "smollm2"])
def test_a_stream_stopped_early_leaves_its_metrics_as_far_as_it_went(gemma3, smollm2, draft):
    """A caller that stops at a stop string: the speculative decoder summed decode_s only at
    its end (tokens/s read None), and target-only said it ended at max_tokens."""
    metrics = DecodeMetrics()
    tokens = stream(gemma3, smollm2 if draft else None, "Kraków jest", DecodingParams(max_tokens=40), metrics,
                    chat=False)
    next(tokens)
    next(tokens)
    tokens.close()
    assert 0 < metrics.generated_tokens < 40 and metrics.decode_s > 0 and metrics.decode_tokens_per_s > 0
    assert metrics.finish_reason == "" and metrics.peak_memory_gb > 0  # no reason: the caller stopped it


@pytest.mark.slow
def test_the_library_refuses_a_draft_without_a_chat_template_in_its_own_terms(gemma3, smollm2):
    """The CLI's check, told as --raw, was only the CLI's: a library call failed later, naming
    the draft's template and --raw, which a Python caller has not got."""
    with pytest.raises(PolspecError, match=r"^draft gemma3-270m has no chat template but smollm2-135m runs in chat "
                                           r"mode: add chat=False, or choose a draft with a chat template$"):
        generate(smollm2, gemma3, "Kraków jest", DecodingParams(max_tokens=2))
    with pytest.raises(PolspecError, match=r"add chat=False"):
        BatchDecoder(smollm2, gemma3, max_batch=2).add(0, "Kraków jest", DecodingParams(max_tokens=2))


@pytest.mark.slow
def test_a_batch_refuses_auto_with_a_probe_without_its_batch_table_and_takes_a_fixed_k(gemma3, smollm2):
    """Taken as it was, auto priced a round of several rows at one row's costs. A fixed k
    needs no table: the probe a single `generate --k auto` stored only rides along with its
    results (refusing it failed every fixed-k item of a batched worker)."""
    probe = Probe(gemma3.entry.alias, smollm2.entry.alias, c=0.5, rho=(1.0,) * 9, tau=0.0)
    decoder = BatchDecoder(gemma3, smollm2, max_batch=2, probe=probe)
    with pytest.raises(PolspecError, match=r"^the probe of gemma3-270m with smollm2-135m has no batch table; take it "
                                           r"with stored_probe\(target, draft, batched=True\)$"):
        decoder.add("auto", "Kraków jest", DecodingParams(max_tokens=2, k="auto"), chat=False)
    decoder.add("fixed", "Kraków jest", DecodingParams(max_tokens=2, k=2), chat=False)
    finished = []
    while decoder:
        finished += [event.key for event in decoder.step() if event.finished]
    assert finished == ["fixed"]
    one = BatchDecoder(gemma3, smollm2, max_batch=1, probe=probe)
    one.add("auto", "Kraków jest", DecodingParams(max_tokens=2, k="auto"), chat=False)  # one row: its own costs
