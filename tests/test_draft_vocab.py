"""The draft's output layer: last-position logits and a pruned vocabulary, on real models."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from polspec.cli import main
from polspec.decoding import DecodingParams, draft_vocab, generate
from polspec.decoding.batch import stream_batch
from polspec.decoding.draft_head import DraftHead
from polspec.decoding.draft_vocab import (
    DEFAULT_SIZE, RANKING_FILE, RANKING_FORMAT, _rank, draft_head, draft_vocab_size, pruned_vocabulary, token_ranking,
)
from polspec.decoding.policy import DraftLength
from polspec.decoding.speculative import DraftSide
from polspec.decoding.translate import token_bytes
from polspec.errors import PolspecError

from decoding_checks import (
    SAMPLED_PROMPT, assert_same_or_float_tie, chi_square_critical, goodness_of_fit, sampled_sequences, two_token_bins,
)

pytestmark = pytest.mark.slow

PROMPTS = ["Kraków jest", "Stolicą Polski jest Warszawa, która", "Zimą w górach", "Gdańsk słynie z"]
SMALL = 2048  # small enough that the draft's greedy choice often falls outside it


@pytest.mark.parametrize("name", ["gemma3", "smollm2"])
def test_the_head_gives_the_models_own_last_logits(request, name):
    loaded = request.getfixturevalue(name)
    ids = mx.array([loaded.tokenizer.encode("Wisła jest najdłuższą rzeką Polski i płynie przez")])
    full = loaded.model(ids)[0, -1]
    assert np.allclose(np.array(draft_head(loaded, "full")(ids, None)[0]), np.array(full), atol=1e-4)
    pruned = draft_head(loaded, SMALL)
    assert np.allclose(np.array(pruned(ids, None)[0]), np.array(full[pruned.keep]), atol=1e-4)


def test_the_ranking_is_deterministic_and_puts_polish_first(gemma3):
    tokenizer = gemma3.tokenizer._tokenizer
    ranking = token_ranking(gemma3)  # computed, or read back from the cache beside the model
    assert ranking == _rank(tokenizer)
    assert len(set(ranking)) == len(ranking)
    top = {tokenizer.convert_ids_to_tokens(token) for token in ranking[:2000]}
    assert {"▁się", "▁nie", "▁jest"} <= top


def test_the_ranking_is_kept_beside_the_model_and_read_back(smollm2, tmp_path, monkeypatch):
    """Ranking a vocabulary tokenizes the shipped Polish words (seconds for a large one): it is
    written beside the model once and read back after, whole; an unreadable or older file is
    ranked again and replaced, and where no file can be written there it still ranks."""
    beside = dataclasses.replace(smollm2, path=tmp_path)
    ranked = _rank(smollm2.tokenizer._tokenizer)  # what the cache must give back
    kept = tmp_path / RANKING_FILE
    assert token_ranking(beside) == ranked
    assert json.loads(kept.read_text()) == {"format": RANKING_FORMAT, "ranking": ranked}
    # Past the first, a ranking is counted and answered from the one above (each takes seconds).
    rankings = []
    monkeypatch.setattr(draft_vocab, "_rank", lambda tokenizer: rankings.append(tokenizer) or list(ranked))
    kept.write_text(json.dumps({"format": RANKING_FORMAT, "ranking": ranked[::-1]}))
    assert token_ranking(beside) == ranked[::-1] and rankings == []  # read back, not ranked again
    for stale in (json.dumps({"format": RANKING_FORMAT - 1, "ranking": ranked[::-1]}), "[]"):
        kept.write_text(stale)
        assert token_ranking(beside) == ranked
        assert json.loads(kept.read_text())["ranking"] == ranked
    assert len(rankings) == 2
    nowhere = tmp_path / "a-file"
    nowhere.write_text("")
    assert token_ranking(dataclasses.replace(smollm2, path=nowhere)) == ranked and len(rankings) == 3


def test_a_pruned_vocabulary_keeps_every_byte_special_and_end_token(gemma3, smollm2):
    for loaded in (gemma3, smollm2):
        keep = pruned_vocabulary(loaded, SMALL)
        table = token_bytes(loaded.tokenizer._tokenizer)
        single_bytes = {token for token, raw in enumerate(table.raw) if raw is not None and len(raw) == 1}
        assert single_bytes | set(loaded.tokenizer.eos_token_ids) <= set(keep)
        assert set(token_ranking(loaded)[:SMALL]) <= set(keep)
        assert keep == sorted(set(keep)) and len(keep) < SMALL + len(single_bytes) + 300


def test_auto_prunes_only_a_large_vocabulary(gemma3, smollm2):
    assert draft_vocab_size(gemma3, "auto") == draft_vocab_size(smollm2, "auto") == DEFAULT_SIZE  # 262k, 49k tokens
    assert draft_vocab_size(smollm2, "full") is None
    assert draft_vocab_size(smollm2, 60000) is None  # at or above the vocabulary: all of it


def test_a_pruned_draft_never_proposes_a_token_outside_its_vocabulary(gemma3, smollm2):
    for draft, text in ((gemma3, "Kraków jest jednym z najstarszych miast w Polsce. Przez wieki był"),
                        (smollm2, "def fibonacci(n):\n    return")):
        head = draft_head(draft, SMALL)
        kept = set(np.array(head.keep).tolist())
        prompt = draft.tokenizer.encode(text)
        side = DraftSide(draft, prompt, None, head)
        proposed = []
        for _ in range(6):
            proposal = side.propose(4, DraftLength(DecodingParams(k=4)))
            proposed += proposal
            side.resync(side.text.generated + proposal, b"")
        assert set(proposed) <= kept
        # the full head does leave the subset somewhere on the same text: the test can fail
        full = DraftSide(draft, prompt, None, draft_head(draft, "full"))
        unpruned = []
        for _ in range(6):
            proposal = full.propose(4, DraftLength(DecodingParams(k=4)))
            unpruned += proposal
            full.resync(full.text.generated + proposal, b"")
        assert not set(unpruned) <= kept or proposed != unpruned


@pytest.mark.parametrize("pair", ["gemma3>smollm2", "smollm2>gemma3"])
def test_greedy_with_a_pruned_draft_equals_the_target_alone(request, pair):
    target_name, draft_name = pair.split(">")
    target, draft = request.getfixturevalue(target_name), request.getfixturevalue(draft_name)
    for prompt, policy in zip(PROMPTS[:2], (2, "confidence")):
        expected = generate(target, None, prompt, DecodingParams(max_tokens=12), chat=False).token_ids
        result = generate(target, draft, prompt, DecodingParams(max_tokens=12, k=policy, draft_vocab=SMALL), chat=False)
        assert result.metrics.draft_vocab is not None and result.metrics.draft_vocab >= SMALL
        assert_same_or_float_tie(target, prompt, expected, result.token_ids)


def test_sampling_with_a_pruned_draft_keeps_the_target_distribution(gemma3):
    """A same-family pair (gemma3 drafting for itself) under speculative sampling with top-k:
    the pruned draft's q differs from p (it has no mass outside its subset), and the pair
    accepts most candidates, so the draft's tokens decide many committed tokens; their
    distribution must still be the target's."""
    samples = 80
    bins = two_token_bins(gemma3, SAMPLED_PROMPT, 1.0, samples, top_k=40)
    params = [DecodingParams(seed=s, max_tokens=2, temperature=1.0, top_k=40, k=2, draft_vocab=SMALL, verify="tli")
              for s in range(samples)]
    metrics: list = []
    sequences = sampled_sequences(gemma3, gemma3, SAMPLED_PROMPT, params, metrics=metrics)
    assert sum(m.candidates_accepted for m in metrics) > samples / 2
    statistic, df = goodness_of_fit(sequences, bins)
    assert df >= 3, f"too few likely sequences to test the distribution: {bins}"
    assert statistic < chi_square_critical(df), (statistic, df, Counter(map(tuple, sequences)).most_common(5))


