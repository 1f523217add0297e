"""A request's prompt ids for each model: chat templates, raw text, and the length checks."""

from __future__ import annotations

from polspec.decoding.params import DecodingParams
from polspec.errors import PolspecError
from polspec.models.loader import LoadedModel

Prompt = str | list[dict]


def has_chat_template(model: LoadedModel) -> bool:
    return bool(getattr(model.tokenizer, "chat_template", None))


def encode_prompt(model: LoadedModel, prompt: Prompt, chat: bool) -> list[int]:
    """The model's own prompt ids: its chat template applied to the messages, or the raw text.

    Each model renders the request with its own template, so the draft never sees the
    target's special tokens as text.
    """
    alias = model.entry.alias
    if chat:
        if not has_chat_template(model):
            raise PolspecError(f"{alias} has no chat template; run in raw mode (--raw) or choose another model")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                   for m in messages):
            raise PolspecError("messages must be objects with a string 'role' and a string 'content'")
        try:
            return list(model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
        except Exception as error:  # the template's own checks (role order, ...) raise jinja errors
            raise PolspecError(f"{alias}'s chat template refused the messages: {error}") from None
    if not isinstance(prompt, str):
        raise PolspecError("raw mode continues a text; messages need chat mode")
    return model.tokenizer.encode(prompt)


def encode_request(
    target: LoadedModel, draft: LoadedModel | None, prompt: Prompt, params: DecodingParams, chat: bool | None
) -> tuple[list[int], list[int] | None]:
    """Target and draft prompt ids for one request, or a PolspecError saying why it cannot run.

    ``chat=None`` uses the chat template when the target has one.
    """
    text = prompt if isinstance(prompt, str) else " ".join(
        m["content"] for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str))
    if not text.strip():
        raise PolspecError("the prompt is empty")
    chat = has_chat_template(target) if chat is None else chat
    target_ids = encode_prompt(target, prompt, chat)
    limit = target.context_length
    if limit and len(target_ids) + params.max_tokens > limit:
        raise PolspecError(
            f"the prompt has {len(target_ids)} tokens and {params.max_tokens} more were asked for, "
            f"but {target.entry.alias} takes at most {limit}"
        )
    return target_ids, encode_prompt(draft, prompt, chat) if draft is not None else None
