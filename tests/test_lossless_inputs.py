"""Lossless greedy output where it is hard to get right: translation that is actually accepted,
and the inputs that break byte-level bookkeeping (emoji, 4-byte UTF-8, a word or a line cut
off, CRLF, code), early EOS, multi-turn chat.

Across families (gemma3 > smollm2) the target accepts about one candidate in eight, so a
lossless check there mostly runs the rejection path. The *twin* pair makes acceptance the
normal case while still translating: SmolLM2-135M drafts for itself, registered under
another tokenizer family, so the decoder re-tokenizes every proposal (bytes, window, re-encode)
exactly as for a foreign draft. The draft's pruned output layer and re-encoding that merges
differently still cause the odd rejection, so the bonus token, the cache trim after a
rejection, EOS inside a round and the draft's lag all run, and the tests check that they did.
"""

from __future__ import annotations

import dataclasses

import pytest

from polspec.decoding import DecodingParams, generate
from polspec.decoding.batch import stream_batch
from polspec.decoding.metrics import DecodeMetrics
from polspec.decoding.run import stream
from polspec.models.loader import LoadedModel

from decoding_checks import assert_same_or_float_tie

pytestmark = pytest.mark.slow

MAX_TOKENS = 12

# Raw-text inputs, one per class; each continuation was checked by hand to stay in its class.
INPUTS = {
    "emoji and flags": "🇵🇱 Polska 👍 🇩🇪 Niemcy 👍 🇨🇿 Czechy",
    "4-byte UTF-8": "Emoji: 😀 😃 😄 😁 😆 🎵 𝄞",  # a continuation of emoji: characters split over tokens
    "mid-word": "Wisła to najdłuższa rze",
    "trailing whitespace": "Stolicą Polski jest ",
    "CRLF": "Lista zakupów:\r\n- mleko\r\n- chleb\r\n",
    "digits and code": "def fib(n):\n    if n < 2:\n        return n\n    return fib(",
}
# ChatML written out as raw text ending in a finished answer: the target's first token is EOS.
EOS_FIRST = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
             "<|im_start|>assistant\nThe capital of France is Paris.")
# Through the chat template: short answers that end in EOS within a few rounds.
SHORT_ANSWER = "What is 2+2? Only the number."
MULTI_TURN = [
    {"role": "user", "content": "Hi, my name is Ola."},
    {"role": "assistant", "content": "Hello Ola! How can I help?"},
    {"role": "user", "content": "What is my name? One word."},
]


@pytest.fixture(scope="module")
def twin(smollm2: LoadedModel) -> LoadedModel:
    """SmolLM2 under another tokenizer family: a cross-tokenizer pair that agrees with itself."""
    entry = dataclasses.replace(smollm2.entry, alias="smollm2-twin", tokenizer_family="smollm2-twin")
    return dataclasses.replace(smollm2, entry=entry)


@pytest.fixture(scope="module")
def baseline():
    """Target-only greedy ids per (target, prompt, chat, max_tokens), each computed once."""
    results: dict[tuple, list[int]] = {}

    def ids(target: LoadedModel, prompt, chat: bool, max_tokens: int = MAX_TOKENS) -> list[int]:
        key = (target.entry.alias, repr(prompt), chat, max_tokens)
        if key not in results:
            results[key] = generate(target, None, prompt, DecodingParams(max_tokens=max_tokens), chat=chat).token_ids
        return results[key]

    return ids


@dataclasses.dataclass
class Run:
    tokens: list[int]
    metrics: DecodeMetrics
    lagged: bool  # some round left committed bytes the draft had not seen (part of a character)
    eos_inside: bool  # EOS ended a round that committed tokens before it


def speculate(target, draft, prompt, params: DecodingParams, chat: bool) -> Run:
    metrics = DecodeMetrics()
    tokens, lagged, commits = [], False, 0
    for commit in stream(target, draft, prompt, params, metrics, chat=chat):
        tokens += commit.tokens
        lagged |= bool(commit.state and commit.state.draft_lag)
        commits += 1
    # A round whose first new token is EOS commits nothing; one with tokens before EOS commits them.
    eos_inside = metrics.finish_reason == "stop" and commits == metrics.rounds > 0
    return Run(tokens, metrics, lagged, eos_inside)


