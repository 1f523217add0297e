"""The cost model against worked examples, the acceptance store, probe files, the probe on real
models, and the auto draft length."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest
from click.testing import CliRunner

from polspec.cli import main
from polspec.decoding import DecodingParams, generate, run
from polspec.decoding.acceptance import PLAIN_HALF_LIFE, PRIOR_WEIGHT, AcceptanceEstimate, acceptance_estimate
from polspec.decoding.costmodel import (
    BATCH_POSITIONS, BATCH_SIZES, PREDICTION_FORMATS, PROBE_FORMAT, UNPROBED_BATCH_SIZE, BatchCost, Probe, accepted_share, best_k, best_shared_k, break_even_acceptance, can_pay,
    expected_tokens, predicted_speedup, predicted_speedup_of_rounds, round_cost, shared_speedup, throughput_batch_size,
)
from polspec.decoding import batch_kv, measure
from polspec.decoding.batch import best_batch_size
from polspec.decoding.draft_vocab import DEFAULT_SIZE, draft_head
from polspec.decoding.measure import measure_probe
from polspec.decoding.policy import DraftLength, shared_auto_k
from polspec.decoding.probe_files import load_probe, probe_path, save_probe
from polspec.decoding.run import probe_outdated, stored_probe


def flat(c: float, tau: float = 0.0, rho: tuple[float, ...] = (1.0,) * 9) -> Probe:
    return Probe("t", "d", c=c, rho=rho, tau=tau)


def test_expected_tokens_worked_examples():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens(0.0, 4) == 1.0  # every round still commits the target's own token
    assert expected_tokens(1.0, 3) == 4.0
    with pytest.raises(ValueError):
        expected_tokens(1.5, 2)


def test_classic_speedup_when_verification_is_free():
    # rho = 1 and tau = 0 reduce S to the classic E[N] / (k c + 1).
    assert predicted_speedup(flat(0.1), 0.8, 2) == pytest.approx(((1 - 0.8**3) / 0.2) / 1.2)
    assert predicted_speedup(flat(0.1), 0.8, 0) == 1.0


def test_plain_rounds_pull_the_prediction_towards_target_only_decoding():
    # 3 rounds of k = 2 commit 3 * 2.44 tokens for 3 * 1.2 steps; 29 plain steps commit 29 for 29.
    assert predicted_speedup_of_rounds(flat(0.1), 0.8, 2, 1.0, 3, 29) == pytest.approx((29 + 7.32) / (29 + 3.6))
    assert predicted_speedup_of_rounds(flat(0.1), 0.8, 2, 1.0, 5, 0) == pytest.approx(2.44 / 1.2)


def test_bandwidth_bound_cost_and_break_even():
    measured = flat(0.1, tau=0.05, rho=(1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8))
    assert round_cost(measured, 2) == pytest.approx(0.2 + 1.2 + 0.05)
    # 1 + a + a^2 = 1.45  ->  a = (-1 + sqrt(1 + 4 * 0.45)) / 2
    assert break_even_acceptance(measured, 2) == pytest.approx((-1 + math.sqrt(2.8)) / 2, abs=1e-9)
    assert measured.rho_at(11) == pytest.approx(2.0)  # linear beyond the measured sizes
    # Two target candidates per draft token verify more positions for the same draft work.
    assert round_cost(measured, 2, ratio=2.0) == pytest.approx(0.2 + 1.4 + 0.05)
    # The draft's per-round overhead d is paid once per round, whatever k.
    with_overhead = Probe("t", "d", c=0.1, rho=measured.rho, tau=0.05, draft_overhead=0.1)
    assert round_cost(with_overhead, 1) == pytest.approx(0.1 + 0.1 + 1.1 + 0.05)
    assert round_cost(with_overhead, 0) == 1.0


def test_the_accepted_share_of_a_round_s_candidates():
    assert accepted_share(0.4, 1) == pytest.approx(0.4)
    assert accepted_share(0.4, 3) == pytest.approx((0.4 + 0.4**2 + 0.4**3) / 3)
    assert accepted_share(1.0, 3) == 1.0 and accepted_share(0.0, 3) == 0.0


def test_break_even_above_one_means_never():
    assert break_even_acceptance(flat(1.0), 6) is None  # 7 tokens at best, cost 7
    assert not can_pay(flat(2.0), 8)
    assert best_k(flat(2.0), 0.99, 8) == 0


def test_best_k_grows_with_acceptance():
    cheap = flat(0.05, rho=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35, 1.4))
    choices = [best_k(cheap, a, 8) for a in (0.1, 0.5, 0.8, 0.95)]
    assert choices == sorted(choices) and choices[0] <= 1 and choices[-1] >= 5


def test_acceptance_estimate_is_the_geometric_mle():
    estimate = AcceptanceEstimate(0, 0)
    for accepted, candidates in [(2, 2), (1, 2), (0, 2)]:
        estimate.observe(accepted, candidates)
    assert estimate.a == pytest.approx(3 / 5)  # 3 accepted, 2 rounds stopped by a rejection


def test_one_acceptance_estimate_per_pair_and_translation():
    aligned = acceptance_estimate("t", "d", DecodingParams(strategy="aligned", partial_word="verify"))
    assert acceptance_estimate("t", "d", DecodingParams(strategy="aligned", partial_word="verify")) is aligned
    assert acceptance_estimate("t", "d", DecodingParams(strategy="aligned", partial_word="hold")) is not aligned
    assert acceptance_estimate("t", "other", DecodingParams(strategy="aligned")) is not aligned


def test_throughput_batch_size_stops_where_a_larger_batch_gains_under_ten_percent():
    def table(*steps: float) -> Probe:
        costs = tuple(BatchCost(size, (step,) * len(BATCH_POSITIONS), 0.001) for size, step in zip(BATCH_SIZES, steps))
        return Probe("t", "d", c=0.1, rho=(1.0,) * 9, tau=0.0, batch=costs)

    # Sequences per second at B = 1, 2, 4, 8, 16: 100, 111, 133, 80, 320. Each step up to 4 gains
    # at least 10%; 8 loses, and the search stops there although 16 would gain again.
    assert throughput_batch_size(table(0.01, 0.018, 0.03, 0.1, 0.05)) == 4
    assert throughput_batch_size(table(0.01, 0.011, 0.012, 0.013, 0.014)) == 16  # a probe measured up to 16
    growing = table(0.01, 0.011, 0.012, 0.013, 0.014, 0.02, 0.03)
    assert BATCH_SIZES[-2:] == (32, 64) and throughput_batch_size(growing) == 64
    # A step limit (the worker's share of a job's timeout a token) stops before the first size over it.
    assert throughput_batch_size(growing, max_step_s=0.025) == 32
    assert throughput_batch_size(growing, max_step_s=0.0135) == 8
    assert throughput_batch_size(growing, max_step_s=0.001) == 1  # the smallest size, whatever it takes
    assert throughput_batch_size(None) == throughput_batch_size(table()) == UNPROBED_BATCH_SIZE == 32


def test_auto_explores_at_once_and_again_after_plain_stretches_until_the_pool_rules_it_out():
    cheap = flat(0.1, rho=(1.0, 1.1) + (1.2,) * 7)  # k = 1 pays from a = 0.2 on
    pooled = AcceptanceEstimate(1, 9)  # a = 0.1: plain decoding, but 0.2 is still plausible
    policy = DraftLength(DecodingParams(k="auto"), cheap, pooled)
    ks = []
    for _ in range(400):
        ks.append(policy.k)
        policy.observe(0, 0, 0) if policy.k == 0 else policy.observe(0, 2, 1)  # every exploration fails
    explored = [round_ for round_, k in enumerate(ks) if k > 0]
    starts = [round_ for round_ in explored if round_ == 0 or ks[round_ - 1] == 0]
    gaps = [later - earlier for earlier, later in zip(starts, starts[1:])]
    assert starts[0] == 0 and len(starts) >= 3  # at once, then again once plain rounds aged the failures
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # later each time, as the pool learns them too
    assert explored[-1] < 300 and policy.k == 0  # then never: even the pool's own bound cannot pay
    assert best_k(cheap, pooled.prior().upper_bound(), policy.k_max, policy.ratio) == 0
    assert (pooled.successes, pooled.failures) == (1, 9 + len(explored))  # the pool learns what the sequence saw


def test_auto_explores_with_the_cheapest_round_that_could_pay():
    flat_rho = flat(0.02, rho=(1.0,) + (1.1,) * 8)  # any width verifies at 1.1 steps: at 0.32 a wide k is best
    policy = DraftLength(DecodingParams(k="auto"), flat_rho, AcceptanceEstimate(1, 9))
    assert best_k(flat_rho, policy.estimate.a, 4) == 0
    assert best_k(flat_rho, policy.estimate.upper_bound(), 4) > 1 and policy.k == 1  # a rejection is one failure at any k


def test_plain_rounds_age_a_sequences_evidence_toward_the_pool():
    pooled = AcceptanceEstimate(3, 7)
    own = AcceptanceEstimate(0.6, 6.4)  # the pool's prior (0.6, 1.4) and five failures since
    own.age(pooled.prior(), PLAIN_HALF_LIFE)
    assert (own.successes, own.failures) == pytest.approx((0.6, 1.4 + 5 / 2))  # half the distance in a half-life
    own.age(pooled.prior(), 40 * PLAIN_HALF_LIFE)
    assert own.a == pytest.approx(pooled.a) and own.rounds == 0  # no round of its own was observed


def test_auto_drafts_only_where_the_round_could_pay_back_the_draft_catch_up():
    """The catch-up is weighed against the speedup the sequence's text could plausibly give
    (its estimate's upper bound), not the pool's mean: a sequence the pool says barely pays
    still pays the catch-up to find out, where a plain round would teach it nothing."""
    feed = 0.1  # target steps a token of text fed to the draft
    cheap = Probe("t", "d", c=0.1, rho=(1.0, 1.1) + (1.2,) * 7, tau=0.0, target_step_s=1.0, draft_feed_s=feed)
    policy = DraftLength(DecodingParams(k="auto"), cheap, AcceptanceEstimate(30, 70))  # a = 0.3: k = 1 barely pays
    k = policy.k
    plausible = policy.estimate.upper_bound()
    saved = 32 * (1 - 1 / predicted_speedup(cheap, plausible, k, policy.ratio))  # plain steps over 32 tokens
    saved_on_average = 32 * (1 - 1 / predicted_speedup(cheap, policy.estimate.a, k, policy.ratio))
    assert k > 0 and saved_on_average / feed < 40 < saved / feed
    assert policy.k_within(32, 40) == k  # a 40-token prompt, which the mean's speedup would not pay back
    assert policy.k_within(32, 0) == k
    assert policy.k_within(32, math.floor(saved / feed) - 1) == k
    assert policy.k_within(32, math.ceil(saved / feed) + 1) == 0  # the catch-up costs more than k saves
    # Never past what the tokens left can use: the round's last token is the target's own.
    assert (policy.k_within(2, 0), policy.k_within(1, 0)) == (1, 0)
    assert DraftLength(DecodingParams(k=3)).k_within(3, 10_000) == 2  # a fixed k drafts whatever it costs


def test_a_sequence_starts_from_the_pooled_estimate_but_its_own_rounds_soon_outweigh_it():
    cheap = flat(0.1, rho=(1.0, 1.1) + (1.2,) * 7)  # k = 1 pays from a = 0.2 on
    pooled = AcceptanceEstimate(10, 90)  # what earlier prose taught the pair: a = 0.1
    prior = pooled.prior()
    assert prior.a == pytest.approx(0.1) and prior.successes + prior.failures == pytest.approx(PRIOR_WEIGHT)
    weak = AcceptanceEstimate(0.5, 1).prior()
    assert (weak.successes, weak.failures) == (0.5, 1)  # a pool weaker than the cap is taken as it is

    table = DraftLength(DecodingParams(k="auto"), cheap, pooled)  # a text where every candidate is accepted
    ks = []
    for _ in range(6):
        ks.append(table.k)
        table.observe(table.k, table.k, table.k)
    assert all(k > 0 for k in ks) and ks[-1] > ks[0]  # it drafts from the first round, and more as it learns
    assert pooled.successes == 10 + sum(ks) and pooled.a < 0.3  # the pool hears of it, and keeps its own weight
    assert DraftLength(DecodingParams(k="auto"), cheap, pooled).estimate.a == pytest.approx(pooled.a)


def test_one_k_for_a_batch_pays_only_if_the_tokens_of_every_row_do():
    batched = flat(0.1, rho=(1.0, 1.4, 1.6) + (1.8,) * 6)  # a wide verification costs the whole batch
    assert best_shared_k(batched, [0.8], 4) == best_k(batched, 0.8, 4) > 0  # one row: the row's own best
    # Half the rows drafting nothing: the sure half's extra tokens do not pay for the batch's wider round.
    assert best_shared_k(batched, [0.8] * 4 + [0.0] * 4, 4) == 0


def test_a_batch_of_new_rows_drafts_on_the_prior_only_where_it_pays_back_the_draft_warm_up():
    batched = flat(0.1, rho=(1.0, 1.1) + (1.2,) * 7)  # k = 1 pays from a = 0.2 on
    fresh = AcceptanceEstimate()  # a = 0.5, but no round seen
    rows = [DraftLength(DecodingParams(k="auto"), batched, fresh) for _ in range(4)]
    k = shared_auto_k(rows, batched, 4, remaining=64, warm_up=2.0)
    saved = 64 * (1 - 1 / shared_speedup(batched, [0.5] * 4, k))  # plain steps the prior says k saves
    assert k > 0 and saved > 2.0
    assert shared_auto_k(rows, batched, 4, remaining=64, warm_up=saved + 0.01) == 0  # the warm-up eats the gain
    assert shared_auto_k(rows, batched, 4, remaining=4, warm_up=2.0) == 0  # too few tokens left to earn it back
    rows[0].observe(0, 2, 2)  # one row's round, rejected: the rows that saw none count at the pool's mean
    assert fresh.rounds == 1 and fresh.a == pytest.approx(1 / 3) and rows[0].estimate.a == pytest.approx(1 / 3)
    assert shared_auto_k(rows, batched, 4) > 0  # 1/3 still pays here
    for _ in range(3):
        rows[0].observe(0, 2, 2)
    assert rows[1].estimate.a == 0.5 and fresh.a < 0.2  # row 1's own prior is stale; the pool is not
    assert shared_auto_k(rows, batched, 4) == 0
    rows[0].observe(2, 2, 2)
    assert shared_auto_k(rows[:1], batched, 40) == 0  # 39 rows beside it that draft nothing


def test_the_draft_warm_up_is_costed_from_the_measured_feed_in_steps_of_the_batch():
    table = (BatchCost(1, (0.10,) * 5, 0.02), BatchCost(2, (0.12,) * 5, 0.024), BatchCost(4, (0.20,) * 5, 0.04))
    probe = Probe("t", "d", c=0.2, rho=(1.0,) * 9, tau=0.0, target_step_s=0.10, draft_step_s=0.02, batch=table,
                  draft_feed_s=0.002)
    assert probe.draft_feed_steps(50, 1) == pytest.approx(50 * 0.002 / 0.10)  # 2 ms a token, in steps of 0.1 s
    assert probe.draft_feed_steps(50, 2) == pytest.approx(50 * 0.002 / 0.12)  # priced as one text fed alone
    assert probe.draft_feed_steps(50, 4) == pytest.approx(50 * 0.002 / 0.20)
    assert Probe.from_dict(probe.as_dict()) == probe
    assert flat(0.2).draft_feed_steps(50, 4) == 0.0  # a probe made without it (tests, replays)


def test_auto_never_explores_where_no_plausible_acceptance_pays():
    costly = flat(0.8, rho=(1.0, 1.25) + (1.3,) * 7)  # the demo pair on a CPU: even k = 8 needs a > 0.9
    policy = DraftLength(DecodingParams(k="auto"), costly, AcceptanceEstimate())
    ks = []
    for _ in range(64):
        ks.append(policy.k)
        policy.observe(0, 0, 0)
    assert set(ks) == {0}


def test_the_probe_states_the_shared_vocabulary_coverage_and_warns_below_four_fifths():
    from polspec.cli.models import coverage_lines

    assert coverage_lines(0.957) == [
        "speculative sampling (tli): the draft can propose 95.7% of the target's tokens on Polish text"]
    low = coverage_lines(0.62)
    assert low[0].endswith("62.0% of the target's tokens on Polish text") and len(low) == 2
    assert low[1] == "warning: acceptance when sampling is capped by it; --verify exact may do better"


@pytest.mark.parametrize("stored", [
    f'{{"format": {PROBE_FORMAT}, "target": "t", "draft": "d", "c": 0.2, "rho": [1.0, 1.1',  # cut short mid-write
    f'{{"format": {PROBE_FORMAT}, "target": "t", "draft": "d", "c": 0.2, "tau": 0.0}}',  # no rho
    f'{{"format": {PROBE_FORMAT}, "target": "t", "draft": "d", "c": "fast", "rho": [1.0, 1, 1, 1, 1, 1, 1, 1, 1], "tau": 0.0}}',
    f'{{"format": {PROBE_FORMAT}, "target": "t", "draft": "d", "c": 0.2, "rho": [], "tau": 0.0}}',
    f'{{"format": {PROBE_FORMAT}, "target": "t", "draft": "d", "c": 0.2, "rho": [1.0, 1.2], "tau": -0.1}}',
    f'{{"format": {PROBE_FORMAT}, "target": "t", "draft": "d", "c": 0.2, "rho": [1.0, 1.2], "tau": 0.0, "draft_feed_s": -1}}',
    f'{{"format": {PROBE_FORMAT}, "target": "t", "draft": "d", "c": 0.2, "rho": [1.0, 1.2], "tau": 0.0, "draft_feed_s": 0.01}}',
    "[1, 2, 3]",
])
def test_an_unreadable_probe_counts_as_never_measured(stored, isolated_home, caplog):
    path = probe_path("t", "d")
    path.parent.mkdir(parents=True)
    path.write_text(stored)
    assert load_probe("t", "d") is None
    assert f"ignoring unreadable probe {path}" in caplog.text
    remeasured = flat(0.3)
    save_probe(remeasured)
    assert load_probe("t", "d") == remeasured


def test_a_probe_from_before_the_draft_s_feed_was_measured_is_measured_again_but_still_predicts(isolated_home):
    """A format-2 probe lacks the draft's feed: decoding measures the pair again (its ``auto``
    would price a prompt at nothing), while a report's predictions, which leave the feed out,
    still read it."""
    earlier = {key: value for key, value in flat(0.3).as_dict().items() if key != "draft_feed_s"} | {"format": 2}
    path = probe_path("t", "d")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(earlier))
    assert load_probe("t", "d") is None
    assert load_probe("t", "d", PREDICTION_FORMATS) == flat(0.3)


@pytest.mark.slow
def test_probe_measures_real_models_and_is_stored(gemma3, smollm2, home_with_models):
    # What the probe measures is timing, which a shared VM makes noisy: this checks what it
    # records and how, not how the times compare (BENCHMARKS.md has those, side by side), so
    # one repeat over a short context.
    stages: list[str] = []
    measured = measure_probe(gemma3, smollm2, repeats=1, context=8, batch_sizes=(1, 2), stage=stages.append)
    assert stages == ["target forwards over 1-9 tokens", "draft step", "both models at batch size 1",
                      "both models at batch size 2", "a draft round"]
    assert measured.rho[0] == 1.0 and len(measured.rho) == 9 and all(0 < rho < math.inf for rho in measured.rho)
    assert [cost.size for cost in measured.batch] == [1, 2]
    two = measured.batch[1]
    assert all(0 < t < math.inf for cost in measured.batch for t in (*cost.target_s, cost.draft_s))
    assert measured.at_batch(2).target_step_s == two.target_s[0]
    assert measured.largest_batch_tried == 2  # what it was asked for: stored_probe asks for BATCH_SIZES
    assert 0 < measured.c < math.inf and measured.tau >= 0 and measured.target_step_s > 0
    assert 0 <= measured.draft_overhead < math.inf and 0 < measured.draft_feed_s < math.inf
    save_probe(measured)
    assert load_probe("gemma3-270m", "smollm2-135m") == measured


@pytest.mark.slow
def test_the_probe_leaves_out_batch_sizes_whose_caches_memory_cannot_hold(gemma3, smollm2, monkeypatch):
    head = draft_head(smollm2, "auto")
    monkeypatch.setattr(batch_kv, "free_memory_bytes", lambda: 10 ** 15)
    assert measure._sizes_that_fit(gemma3, smollm2, head, BATCH_SIZES, 64) == list(BATCH_SIZES)
    # A row of a 270M target's five caches and the logits of nine positions takes some 90 MB.
    monkeypatch.setattr(batch_kv, "free_memory_bytes", lambda: 2 * 2 ** 30)
    fitting = measure._sizes_that_fit(gemma3, smollm2, head, BATCH_SIZES, 64)
    assert fitting == list(BATCH_SIZES[:len(fitting)]) and 1 < len(fitting) < len(BATCH_SIZES)
    monkeypatch.setattr(batch_kv, "free_memory_bytes", lambda: 0)
    assert measure._sizes_that_fit(gemma3, smollm2, head, BATCH_SIZES, 64) == [1]  # a table needs a row


@pytest.mark.slow
def test_a_batched_use_measures_again_a_probe_whose_table_stopped_short(smollm2):
    table = tuple(BatchCost(size, (0.01,) * len(BATCH_POSITIONS), 0.001) for size in (1, 2, 4, 8, 16))
    earlier = Probe("t", "smollm2-135m", c=0.1, rho=(1.0,) * 9, tau=0.0, batch=table,
                    draft_vocab=draft_head(smollm2, "auto").size)
    assert not probe_outdated(earlier, smollm2) and probe_outdated(earlier, smollm2, batched=True)
    # A table that memory cut short after every size was tried is read as it is.
    cut = dataclasses.replace(earlier, largest_batch_tried=BATCH_SIZES[-1])
    assert not probe_outdated(cut, smollm2, batched=True)
    # A table to 64 from before the key existed is not measured again either.
    wide = dataclasses.replace(earlier, batch=tuple(BatchCost(size, (0.01,) * len(BATCH_POSITIONS), 0.001)
                                                    for size in BATCH_SIZES))
    assert wide.largest_batch_tried == 0 and not probe_outdated(wide, smollm2, batched=True)
    # A file an earlier polspec stored has no such key: it reads back as the table that stopped at 16.
    assert Probe.from_dict({key: value for key, value in cut.as_dict().items() if key != "largest_batch_tried"}) == earlier
    with pytest.raises(ValueError, match="largest_batch_tried"):
        Probe.from_dict(cut.as_dict() | {"largest_batch_tried": "64"})


@pytest.mark.slow
def test_without_a_probe_the_bulk_batch_halves_until_its_timed_step_fits(smollm2, monkeypatch):
    assert best_batch_size(smollm2, None, None, 64) == UNPROBED_BATCH_SIZE  # no limit: nothing is timed
    assert best_batch_size(smollm2, None, None, 64, max_step_s=60.0) == UNPROBED_BATCH_SIZE
    assert best_batch_size(smollm2, None, None, 64, max_step_s=1e-9) == 1  # no step is that fast
    # A probe's table says what a step takes: read, not timed.
    monkeypatch.setattr("polspec.decoding.batch.plain_step_s", lambda *_: pytest.fail("timed a step"))
    # Steps of 10.5, 11, 12, 14, 18, 26 and 42 ms at B = 1 to 64: each size up to 64 gains over 10%.
    costs = tuple(BatchCost(size, (0.01 + 0.0005 * size,) * len(BATCH_POSITIONS), 0.001) for size in BATCH_SIZES)
    probe = Probe("smollm2-135m", "d", c=0.1, rho=(1.0,) * 9, tau=0.0, batch=costs)
    assert best_batch_size(smollm2, None, probe, 64) == 64
    assert best_batch_size(smollm2, None, probe, 64, max_step_s=1e-9) == 1
    assert best_batch_size(smollm2, None, probe, 64, max_step_s=0.02) == 16


@pytest.mark.slow
def test_stored_probe_is_measured_on_first_use_then_read_back(gemma3, smollm2, home_with_models, monkeypatch):
    # When it measures, not how precisely: one repeat over a short context keeps the test short.
    monkeypatch.setattr(run, "measure_probe", functools.partial(measure_probe, repeats=1, context=8))
    assert load_probe("gemma3-270m", "smollm2-135m") is None
    first = stored_probe(gemma3, smollm2)
    assert load_probe("gemma3-270m", "smollm2-135m") == first
    assert stored_probe(gemma3, smollm2) == first  # a second measurement would differ in its timings
    pruned = stored_probe(gemma3, smollm2, draft_vocab=2048)  # the draft's step depends on its vocabulary
    assert pruned != first and pruned.draft_vocab > 2048 and load_probe("gemma3-270m", "smollm2-135m") == pruned
    # Read back, not measured again, though the head keeps byte and special tokens beyond the 2048.
    assert stored_probe(gemma3, smollm2, draft_vocab=2048) == pruned


@pytest.mark.slow
def test_auto_falls_back_to_plain_decoding_when_no_k_can_pay(gemma3, smollm2, home_with_models, resident_models,
                                                            monkeypatch):
    save_probe(Probe("gemma3-270m", "smollm2-135m", c=2.0, rho=(1.0,) * 9, tau=0.0, draft_vocab=DEFAULT_SIZE))
    params = DecodingParams(max_tokens=4, k="auto")
    result = generate(gemma3, smollm2, "Kraków jest", params)
    baseline = generate(gemma3, None, "Kraków jest", DecodingParams(max_tokens=4))
    assert result.token_ids == baseline.token_ids
    assert result.metrics.draft_tokens == 0 and "plain decoding" in result.metrics.k_policy_note
    assert result.metrics.plain_rounds == result.metrics.rounds == 4  # a report prices its rounds as plain steps
    assert baseline.metrics.plain_rounds == 0
    # The command line says why the draft it loaded went unused.
    cli = CliRunner().invoke(main, ["generate", "Kraków jest", "--draft", "smollm2-135m", "--k", "auto",
                                    "--max-tokens", "2"])
    assert cli.exit_code == 0 and f"note: {result.metrics.k_policy_note}\n" in cli.output
    assert "measuring what a round costs" not in cli.output
    # A probe of another draft vocabulary is measured again, and the command line says so first.
    monkeypatch.setattr(run, "measure_probe", functools.partial(measure_probe, repeats=1, context=8))
    cli = CliRunner().invoke(main, ["generate", "Kraków jest", "--draft", "smollm2-135m", "--k", "auto",
                                    "--max-tokens", "2", "--draft-vocab", "full"])
    assert cli.exit_code == 0 and "k=auto: measuring what a round costs for gemma3-270m with smollm2-135m" in cli.output
    assert load_probe("gemma3-270m", "smollm2-135m").draft_vocab is None  # the full vocabulary


@pytest.mark.slow
def test_auto_speculates_losslessly_when_the_probe_says_it_pays(gemma3, smollm2, home_with_models):
    save_probe(Probe("gemma3-270m", "smollm2-135m", c=0.01, rho=(1.0,) * 9, tau=0.0, draft_vocab=DEFAULT_SIZE))
    result = generate(gemma3, smollm2, "Warszawa leży nad", DecodingParams(max_tokens=16, k="auto"))
    baseline = generate(gemma3, None, "Warszawa leży nad", DecodingParams(max_tokens=16))
    assert result.token_ids == baseline.token_ids
    assert result.metrics.draft_tokens > 0 and not result.metrics.k_policy_note
