"""Replay draft-length policies on recorded acceptance, to compare them without timing noise.

    .venv/bin/python bench/replay_auto.py --dataset pl-instruct --prompts 8 --max-tokens 24

Greedy speculative decoding is lossless, so a prompt's committed text is the target's own
greedy text whatever the draft length. This script decodes each prompt target-only once and,
at every position of that text, lets the draft (fed the text so far, as in decoding) propose
``k_max`` tokens and records, for each k, how many target candidates its first k tokens
translate into and how many of them the target's text accepts, and the draft's probability of
each token (for the confidence stop). Any policy can then be replayed
on that table in milliseconds: each round's k comes from the real :class:`DraftLength`, its
outcome from the table, and its cost from the probe (draft steps, the draft's catch-up on text
it has not seen, verification over the candidates). The replayed speedup is the cost model's
prediction on real acceptance; it ranks policies on the same prompts free of the machine's
timing drift, which a decode benchmark then confirms. The last row is an oracle that knows
every round's outcome: the most any draft-length policy could get from this draft.

Recording takes 1-2 minutes a prompt on a 2-core CPU with the 1.5B target; ``--recording FILE``
keeps it, so that replaying another policy costs seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx

from polspec.decoding import DecodingParams, generate
from polspec.decoding.acceptance import PLAIN_HALF_LIFE, AcceptanceEstimate
from polspec.decoding.costmodel import Probe
from polspec.decoding.draft_vocab import draft_head
from polspec.decoding.metrics import DecodeMetrics
from polspec.decoding.policy import DraftLength
from polspec.decoding.probe_files import load_probe
from polspec.decoding.prompts import encode_request
from polspec.decoding.speculative import DraftSide, translate_proposal, translation_tables
from polspec.jobs.datasets import load_dataset
from polspec.models.loader import load_model
from polspec.report.summary import mean_interval


@dataclass
class Recorded:
    """One prompt's table: ``outcomes[i][k - 1]`` = (candidates, accepted) of a k-token draft at
    position i, and ``confidence[i][j]`` the draft's probability of its j-th token there."""

    draft_prompt_tokens: int
    outcomes: list[list[tuple[int, int]]]
    confidence: list[list[float]]


def _greedy_with_confidence(logits: mx.array, step: int) -> tuple[mx.array, mx.array]:
    """A draft draw that takes the argmax and keeps its probability."""
    return mx.argmax(logits), mx.softmax(logits).max()


def record(target_alias: str, draft_alias: str, dataset: str, count: int, max_tokens: int) -> list[Recorded]:
    target, draft = load_model(target_alias), load_model(draft_alias)
    params = DecodingParams(max_tokens=max_tokens, k="auto")
    fixed = DraftLength(DecodingParams(k=params.k_max))
    tables = translation_tables(target, draft)
    head = draft_head(draft, params.draft_vocab)
    recorded = []
    for n, item in enumerate(load_dataset(dataset, DecodingParams(), count)):
        truth = generate(target, None, item.prompt, DecodingParams(max_tokens=max_tokens), chat=False).token_ids
        target_ids, draft_ids = encode_request(target, draft, item.prompt, params, chat=False)
        side = DraftSide(draft, draft_ids, tables and tables[0], head)
        outcomes, confidence = [], []
        for i in range(len(truth)):
            proposal = side.propose(params.k_max, fixed, _greedy_with_confidence)
            confidence.append([p.item() for p in side.probabilities])
            context = target_ids[-params.prefix - 8:] + truth[:i]
            row = []
            for k in range(1, params.k_max + 1):
                candidates = translate_proposal(params, tables, proposal[:k], context, side.text.lag, DecodeMetrics())
                candidates = candidates[: len(truth) - i]
                accepted = next((j for j, (c, t) in enumerate(zip(candidates, truth[i:])) if c != t), len(candidates))
                row.append((len(candidates), accepted))
            outcomes.append(row)
            side.resync(truth[: i + 1], tables[1].text(truth[i: i + 1]) if tables else b"")
        recorded.append(Recorded(len(draft_ids), outcomes, confidence))
        print(f"recorded prompt {n + 1}: {len(truth)} tokens", flush=True)
    return recorded