def assert_lossless(target, prompt, chat: bool, expected: list[int], actual: list[int]) -> None:
    if chat:  # the float-tie check re-encodes raw text; a chat prompt must match exactly
        assert actual == expected, (prompt, target.tokenizer.decode(expected), target.tokenizer.decode(actual))
    else:
        assert_same_or_float_tie(target, prompt, expected, actual)


# The twin pair's cases: (prompt, chat). Free text with split characters (lag), a word cut off
# (hold's tentative tokens), EOS as the first token, and chat answers that end mid-round.
TWIN_CASES = [(INPUTS["4-byte UTF-8"], False), (INPUTS["mid-word"], False), (EOS_FIRST, False), (SHORT_ANSWER, True)]
TWIN_KS = (1, 3)  # one candidate a round, and proposals long enough to be rejected part-way


@pytest.mark.parametrize("strategy", ["aligned", "aligned/hold", "context"])
def test_translated_candidates_are_accepted_and_lossless(smollm2, twin, baseline, strategy):
    name, _, partial_word = strategy.partition("/")
    total, longer = DecodeMetrics(), DecodeMetrics()  # every round; rounds with k >= 2
    stops, lagged, eos_inside = 0, False, False
    for k in TWIN_KS:
        params = DecodingParams(max_tokens=MAX_TOKENS, k=k, strategy=name, partial_word=partial_word or "verify")
        for prompt, chat in TWIN_CASES:
            run = speculate(smollm2, twin, prompt, params, chat)
            expected = baseline(smollm2, prompt, chat)
            assert_lossless(smollm2, prompt, chat, expected, run.tokens)
            if prompt == EOS_FIRST:
                assert run.tokens == [] and run.metrics.finish_reason == "stop"
            stops += run.metrics.finish_reason == "stop"
            lagged |= run.lagged
            eos_inside |= run.eos_inside
            # ``context`` decodes a half character as U+FFFD and re-encodes that (the study's
            # unchecked rule): on emoji its candidates are wrong by design, so they do not count.
            if name == "context" and prompt == INPUTS["4-byte UTF-8"]:
                continue
            for sums in (total, longer) if k >= 2 else (total,):
                for field in ("rounds", "candidates", "candidates_accepted", "rejections", "generated_tokens"):
                    setattr(sums, field, getattr(sums, field) + getattr(run.metrics, field))
    # Translation was exercised, not bypassed: most candidates were accepted, several tokens a round.
    # (aligned's tentative trailing "\n\n" re-encodes as one token where the model writes two, so
    # about one candidate in four of this small sample is rejected; hold and context stay above 80%.)
    assert total.acceptance_per_candidate > 0.7, (total.candidates_accepted, total.candidates)
    # (At k = 1 hold proposes nothing for a token that may still go on as a word, by design.)
    assert longer.tokens_per_round > 1.5, (longer.generated_tokens, longer.rounds)
    # ... and the other branches ran too: a rejection (cache trim), EOS in every chat answer and
    # the EOS-first prompt at each k, EOS after accepted tokens of its round, and a character
    # split between rounds (the draft's lag).
    assert total.rejections > 0
    assert stops == len(TWIN_KS) * 2
    assert eos_inside and lagged


def test_the_twin_pair_in_a_batch_accepts_and_is_lossless(smollm2, twin, baseline):
    """B = 3 with a fourth request joining late: per-row bonus tokens, EOS and trims at high acceptance."""
    prompts = [SHORT_ANSWER, MULTI_TURN, "Write one sentence about Kraków.", "Name three Polish rivers."]
    params = DecodingParams(max_tokens=MAX_TOKENS, k=3)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    metrics: dict[int, DecodeMetrics] = {}
    for event in stream_batch(smollm2, twin, [(p, params) for p in prompts], max_batch=3, chat=True):
        if event.commit is not None:
            tokens[event.key] += event.commit.tokens
        if event.finished:
            metrics[event.key] = event.metrics
    for index, prompt in enumerate(prompts):
        assert_lossless(smollm2, prompt, True, baseline(smollm2, prompt, True), tokens[index])
    assert metrics[0].finish_reason == metrics[1].finish_reason == "stop"
    accepted = sum(m.candidates_accepted for m in metrics.values())
    assert accepted / sum(m.candidates for m in metrics.values()) > 0.8
    assert sum(m.generated_tokens for m in metrics.values()) / sum(m.rounds for m in metrics.values()) > 1.5
    assert sum(m.rejections for m in metrics.values()) > 0  # some rows trimmed a rejected candidate


