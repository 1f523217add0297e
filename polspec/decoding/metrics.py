"""What one generation measured: counts, acceptance, time split, speed, memory."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class DecodeMetrics:
    """Filled in by a decoder while it runs; read after it finishes.

    Acceptance is reported both per target candidate (how many translated candidates the
    target accepted) and per draft token (how many proposed draft tokens ended up inside
    committed text). A boundary miss is a round whose text agreed with the target's while
    its tokens did not.
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    draft_tokens_accepted: int = 0
    candidates: int = 0
    candidates_accepted: int = 0
    boundary_misses: int = 0
    rejections: int = 0  # rounds that ended on a rejected candidate (for the acceptance estimate)
    plain_rounds: int = 0  # rounds spent as plain target steps (k = 0: auto's choice, or the draft's context reached)
    prefill_s: float = 0.0  # the target's prompt; the draft's is fed on its first proposal (in draft_s)
    draft_s: float = 0.0
    translate_s: float = 0.0
    verify_s: float = 0.0
    resync_s: float = 0.0
    decode_s: float = 0.0
    peak_memory_gb: float = 0.0
    batch_size: float = 1.0  # sequences decoded together, averaged over this sequence's rounds
    finish_reason: str = ""
    draft_vocab: int | None = None  # tokens the draft could propose (a pruned vocabulary); None: all
    verify: str | None = None  # how rounds were verified (exact, tli); None without a draft
    # Why a generation with a draft decoded without it (auto's cost model, a long prompt), or
    # from which token on (the draft's context reached).
    k_policy_note: str = ""
    seed: int | None = None  # the sampler's seed when sampling (drawn when none given): reruns it at a fixed k

    def note_if_never_drafted(self, k: int | str) -> None:
        """Say why, when ``auto`` chose a plain target step for every round (a note already made,
        such as a prompt too long for the draft, stands)."""
        if k == "auto" and self.rounds and self.plain_rounds == self.rounds and not self.k_policy_note:
            self.k_policy_note = ("auto: plain decoding every round: no k was expected to pay, at this machine's "
                                  "costs and the acceptance seen")

    @property
    def acceptance_per_candidate(self) -> float | None:
        return self.candidates_accepted / self.candidates if self.candidates else None

    @property
    def acceptance_per_draft_token(self) -> float | None:
        return self.draft_tokens_accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def tokens_per_round(self) -> float | None:
        return self.generated_tokens / self.rounds if self.rounds else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else None

    def as_dict(self) -> dict:
        data = asdict(self)
        for name in ("acceptance_per_candidate", "acceptance_per_draft_token", "tokens_per_round", "decode_tokens_per_s"):
            data[name] = getattr(self, name)
        return data