def replay_cost(probe: Probe, k: int, candidates: int, unfed: int) -> float:
    """A round's cost in target steps: k draft steps (the first also feeding ``unfed`` tokens),
    the per-round overhead, verification over ``candidates`` + 1 positions, translation.
    :func:`~polspec.decoding.costmodel.round_cost` with the round's own candidate count, which
    may be 0, in place of the pair's ratio, plus the catch-up."""
    if k == 0:
        return 1.0
    return k * probe.c + probe.draft_feed_steps(unfed, 1) + probe.draft_overhead + probe.rho_at(candidates + 1) + probe.tau


class ForgettingDraftLength(DraftLength):
    """``auto`` whose sequence estimate also ages in drafting rounds, by half every
    ``half_life`` of them: the experiment for texts whose acceptance comes in bursts."""

    def __init__(self, params: DecodingParams, probe: Probe, pooled: AcceptanceEstimate, half_life: float):
        self.half_life = half_life
        super().__init__(params, probe, pooled)

    def observe(self, accepted: int, candidates: int, proposed: int) -> None:
        if proposed:
            self.estimate.age(self.pooled.prior(), rounds=PLAIN_HALF_LIFE / self.half_life)
        super().observe(accepted, candidates, proposed)


@dataclass
class Replayed:
    speedup: float
    rounds: int
    plain_rounds: int


def replay(recorded: list[Recorded], probe: Probe, k: int | str,
           policy_class: Callable[[DecodingParams, Probe, AcceptanceEstimate], DraftLength] = DraftLength,
           stop_below: float | None = None, extend: bool = True) -> list[Replayed]:
    """Each prompt replayed with one policy; prompts share one pooled estimate, as in a worker.
    With ``stop_below`` a proposal also ends after a token the draft gives a lower probability
    (the confidence stop), paying the step of lookahead it takes back; otherwise ``auto``
    drafts past its k while the draft is sure (:meth:`DraftLength.most_within`), unless
    ``extend`` is off (``auto`` as it was before session 34)."""
    params = DecodingParams(k=k, confidence=stop_below or 0.5)
    pooled = AcceptanceEstimate()
    replayed = []
    for prompt in recorded:
        policy = policy_class(params, probe, pooled) if k == "auto" else DraftLength(params)
        length = len(prompt.outcomes)
        position, cost, rounds, plain, unfed = 0, 0.0, 0, 0, prompt.draft_prompt_tokens - 1
        while position < length:
            rounds += 1
            k_now = policy.k_within(length - position, unfed)
            if k_now == 0:
                policy.observe(0, 0, 0)
                cost, position, unfed, plain = cost + 1.0, position + 1, unfed + 1, plain + 1
                continue
            drafted, steps = k_now, k_now
            if stop_below is not None:
                drafted = next((j + 1 for j, p in enumerate(prompt.confidence[position][:k_now]) if p < stop_below), k_now)
                steps = drafted + (drafted < k_now)
            elif extend:
                most = min(policy.most_within(k_now, length - position), len(prompt.outcomes[position]))
                while drafted < most and prompt.confidence[position][drafted - 1] >= policy.threshold:
                    drafted += 1
                steps = drafted
            candidates, accepted = prompt.outcomes[position][drafted - 1]
            cost += replay_cost(probe, steps, candidates, unfed)
            policy.observe(accepted, candidates, drafted)
            position += min(accepted + 1, length - position)
            unfed = 0  # the draft keeps what it proposed and the target accepted
        replayed.append(Replayed(length / cost, rounds, plain))
    return replayed


def oracle(recorded: list[Recorded], probe: Probe) -> list[Replayed]:
    """The best any draft-length policy could do on each prompt, knowing every round's outcome
    in advance (by dynamic programming over positions), the draft's catch-up left out: an upper
    bound for this draft on this machine."""
    replayed = []
    for prompt in recorded:
        length = len(prompt.outcomes)
        best = [(0.0, 0, 0)] * (length + 1)  # (cost to the end, rounds, plain rounds) from each position
        for position in range(length - 1, -1, -1):
            cost, rounds, plain = best[position + 1]
            options = [(cost + 1.0, rounds + 1, plain + 1)]
            for k, (candidates, accepted) in enumerate(prompt.outcomes[position], start=1):
                cost, rounds, plain = best[position + min(accepted + 1, length - position)]
                options.append((cost + replay_cost(probe, k, candidates, 0), rounds + 1, plain))
            best[position] = min(options)
        replayed.append(Replayed(length / best[0][0], best[0][1], best[0][2]))
    return replayed


