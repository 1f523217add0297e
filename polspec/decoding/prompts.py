"""A request's prompt ids for each model: chat templates, raw text, and the length checks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from polspec.decoding.params import DecodingParams
from polspec.errors import PolspecError
from polspec.models.registry import ModelEntry

if TYPE_CHECKING:  # for annotations only: enqueue checks prompts here without importing MLX
    from polspec.models.loader import LoadedModel

Prompt = str | list[dict]


def check_prompt(prompt: Prompt) -> None:
    """Refuse a prompt that no model can run. The one check, at enqueue (every line, before
    anything is written) and in the decoder, so that enqueue never accepts what every item
    would then fail on."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PolspecError("the prompt is empty")
        check_text(prompt, "the prompt")
        return
    check_messages(prompt)


def check_text(text: str, what: str) -> None:
    """Refuse a string that is not text: JSON's ``\\ud800`` escapes decode to lone UTF-16
    surrogates, which no tokenizer or database can store. Python passes on a command-line
    argument's bytes that are not UTF-8 as surrogates U+DC80-U+DCFF: those are named as the
    bytes they stand for. A NUL character (``\\u0000``) is refused too: PostgreSQL stores no
    text that holds one, and a queue that moves to it must not find items it cannot take."""
    if (nul := text.find("\0")) >= 0:
        raise PolspecError(f"{what} holds a NUL character (\\u0000) at character {nul + 1}, which is not text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        char = text[error.start]
        if "\udc80" <= char <= "\udcff":
            raise PolspecError(f"{what} is not UTF-8: byte 0x{ord(char) - 0xdc00:02x} at character "
                               f"{error.start + 1}") from None
        raise PolspecError(f"{what} holds a lone surrogate {char!r} at character {error.start + 1}, "
                           "which is not text") from None


# The roles every chat template knows. Templates treat others each their own way (Qwen2.5's
# drops them, SmolLM2's prints them), so target and draft would read different prompts.
ROLES = ("system", "user", "assistant")


def check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise PolspecError("'messages' must be a non-empty list of {role, content} objects")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise PolspecError(f"messages[{index}] must be an object with a string 'role' and 'content'")
        if extra := sorted(set(message) - {"role", "content"}):
            # Templates use such keys each their own way, if at all: target and draft would read different prompts.
            raise PolspecError(f"messages[{index}] has {', '.join(map(repr, extra))} besides 'role' and 'content'; "
                               "polspec takes only those two: remove the rest")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise PolspecError(f"messages[{index}].{key} must be a string"
                                   + ("" if key in message else f", and messages[{index}] has none"))
        if message["role"] not in ROLES:
            raise PolspecError(f"messages[{index}].role is {message['role']!r}; it must be one of {', '.join(ROLES)}")
        check_text(message["content"], f"messages[{index}].content")
    if not any(message["role"] == "user" for message in messages):
        raise PolspecError("the messages have no 'user' message to answer")
    if not any(message["content"].strip() for message in messages):
        raise PolspecError("the messages are all empty")


def chat_mode(target: ModelEntry, chat: bool | None) -> bool:
    """Whether a request goes through the chat templates: ``chat``, or when None whether the
    target has a template. The registry says whether a model has one, not its tokenizer: enqueue
    decides before any model is loaded (on a machine that may not even have it), and the
    decoder must decide the same."""
    return target.chat_template if chat is None else chat


def check_draft_template(target: ModelEntry, draft: ModelEntry | None, chat: bool, raw_option: str = "--raw") -> None:
    """Refuse chat mode with a draft that has no chat template, before either model loads
    (``raw_option``: how the user asks for raw text where the check is made)."""
    if chat and draft is not None and not draft.chat_template:
        raise PolspecError(f"draft {draft.alias} has no chat template but {target.alias} runs in chat mode: "
                           f"add {raw_option}, or choose a draft with a chat template")


def encode_prompt(model: LoadedModel, prompt: Prompt, chat: bool) -> list[int]:
    """The model's own prompt ids: its chat template applied to the messages, or the raw text.

    Each model renders the request with its own template, so the draft never sees the
    target's special tokens as text.
    """
    return encode_with(model.entry, model.tokenizer, prompt, chat)


def encode_with(entry: ModelEntry, tokenizer, prompt: Prompt, chat: bool) -> list[int]:
    """:func:`encode_prompt` with the tokenizer alone, as enqueue has it (no weights loaded)."""
    alias = entry.alias
    if chat:
        if not entry.chat_template:
            raise PolspecError(f"{alias} has no chat template; run in raw mode (--raw) or choose another model")
        if not getattr(tokenizer, "chat_template", None):
            raise PolspecError(f"{alias} is registered with a chat template but its tokenizer has none: "
                               "set chat_template = false for it in models.toml, or run in raw mode (--raw)")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        try:
            return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
        except Exception as error:  # the template's own checks (role order, ...) raise jinja errors
            raise PolspecError(f"{alias}'s chat template refused the messages: {error}") from None
    if not isinstance(prompt, str):
        raise PolspecError("raw mode continues a text; messages need chat mode")
    return tokenizer.encode(prompt)


def encode_request(
    target: LoadedModel, draft: LoadedModel | None, prompt: Prompt, params: DecodingParams, chat: bool | None
) -> tuple[list[int], list[int] | None]:
    """Target and draft prompt ids for one request, or a PolspecError saying why it cannot run.

    ``chat=None`` uses the chat template when the target has one.
    """
    check_prompt(prompt)
    chat = chat_mode(target.entry, chat)
    check_draft_template(target.entry, draft.entry if draft is not None else None, chat, raw_option="chat=False")
    target_ids = encode_prompt(target, prompt, chat)
    reason = too_long(target.entry, len(target_ids), params.max_tokens, target.context_length)
    if reason:
        raise PolspecError(reason)
    return target_ids, encode_prompt(draft, prompt, chat) if draft is not None else None


def too_long(target: ModelEntry, prompt_tokens: int, max_tokens: int, limit: int | None) -> str | None:
    """Why a prompt of ``prompt_tokens`` plus ``max_tokens`` more does not fit the target, or None."""
    if limit and prompt_tokens + max_tokens > limit:
        return (f"the prompt has {prompt_tokens} tokens and {max_tokens} more were asked for, "
                f"but {target.alias} takes at most {limit}")
    return None


def draft_cannot_take(draft: LoadedModel, draft_ids: list[int], params: DecodingParams) -> str | None:
    """Why ``draft`` cannot propose for this prompt, or None. Its context is shorter than the
    prompt and the tokens asked for: its positions past that are untrained and its proposals
    worthless, while feeding it such a prompt can cost more than the whole target-only run. The
    decoders then run the request target-only, with this reason as its ``k_policy_note``."""
    limit = draft.context_length
    if limit and len(draft_ids) + params.max_tokens > limit:
        return (f"plain decoding: the prompt has {len(draft_ids)} of {draft.entry.alias}'s tokens and "
                f"{params.max_tokens} more were asked for, but the draft takes at most {limit}")
    return None
