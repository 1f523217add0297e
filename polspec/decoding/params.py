"""Decoding parameters: explicit data, validated at the edge."""

from __future__ import annotations

import datetime
import json
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, fields

from polspec.errors import PolspecError

STRATEGIES = ("aligned", "context", "naive", "none")  # see polspec.decoding.translate
# Options of translation strategies, and the strategies that read them.
STRATEGY_OPTIONS = {"prefix": {"aligned", "context"}, "partial_word": {"aligned"}}
K_POLICIES = ("heuristic", "confidence", "auto")
PARTIAL_WORD = ("verify", "hold")  # what aligned does with the tokens of a word a proposal stops inside
MAX_K = 16
DRAFT_VOCAB = ("auto", "full")  # or a number of tokens, see polspec.decoding.draft_vocab
MIN_DRAFT_VOCAB = 1024
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 1e6
_PLAIN = (int, float, str, bool, type(None))  # what DecodingParams holds without conversion
MIN_TOP_P = 1e-6  # below ~1e-45 the nucleus's float32 mass is 0 and every draw is token 0
MAX_DRAFT_VOCAB = 65_536  # a pruned size, past which a draft runs its full vocabulary or nothing pays
# Seeds are stored in 64-bit signed integer columns and become MLX random keys (unsigned 64-bit).
MAX_SEED = 2**63 - 1
# More than any model's context (the worker, and enqueue where the target's files are here,
# refuse what exceeds the target's own); a bound for where they are not, so that a typo with
# twenty digits is not queued with a job timeout no worker could set.
MAX_TOKENS = 2**20
VERIFY = ("auto", "exact", "tli")  # how a sampled round is verified, see polspec.decoding.speculative_sampling


def options_unread_by(strategies: Iterable[str], names: Iterable[str]) -> list[str]:
    """Of ``names``, the translation strategies' own options that none of ``strategies`` reads."""
    used = set(strategies)
    return [name for name in names if name in STRATEGY_OPTIONS and not STRATEGY_OPTIONS[name] & used]


