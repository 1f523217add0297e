"""One generation end to end: prompts for both models, the decoder, the collected result."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

from polspec.cpu_share import release_cores, share_cores
from polspec.decoding.acceptance import acceptance_estimate
from polspec.decoding.autoregressive import generate_autoregressive
from polspec.decoding.commit import Commit
from polspec.decoding.costmodel import BATCH_SIZES, Probe, can_pay
from polspec.decoding.draft_vocab import draft_head
from polspec.decoding.measure import measure_probe
from polspec.decoding.metrics import DecodeMetrics
from polspec.decoding.params import DecodingParams
from polspec.decoding.policy import DraftLength
from polspec.decoding.probe_files import load_probe, save_probe
from polspec.decoding.prompts import Prompt, draft_cannot_take, encode_prompt, encode_request  # noqa: F401  (encode_prompt: part of this API)
from polspec.decoding.speculative import generate_speculative
from polspec.decoding.translate import same_tokenizer
from polspec.models.loader import LoadedModel

@dataclass
class GenerationResult:
    """The committed text and ids, which spans came from the draft, and the metrics."""

    text: str
    token_ids: list[int]
    spans: list[tuple[str, bool]] = field(default_factory=list)  # (text, accepted from the draft)
    metrics: DecodeMetrics = field(default_factory=DecodeMetrics)


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
    if draft is not None:
        same_tokenizer(target, draft)  # a wrong tokenizer family is refused, whether the draft runs or not
    target_ids, draft_ids = encode_request(target, draft, prompt, params, chat)
    speculative = draft is not None
    if draft is not None and (reason := draft_cannot_take(draft, draft_ids, params)):
        metrics.k_policy_note = reason
        draft = None
    policy = None
    if draft is not None and params.k == "auto":
        policy = auto_draft_length(target, draft, params)
        if policy is None:
            metrics.k_policy_note = "auto: plain decoding, no k can pay on this machine even with a perfect draft"
            draft = None
    if draft is None:
        return sharing_cores(generate_autoregressive(target, target_ids, params, metrics, without_its_draft=speculative))
    return sharing_cores(generate_speculative(target, draft, target_ids, draft_ids, params, metrics, policy))


def sharing_cores(commits: Generator[Commit, None, None]) -> Iterator[Commit]:
    """``commits``, this process taking its share of the CPU (:func:`~polspec.cpu_share.share_cores`)
    before the first round and between rounds, and giving it back at the end; closing it closes
    ``commits`` at once."""
    share_cores()
    try:
        for commit in commits:
            yield commit
            share_cores()
    finally:
        commits.close()
        release_cores()


def stored_probe(target: LoadedModel, draft: LoadedModel, batched: bool = False,
                 draft_vocab: int | str = "auto") -> Probe:
    """This machine's stored probe for the pair; measured and stored first when there is none,
    when ``batched`` needs the batch table and the stored probe has none, or when it was
    measured with another draft vocabulary than ``draft_vocab`` gives (compared by the tokens
    the draft's head keeps, the size plus the byte and special tokens, as the probe records)."""
    probe = load_probe(target.entry.alias, draft.entry.alias)
    if probe_outdated(probe, draft, batched, draft_vocab):
        probe = measure_probe(target, draft, batch_sizes=BATCH_SIZES if batched else (), draft_vocab=draft_vocab)
        save_probe(probe)
    return probe


def probe_outdated(probe: Probe | None, draft: LoadedModel, batched: bool = False,
                   draft_vocab: int | str = "auto") -> bool:
    """Whether :func:`stored_probe` measures the pair again rather than use ``probe``: none
    stored, a batched use and no batch table or one that stopped short of ``BATCH_SIZES`` (an
    earlier polspec's, to 16), or another draft vocabulary."""
    if batched and (not probe or not probe.batch
                    or max(probe.largest_batch_tried, *(cost.size for cost in probe.batch)) < BATCH_SIZES[-1]):
        return True
    return probe is None or probe.draft_vocab != draft_head(draft, draft_vocab).size


def auto_draft_length(target: LoadedModel, draft: LoadedModel, params: DecodingParams) -> DraftLength | None:
    """The ``auto`` policy for this pair from its :func:`stored_probe`, or None when the probe
    says no k can beat plain decoding here."""
    probe = stored_probe(target, draft, draft_vocab=params.draft_vocab)
    if not can_pay(probe, params.k_max):
        return None
    return DraftLength(params, probe, acceptance_estimate(target.entry.alias, draft.entry.alias, params))


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
    transcript = Transcript()
    for commit in stream(target, draft, prompt, params, metrics, chat):
        transcript.add(commit)
        if on_commit is not None:
            on_commit(len(transcript.tokens), metrics)
    return transcript.result(target, metrics)


@dataclass
class Transcript:
    """The commits of one sequence gathered into a :class:`GenerationResult`; the batched
    decoder's callers (the worker) collect each sequence's events with one of these too."""

    tokens: list[int] = field(default_factory=list)
    marks: list[bool] = field(default_factory=list)  # per token: proposed by the draft

    def add(self, commit: Commit) -> None:
        self.tokens += commit.tokens
        self.marks += [i < commit.drafted for i in range(len(commit.tokens))]

    def result(self, target: LoadedModel, metrics: DecodeMetrics) -> GenerationResult:
        return GenerationResult(target.tokenizer.decode(self.tokens), self.tokens,
                                _spans(target, self.tokens, self.marks), metrics)


def _spans(target: LoadedModel, tokens: list[int], marks: list[bool]) -> list[tuple[str, bool]]:
    """Group committed tokens into runs that did or did not come from the draft.

    The spans join to exactly the text: a run ends only where the text decoded so far is a
    prefix of the whole text. Where a character's bytes are split across two runs (a Polish
    letter in two byte tokens), the cut moves past the character and the earlier run takes it,
    instead of leaving half a character (U+FFFD) on each side.
    """
    text = target.tokenizer.decode(tokens)
    spans: list[tuple[str, bool]] = []
    start, done = 0, 0  # the run's first token, and the characters of text already in spans
    for end in range(1, len(tokens) + 1):
        if end < len(tokens):
            if marks[end] == marks[start]:
                continue
            prefix = target.tokenizer.decode(tokens[:end])
            if not text.startswith(prefix):
                continue
            cut = len(prefix)
        else:
            cut = len(text)
        if cut > done:
            spans.append((text[done:cut], marks[start]))
        start, done = end, max(done, cut)
    return spans