def test_rows_of_one_batch_may_prune_differently(gemma3, smollm2):
    """Rows share the draft's body forward and apply their own output layers."""
    requests = [(prompt, DecodingParams(max_tokens=10, k=2, draft_vocab=vocab))
                for prompt, vocab in zip(PROMPTS, ["full", SMALL, "auto", 4096])]
    tokens: dict[int, list[int]] = {index: [] for index in range(len(requests))}
    sizes = {}
    for event in stream_batch(smollm2, gemma3, requests, max_batch=4, chat=False):
        tokens[event.key] += event.commit.tokens if event.commit else []
        sizes[event.key] = event.metrics.draft_vocab
    for index, (prompt, _) in enumerate(requests):
        expected = generate(smollm2, None, prompt, DecodingParams(max_tokens=10), chat=False).token_ids
        assert_same_or_float_tie(smollm2, prompt, expected, tokens[index])
    assert sizes[0] is None and SMALL <= sizes[1] < sizes[3] < DEFAULT_SIZE <= sizes[2]


@pytest.mark.parametrize("value, message", [
    ("some", "draft_vocab must be a number of tokens or one of auto, full, got 'some'"),
    (100, "draft_vocab must be 1024 to 65536 tokens, auto or full, got 100"),
    (65537, "draft_vocab must be 1024 to 65536 tokens, auto or full, got 65537"),  # no pruned draft is larger
    (True, "draft_vocab must be 1024 to 65536 tokens, auto or full, got true"),
    ([4096], r"draft_vocab must be 1024 to 65536 tokens, auto or full, got \[4096\]"),
])
def test_invalid_draft_vocabularies(value, message):
    with pytest.raises(PolspecError, match=message):
        DecodingParams(draft_vocab=value)


def test_the_cli_refuses_a_tiny_draft_vocabulary_in_one_line():
    result = CliRunner().invoke(main, ["generate", "Kraków jest", "--draft", "smollm2-135m", "--draft-vocab", "10"])
    assert result.exit_code == 1
    assert result.output == "polspec: error: --draft-vocab must be 1024 to 65536 tokens, auto or full, got 10\n"


def test_an_architecture_that_cannot_split_refuses_pruning():
    from mlx_lm.models import mamba

    args = mamba.ModelArgs(model_type="mamba", vocab_size=32, hidden_size=16, intermediate_size=32, state_size=4,
                           num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=2)
    with pytest.raises(PolspecError, match="tiny-mamba \\(mamba\\) cannot run with a pruned draft vocabulary"):
        DraftHead(mamba.Model(args), [1, 2, 3], "tiny-mamba")
