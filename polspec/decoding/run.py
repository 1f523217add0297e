"""One generation end to end: prompts for both models, the decoder, the collected result."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx

from polspec.decoding.autoregressive import generate_autoregressive
from polspec.decoding.commit import Commit
from polspec.decoding.costmodel import Probe, acceptance_estimate, can_pay, load_probe, save_probe
from polspec.decoding.costmodel import probe as measure_probe
from polspec.decoding.metrics import DecodeMetrics
from polspec.decoding.params import DecodingParams
from polspec.decoding.policy import DraftLength
from polspec.decoding.speculative import generate_speculative
from polspec.errors import PolspecError
from polspec.models.loader import LoadedModel

Prompt = str | list[dict]


@dataclass
class GenerationResult:
    """The committed text and ids, which spans came from the draft, and the metrics."""

    text: str
    token_ids: list[int]
    spans: list[tuple[str, bool]] = field(default_factory=list)  # (text, accepted from the draft)
    metrics: DecodeMetrics = field(default_factory=DecodeMetrics)


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


def stream(
    target: LoadedModel,
    draft: LoadedModel | None,
    prompt: Prompt,
    params: DecodingParams,
    metrics: DecodeMetrics,
    chat: bool | None = None,
) -> Iterator[Commit]:
    """Committed tokens as they are decided; ``draft=None`` runs target-only decoding.

    ``chat=None`` uses the chat template when the target has one. ``metrics`` is filled
    in as decoding goes.
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
    if params.seed is not None:
        mx.random.seed(params.seed)
    policy = None
    if draft is not None and params.k == "auto":
        policy = auto_draft_length(target, draft, params)
        if policy is None:
            metrics.k_policy_note = "auto: plain decoding, no k can pay on this machine even with a perfect draft"
            draft = None
    if draft is None:
        return generate_autoregressive(target, target_ids, params, metrics)
    draft_ids = encode_prompt(draft, prompt, chat)
    return generate_speculative(target, draft, target_ids, draft_ids, params, metrics, policy)


def stored_probe(target: LoadedModel, draft: LoadedModel) -> Probe:
    """This machine's stored probe for the pair; measured and stored first when there is none."""
    probe = load_probe(target.entry.alias, draft.entry.alias)
    if probe is None:
        probe = measure_probe(target, draft)
        save_probe(probe)
    return probe


def auto_draft_length(target: LoadedModel, draft: LoadedModel, params: DecodingParams) -> DraftLength | None:
    """The ``auto`` policy for this pair from its :func:`stored_probe`, or None when the probe
    says no k can beat plain decoding here."""
    probe = stored_probe(target, draft)
    if not can_pay(probe, params.k_max):
        return None
    translation = f"aligned/{params.partial_word}" if params.strategy == "aligned" else params.strategy
    return DraftLength(params, probe, acceptance_estimate(target.entry.alias, draft.entry.alias, translation))


def generate(
    target: LoadedModel,
    draft: LoadedModel | None,
    prompt: Prompt,
    params: DecodingParams,
    chat: bool | None = None,
    on_commit: Callable[[int, DecodeMetrics], None] | None = None,
) -> GenerationResult:
    """Decode ``prompt`` to the end and return the text, ids, draft spans and metrics.

    ``on_commit(tokens so far, metrics)`` runs after every round; an exception it raises
    stops decoding (the worker cancels this way).
    """
    metrics = DecodeMetrics()
    tokens: list[int] = []
    marks: list[bool] = []
    for commit in stream(target, draft, prompt, params, metrics, chat):
        tokens += commit.tokens
        marks += [i < commit.drafted for i in range(len(commit.tokens))]
        if on_commit is not None:
            on_commit(len(tokens), metrics)
    return GenerationResult(target.tokenizer.decode(tokens), tokens, _spans(target, tokens, marks), metrics)


def _spans(target: LoadedModel, tokens: list[int], marks: list[bool]) -> list[tuple[str, bool]]:
    """Group committed tokens into runs that did or did not come from the draft."""
    spans: list[tuple[str, bool]] = []
    start = 0
    for end in range(1, len(tokens) + 1):
        if end == len(tokens) or marks[end] != marks[start]:
            before = target.tokenizer.decode(tokens[:start])
            spans.append((target.tokenizer.decode(tokens[:end])[len(before):], marks[start]))
            start = end
    return spans