def session_probe(c: float, target_step_s: float, feed_per_token: float) -> Probe:
    """A probe from earlier figures, for a machine that has not measured the pair: rho(2..5)
    from the 1.5B pair's probe of session 32 (AMD EPYC VM), extended by 0.05 a position to
    rho(9), translation and per-round overhead at 0.005 and 0.01 target steps (assumed), and
    the draft's catch-up at ``feed_per_token`` target steps a token."""
    rho = (1.0, 1.18, 1.19, 1.14, 1.33, 1.38, 1.43, 1.48, 1.53)
    return Probe("target", "draft", c=c, rho=rho, tau=0.005, draft_overhead=0.01, target_step_s=target_step_s,
                 draft_feed_s=feed_per_token * target_step_s)


def load_or_record(path: Path | None, args: argparse.Namespace) -> list[Recorded]:
    """The recording at ``path`` when it exists; otherwise recorded now (and saved there)."""
    if path is not None and path.exists():
        return [Recorded(**prompt) for prompt in json.loads(path.read_text())]
    recorded = record(args.target, args.draft, args.dataset, args.prompts, args.max_tokens)
    if path is not None:
        path.write_text(json.dumps([asdict(prompt) for prompt in recorded]))
    return recorded


def table_row(name: str, replayed: list[Replayed]) -> str:
    speedups = [r.speedup for r in replayed]
    mean, low, high = mean_interval(speedups)
    rounds = sum(r.rounds for r in replayed)
    return (f"| {name} | {statistics.median(speedups):.3f}x ({min(speedups):.2f}-{max(speedups):.2f}) "
            f"| {mean:.3f}x [{low:.2f}-{high:.2f}] | {sum(r.plain_rounds for r in replayed) / rounds:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="gemma3-270m")
    parser.add_argument("--dataset", default="pl-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--recording", type=Path, help="JSON file: read the table from it if it exists, else save it there")
    parser.add_argument("--c", type=float, default=0.098,
                        help="draft step / target step, where no probe of the pair is stored on this machine")
    parser.add_argument("--feed", type=float, default=0.017,
                        help="target steps per token of draft catch-up, where no probe is stored")
    parser.add_argument("--half-lives", default="4,8", help="drafting-round half-lives of the forgetting experiment")
    args = parser.parse_args()
    recorded = load_or_record(args.recording, args)
    probe = load_probe(args.target, args.draft)
    source = "this machine's stored probe"
    if probe is None:
        probe, source = session_probe(args.c, 0.831, args.feed), "session 32's figures (no probe stored here)"
    print(f"\n{args.target} < {args.draft}, {args.dataset}, {len(recorded)} prompts, "
          f"c = {probe.c:.3f} from {source}\n")
    print("| policy | replayed speedup (median, min-max) | mean [95% interval] | plain rounds |\n|---|---|---|---|")
    for k in (1, 2, 3, 4):
        print(table_row(f"k = {k}", replay(recorded, probe, k)))
    print(table_row("auto", replay(recorded, probe, "auto")))
    print(table_row("auto, never past its k", replay(recorded, probe, "auto", extend=False)))
    for half_life in args.half_lives.split(","):
        print(table_row(f"auto, ageing in drafting rounds too (half-life {half_life})",
                        replay(recorded, probe, "auto", partial(ForgettingDraftLength, half_life=float(half_life)))))
    for threshold in (0.4, 0.5, 0.7, 0.9):
        print(table_row(f"confidence {threshold} (up to 8)", replay(recorded, probe, "confidence", stop_below=threshold)))
    for threshold in (0.3, 0.5, 0.7):
        print(table_row(f"auto, stopping below confidence {threshold}", replay(recorded, probe, "auto", stop_below=threshold)))
    print(table_row("oracle: the best k every round, known in advance", oracle(recorded, probe)))


if __name__ == "__main__":
    main()
