"""Translation between real tokenizers: byte-exact properties and oracle fidelity."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from polspec.decoding.draft_vocab import polish_texts
from polspec.decoding.metrics import DecodeMetrics
from polspec.decoding.params import DecodingParams
from polspec.decoding.policy import DraftLength
from polspec.decoding.speculative import settle_round
from polspec.decoding.fidelity import Fidelity, oracle_fidelity
from polspec.decoding.translate import (complete_utf8, encode_after, extend_tokens, same_tokenizer, token_bytes,
                                       translate_draft_to_target)
from polspec.errors import PolspecError
from polspec.models.loader import LoadedModel
from polspec.models.registry import load_registry

FAMILIES = ["tok:mistral-32k", "tok:llama3", "qwen2.5-coder-1.5b", "smollm2-135m", "gemma3-270m"]
PAIRS = [("tok:mistral-32k", draft) for draft in ("qwen2.5-coder-1.5b", "tok:llama3", "smollm2-135m", "gemma3-270m")] + [
    ("qwen2.5-coder-1.5b", "smollm2-135m"), ("qwen2.5-coder-1.5b", "gemma3-270m"),
    ("gemma3-270m", "smollm2-135m"), ("gemma3-270m", "qwen2.5-coder-1.5b")]
POLISH = "aąbcćdeęfghijklłmnńoóprsśtuwyzźżAĄCĆEĘLŁNŃOÓSŚZŹŻ ,.;:!?-„”0123456789\n"


@pytest.fixture(scope="module")
def tables(tokenizer_of):
    return {alias: token_bytes(tokenizer_of(alias)) for alias in FAMILIES}



def test_raw_bytes_rebuild_the_text(tables):
    text = "Zażółć gęślą jaźń, 1047 km.\nŹródło: „Wikipedia”."
    for alias, table in tables.items():
        ids = table.encode(text.encode())
        raw = table.text(ids)
        assert raw in (text.encode(), b" " + text.encode()), alias  # SentencePiece may add its dummy space


@pytest.mark.parametrize("strategy", ["aligned", "context", "naive"])
def test_an_id_past_the_tokenizer_reads_as_a_special_token(tables, strategy):
    """A model's padding rows past its tokenizer (Qwen2.5 from the hub: 151,936 against 151,665)
    can be sampled: the round's bookkeeping raised IndexError where the target-only decode
    goes on."""
    target, draft = tables["gemma3-270m"], tables["smollm2-135m"]
    words, past = draft.encode(" Płynie Wisła".encode()), len(draft.raw) + 7
    assert draft.is_special(past) and draft.text(words + [past]) == draft.text(words) == " Płynie Wisła".encode()
    committed = target.encode("Przez Kraków".encode())
    cut = translate_draft_to_target(strategy, draft, target, words + [past] + words, committed + [len(target.raw) + 3])
    alone = translate_draft_to_target(strategy, draft, target, words, committed).candidates
    assert all(token < len(target.raw) for token in cut.candidates) and target.text(cut.candidates)
    # aligned proposes the target's end of text for a draft's special token; context reads the
    # committed text's last tokens, the padding one among them.
    assert strategy == "context" or cut.candidates == alone + [target.tokenizer.eos_token_id] * (strategy == "aligned")


def test_complete_utf8_cuts_only_a_broken_tail():
    word = "źdźbło".encode()
    assert complete_utf8(word) == word
    assert complete_utf8(word[:1]) == b""
    assert complete_utf8(word[:4]) == "źd".encode()
    assert complete_utf8("ab€".encode()[:-1]) == b"ab"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=POLISH, min_size=2, max_size=60), data=st.data())
def test_aligned_candidates_are_a_prefix_of_the_proposal_in_whole_characters(tables, text, data):
    target_alias, draft_alias = data.draw(st.sampled_from(PAIRS))
    target, draft = tables[target_alias], tables[draft_alias]
    draft_ids = draft.encode(text.encode())
    split = data.draw(st.integers(0, max(0, len(draft_ids) - 1)))
    k = data.draw(st.integers(1, 6))
    committed_text = complete_utf8(draft.text(draft_ids[:split]))
    _, committed = extend_tokens(target, [], committed_text, 8) if committed_text.strip() else (0, [])
    proposal = draft_ids[split:split + k]
    proposed = draft.text(proposal)
    translations = {mode: translate_draft_to_target("aligned", draft, target, proposal, committed, 5, 2 * k + 2,
                                                    partial_word=mode) for mode in ("verify", "hold")}
    for translation in translations.values():
        emitted = target.text(translation.candidates)
        assert proposed.startswith(emitted)
        assert complete_utf8(emitted) == emitted
        emitted.decode("utf-8")
        assert translation.held_back == len(proposed) - len(emitted)
    # hold stops where verify goes on: a prefix of its text, not always of its tokens (Qwen2.5
    # writes a proposal's "”\n" as one token where hold, leaving the newline, writes "”").
    verify, hold = translations["verify"], translations["hold"]
    assert target.text(verify.candidates).startswith(target.text(hold.candidates))


def test_bytes_the_cap_leaves_out_are_held_back(tables):
    """Llama-3 writes nine digits as three tokens, Mistral as nine: a cap of 8 leaves one out."""
    draft, target = tables["tok:llama3"], tables["tok:mistral-32k"]
    proposal = draft.encode(b"000000000")
    capped = translate_draft_to_target("aligned", draft, target, proposal, [], cap=8)
    assert target.text(capped.candidates) == b"00000000" and capped.held_back == 1
    assert translate_draft_to_target("aligned", draft, target, proposal, []).held_back == 0


def test_draft_tokens_that_repeat_the_lag_count_as_accepted_with_the_rest(tables):
    """The target committed part of an emoji (the draft's lag); the draft, which has not seen
    it, proposes the whole emoji and the words after it, and the target accepts every
    candidate: every draft token is accepted, those that repeat the lag too (they were counted
    against the accepted text alone, so the proposal's last tokens fell out of the count). Only
    ``aligned`` leaves the lag out of its candidates; where they repeat it, it counts once.
    SmolLM2 drafts for itself as another family, as the twin pair of test_lossless_inputs
    does: it writes " 😀" in two tokens, the first ending inside the emoji, and "😀" alone in three."""
    draft = target = tables["smollm2-135m"]
    committed, rest = target.encode(" Emoji 😀".encode())[:-1], "😀 Polska leży".encode()
    text = target.text(committed)
    lag = text[len(complete_utf8(text)):]
    assert lag == rest[:3]
    proposal = draft.encode(rest)
    candidates = translate_draft_to_target("aligned", draft, target, proposal, committed, lag=lag).candidates
    assert target.text(candidates) == rest[3:]
    # naive re-encodes the whole proposal, the lag with it: its candidates repeat the lag
    # themselves, and the draft tokens inside "😀 Polska" are the six of its first six.
    naive = translate_draft_to_target("naive", draft, target, proposal, committed, lag=lag).candidates
    assert target.text(naive) == rest and target.text(naive[:6]) == "😀 Polska".encode()
    for strategy, found, accepted, counted in [("aligned", candidates, len(candidates), len(proposal)),
                                                ("aligned", candidates, 0, 0), ("naive", naive, 6, 6)]:
        params, metrics = DecodingParams(k=len(proposal), strategy=strategy), DecodeMetrics()
        choices = found[:accepted] + [target.tokenizer.eos_token_id]
        settle_round(found, choices, proposal, 0, params, set(), metrics, DraftLength(params), (draft, target), lag)
        assert (metrics.candidates_accepted, metrics.draft_tokens_accepted) == (accepted, counted), strategy


@pytest.mark.parametrize("target", ["qwen2.5-coder-1.5b", "tok:mistral-32k"])
def test_hold_leaves_an_unfinished_word_for_the_next_round(tables, target):
    """' mias' is ' m' + 'ias', but ' miasto' is ' mi' + 'asto' on both targets: only ' stare' is stable."""
    table, gemma = tables[target], tables["gemma3-270m"]
    _, committed = extend_tokens(table, [], "Kraków to".encode(), 8)
    proposal = gemma.encode(" stare mias".encode())
    verify, hold = (translate_draft_to_target("aligned", gemma, table, proposal, committed, 5, 10, partial_word=mode)
                    for mode in ("verify", "hold"))
    assert table.text(verify.candidates) == b" stare mias" and verify.held_back == 0
    assert table.text(hold.candidates) == b" stare" and hold.held_back == len(b" mias")


@pytest.mark.parametrize("target", ["gemma3-270m", "qwen2.5-coder-1.5b"])
@pytest.mark.parametrize("ending", ["\n\n", ". "])
def test_verify_proposes_trailing_whitespace_hold_leaves_it(tables, target, ending):
    """A paragraph break is a token of its own on both targets (and Gemma-3 spells the space
    before a digit alone): ``verify`` proposes it, ``hold`` leaves it for the next round."""
    table, smollm2 = tables[target], tables["smollm2-135m"]
    _, committed = extend_tokens(table, [], "Fryderyk Chopin urodził się".encode(), 8)
    proposal = smollm2.encode(f" w Polsce{ending}".encode())
    verify, hold = (translate_draft_to_target("aligned", smollm2, table, proposal, committed, 5, 10, partial_word=mode)
                    for mode in ("verify", "hold"))
    assert table.text(verify.candidates) == f" w Polsce{ending}".encode() and verify.held_back == 0
    assert table.text(hold.candidates) == f" w Polsce{ending.rstrip()}".encode()
    assert hold.held_back == len(ending) - len(ending.rstrip())


def test_encode_after_reports_a_token_across_the_boundary(tables):
    qwen = tables["qwen2.5-coder-1.5b"]
    assert encode_after(qwen, " Kra".encode(), "ków jest".encode()) is None  # " Krak" is one token
    context_ids, text_ids = encode_after(qwen, " Kraków".encode(), " jest".encode())
    assert qwen.text(context_ids) == " Kraków".encode() and qwen.text(text_ids) == b" jest"


@pytest.mark.parametrize("target, draft", PAIRS, ids=[f"{t}<{d}" for t, d in PAIRS])
@pytest.mark.parametrize("k", [2, 4])
def test_oracle_fidelity_of_aligned(tables, target, draft, k):
    """A perfect draft keeps at least 97% of its candidates through aligned translation when
    unfinished words are held back, strictly more than through the study's context rule and
    naive translation; verifying them instead commits at least as many tokens per round as context."""
    texts = polish_texts()

    def fidelity(strategy: str, partial_word: str = "verify") -> Fidelity:
        return sum((oracle_fidelity(tables[target].tokenizer, tables[draft].tokenizer, text, k, strategy,
                                    partial_word=partial_word) for text in texts), Fidelity(0, 0, 0, 0))

    hold, verify, context, naive = fidelity("aligned", "hold"), fidelity("aligned"), fidelity("context"), fidelity("naive")
    assert hold.acceptance >= 0.97
    assert hold.acceptance > context.acceptance
    assert hold.acceptance > naive.acceptance
    assert hold.tokens_per_round > 1.5
    assert verify.tokens_per_round >= context.tokens_per_round
    assert verify.tokens_per_round > hold.tokens_per_round


# --- One tokenizer family ------------------------------------------------------------------


def family_member(alias: str, tokens: list[str]) -> LoadedModel:
    """A model registered in the qwen2.5 family whose tokenizer has ``tokens`` as its ids (no
    weights: which tokenizer a pair shares is decided before any forward)."""
    vocabulary = Tokenizer(WordLevel({token: index for index, token in enumerate(tokens)}, unk_token=tokens[0]))
    entry = dataclasses.replace(load_registry().model("qwen2.5-coder-1.5b"), alias=alias)
    return LoadedModel(entry, Path("."), None, TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=vocabulary)),
                       "float32", 0.0)


def test_one_family_may_rename_a_few_control_tokens_but_not_its_vocabulary():
    words = [f"w{index}" for index in range(400)]
    base = family_member("base", words)
    chat = family_member("chat", ["<|im_start|>", "<|im_end|>", *words[2:]])  # 2 of 400 renamed
    longer = family_member("longer", [*words, "<|extra|>"])  # ids past the other's vocabulary are its own
    assert same_tokenizer(base, chat) and same_tokenizer(chat, base) and same_tokenizer(base, longer)
    other = family_member("other", [f"x{index}" for index in range(5)] + words[5:])  # 5 of 400: over 1%
    with pytest.raises(PolspecError, match=r"^other and base are registered as one tokenizer family \(qwen2\.5\), "
                                           r"but 5 of the 400 ids they share name different tokens \(id 0 is 'x0' "
                                           r"to other and 'w0' to base\)"):
        same_tokenizer(base, other)
    stranger = dataclasses.replace(other, entry=dataclasses.replace(other.entry, tokenizer_family="x"))
    assert not same_tokenizer(base, stranger)  # another family: translated, whatever its ids