@pytest.mark.parametrize("pair", ["smollm2>twin", "gemma3>smollm2"])
def test_hard_inputs_are_lossless(request, baseline, pair):
    """Every input class through the twin pair, where translated candidates are accepted, and
    through the real cross-family pair, whose SentencePiece target splits text differently."""
    target_name, draft_name = pair.split(">")
    target, draft = request.getfixturevalue(target_name), request.getfixturevalue(draft_name)
    max_tokens = MAX_TOKENS if target_name == "smollm2" else 8  # gemma3 is the slower target
    params = DecodingParams(max_tokens=max_tokens, k=3)
    # The twin pair's translation test already runs its cases with these parameters.
    inputs = [text for text in INPUTS.values() if draft_name != "twin" or (text, False) not in TWIN_CASES]
    accepted = 0
    for prompt in inputs:
        run = speculate(target, draft, prompt, params, chat=False)
        assert_lossless(target, prompt, False, baseline(target, prompt, False, max_tokens), run.tokens)
        accepted += run.metrics.candidates_accepted
    assert accepted > 0


@pytest.mark.parametrize("pair", ["smollm2>twin", "gemma3>smollm2"])
def test_one_token_is_the_target_first_choice(request, baseline, pair):
    """max_tokens = 1: the round is cut to one token whatever the draft proposed."""
    target_name, draft_name = pair.split(">")
    target, draft = request.getfixturevalue(target_name), request.getfixturevalue(draft_name)
    for prompt in (INPUTS["mid-word"], INPUTS["emoji and flags"]):
        run = speculate(target, draft, prompt, DecodingParams(max_tokens=1, k=3), chat=False)
        assert run.tokens == baseline(target, prompt, False, 1) and len(run.tokens) == 1
        assert run.metrics.finish_reason == "length" and run.metrics.rounds == 1


def test_speculative_sampling_through_the_twin_pair_accepts_nearly_everything(smollm2, twin):
    """The twin drafts with the target's own distribution (q = p on every token it maps, with
    its full vocabulary: a pruned one lacks the tokens of Cyrillic text the target may sample),
    so speculative sampling accepts nearly every candidate: a wrong mapping between the
    vocabularies, or p and q computed differently, would show as rejections. Not all: where the
    target samples a character as byte pieces, the twin reads the text as it would write it,
    as one token, and its q there is not p (over seeds 0-23: 428 of 475 candidates, 0.90;
    seeds 0-3 alone: 71 of 80)."""
    metrics, lagged = DecodeMetrics(), False
    for seed in range(4):
        for prompt in (INPUTS["mid-word"], INPUTS["trailing whitespace"]):
            run = speculate(smollm2, twin, prompt, DecodingParams(max_tokens=MAX_TOKENS, k=3, temperature=0.8, seed=seed,
                                                                  verify="tli", draft_vocab="full"), chat=False)
            assert run.metrics.verify == "tli"
            # One candidate a draft token, its twin: the counts agree, in rounds after a byte piece too.
            assert run.metrics.draft_tokens_accepted == run.metrics.candidates_accepted
            metrics.candidates += run.metrics.candidates
            metrics.candidates_accepted += run.metrics.candidates_accepted
            lagged |= run.lagged
    assert metrics.acceptance_per_candidate > 0.85, (metrics.candidates_accepted, metrics.candidates)
    assert lagged  # the target sampled a character in byte pieces: the draft's text lagged