@dataclass(frozen=True)
class DecodingParams:
    """How to decode one prompt.

    ``k`` is the draft length (a number, or a policy name: ``heuristic`` adapts it from
    acceptance, ``confidence`` stops drafting when the draft's top probability falls below
    ``confidence``, ``auto`` chooses it from the machine's cost model, down to plain
    decoding, and drafts past it while the draft is sure of its tokens). ``strategy`` and
    ``prefix`` choose the translation between tokenizers, and ``partial_word`` whether
    ``aligned`` verifies the tokens of a word the draft stopped inside (``verify``: one more
    position in the same forward) or leaves them for the next round (``hold``: fewer rejected
    candidates, fewer tokens per round). ``draft_vocab`` is how
    many tokens the draft may propose: its most frequent on Polish text (``auto``: the draft's
    default, pruned only where its vocabulary is large; ``full``: all of them). ``temperature``
    0 is greedy. ``k_max`` bounds the policies' draft length (a number k is its own). Target
    candidates per round are capped at ``2 * k + 2`` (``2 * k_max + 2`` under a policy).

    ``verify`` says how a sampled round (``temperature`` > 0) accepts draft tokens: ``exact``
    keeps a translated candidate only where the target samples the same token; ``tli`` is
    speculative sampling over the two vocabularies' shared tokens (the draft samples, the
    target accepts with probability min(1, p/q), see :mod:`polspec.decoding.speculative_sampling`);
    ``auto`` is ``tli``. Greedy decoding always verifies by exact match with ``strategy``.
    """

    max_tokens: int = 128
    k: int | str = 2
    strategy: str = "aligned"
    prefix: int = 5
    partial_word: str = "verify"
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    confidence: float = 0.4
    k_max: int = 8
    draft_vocab: int | str = "auto"
    verify: str = "auto"

    def __post_init__(self) -> None:
        # A library caller's grid may hold numpy scalars (np.arange, np.linspace): taken as the
        # Python numbers they are, so that validation, JSON storage and seeds see plain values.
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if type(value) in _PLAIN:  # nearly always: the checks below are slow
                continue
            if isinstance(value, numbers.Integral) and not isinstance(value, (int, bool)):
                object.__setattr__(self, name, int(value))
            elif isinstance(value, numbers.Real) and not isinstance(value, (float, numbers.Integral)):
                object.__setattr__(self, name, float(value))
        # Values come from JSONL lines and TOML files too: a float k or a text seed is refused
        # here rather than truncated or failing on the worker.
        for name in ("max_tokens", "prefix", "top_k", "k_max", *(("seed",) if self.seed is not None else ())):
            if not is_whole_number(getattr(self, name)):
                raise PolspecError(f"{name} must be a whole number, got {as_written(getattr(self, name))}")
        for name in ("temperature", "top_p", "confidence"):
            if not is_whole_number(getattr(self, name)) and not isinstance(getattr(self, name), float):
                raise PolspecError(f"{name} must be a number, got {as_written(getattr(self, name))}")
        if not isinstance(self.k, str) and not is_whole_number(self.k):
            raise PolspecError(f"k must be a number from 1 to {MAX_K} or one of {', '.join(K_POLICIES)}, "
                               f"got {as_written(self.k)}")
        if isinstance(self.draft_vocab, str):
            if self.draft_vocab not in DRAFT_VOCAB:
                raise PolspecError(f"draft_vocab must be a number of tokens or one of {', '.join(DRAFT_VOCAB)}, "
                                   f"got {as_written(self.draft_vocab)}")
        elif not is_whole_number(self.draft_vocab) or not MIN_DRAFT_VOCAB <= self.draft_vocab <= MAX_DRAFT_VOCAB:
            raise PolspecError(f"draft_vocab must be {MIN_DRAFT_VOCAB} to {MAX_DRAFT_VOCAB} tokens, auto or full, "
                               f"got {as_written(self.draft_vocab)}")
        if not 1 <= self.max_tokens <= MAX_TOKENS:
            raise PolspecError(f"max_tokens must be at least 1 and at most {MAX_TOKENS:,}, got {self.max_tokens}")
        if isinstance(self.k, str):
            if self.k not in K_POLICIES:
                raise PolspecError(f"k must be a number from 1 to {MAX_K} or one of {', '.join(K_POLICIES)}, "
                                   f"got {as_written(self.k)}")
        elif not 1 <= self.k <= MAX_K:
            raise PolspecError(f"k must be between 1 and {MAX_K}, got {self.k}")
        if not 1 <= self.k_max <= MAX_K:
            raise PolspecError(f"k_max must be between 1 and {MAX_K}, got {self.k_max}")
        if self.strategy not in STRATEGIES:
            raise PolspecError(f"unknown strategy {as_written(self.strategy)}; choose one of {', '.join(STRATEGIES)}")
        if self.partial_word not in PARTIAL_WORD:
            raise PolspecError(f"partial_word must be one of {', '.join(PARTIAL_WORD)}, "
                               f"got {as_written(self.partial_word)}")
        if self.prefix < 0:
            raise PolspecError(f"prefix must be 0 or more, got {self.prefix}")
        if not 0 <= self.temperature < math.inf:
            raise PolspecError(f"temperature must be a finite number, 0 or more, got {self.temperature}")
        if self.temperature and not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            # Past these the sampler's float32 scale (1 / temperature) is infinite or 0, and every
            # draw would be token 0: refused rather than generate padding.
            raise PolspecError(f"temperature must be 0 (greedy) or from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}, "
                               f"got {self.temperature}")
        if not MIN_TOP_P <= self.top_p <= 1:
            raise PolspecError(f"top_p must be from {MIN_TOP_P:g} to 1 (1: off), got {self.top_p}")
        if self.top_k < 0:
            raise PolspecError(f"top_k must be 0 (off) or more, got {self.top_k}")
        if self.verify not in VERIFY:
            raise PolspecError(f"verify must be one of {', '.join(VERIFY)}, got {as_written(self.verify)}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise PolspecError(f"seed must be between 0 and {MAX_SEED} (2**63 - 1), got {self.seed}")
        if not 0 < self.confidence < 1:
            raise PolspecError(f"confidence must be in (0, 1), got {self.confidence}")

    @property
    def initial_k(self) -> int:
        return self.k if isinstance(self.k, int) else min(2, self.k_max)

    @property
    def candidate_cap(self) -> int:
        """Most target candidates verified in one round: bounds the verification cost."""
        return 2 * (self.k if isinstance(self.k, int) else self.k_max) + 2

    @property
    def verification(self) -> str:
        """How this sequence's rounds are verified: ``exact`` or ``tli`` (only when sampling)."""
        if self.temperature == 0 or self.verify == "exact":
            return "exact"
        return "tli"

    def as_dict(self) -> dict:
        # Not dataclasses.asdict: every field is a scalar, and its deep copy took most of the
        # time of expanding a sweep of 345,000 items.
        return {field.name: getattr(self, field.name) for field in fields(self)}


def as_written(value: object) -> str:
    """A value in an error as a JSONL line or a TOML file writes it: ``true``, not ``True``;
    a TOML date or time as written (``1979-05-27``); text in quotes, as Python would show it."""
    if isinstance(value, (datetime.date, datetime.time)):  # a datetime is a date too
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # nan, inf: TOML's spelling
    return repr(value) if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def is_whole_number(value: object) -> bool:
    """An int that is not a bool: TOML and JSON ``true`` must not pass as 1."""
    return isinstance(value, int) and not isinstance(value, bool)
