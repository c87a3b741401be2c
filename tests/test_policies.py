"""γ policies: registered through the hook, observable in stats, exact, and the cost model's choices."""
import pytest
import torch

import specplug
from specplug.plugins import UnknownProposerError, get_policy, list_policies
from specplug.policies import (HOPE_RISE, MEASURE_K, REMEASURE_AFTER, REPRICE_EVERY, Acceptance, CostModelPolicy,
                               GammaPolicy, HeuristicPolicy, MeasuredCosts, _step_positions)
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution
from specplug.types import Proposal, Proposer


class ControlledCosts(MeasuredCosts):
    """Drafting 1 ms a token; scoring n tokens 10 ms + 0.5 ms·n, whatever is observed."""

    def observe(self, *args):
        pass

    def draft_time(self, k, rows=1):
        return 0.001 * k * rows

    def drafting_measured(self, rows):
        return True

    def verify_time(self, n, batch_size):
        return 0.010 + 0.0005 * n


def seq_state(target):
    return specplug.SequenceState(ids=[1, 2, 3], num_prompt=3, sampling=specplug.GREEDY,
                                  rng=torch.Generator(), target=target)


def test_builtin_policies_are_registered_through_the_hook():
    found = list_policies()
    assert {"fixed", "heuristic", "cost-model"} <= set(found)
    assert all(found[n].source == "specplug" for n in ("fixed", "heuristic", "cost-model"))
    with pytest.raises(UnknownProposerError, match="unknown policy 'nope'; available: cost-model"):
        get_policy("nope")


def test_cost_model_chooses_no_speculation_when_drafts_are_never_accepted(tiny_target):
    policy = CostModelPolicy(max_gamma=8, costs=ControlledCosts(), probe_every=1000)
    seq = seq_state(tiny_target)
    policy.begin(seq)
    for _ in range(20):
        policy.update(seq, 4, 0, 0.004, 0.013)
    assert policy.choose(seq, 8) == 0


def test_cost_model_drafts_the_best_predicted_length_not_the_shortest_near_it(tiny_target):
    """Where several lengths predict nearly the same rate, the best one: a tie margin among them drafted
    shorter than the best static γ in every load run."""
    policy = CostModelPolicy(max_gamma=8, costs=ControlledCosts(), probe_every=1000)
    seq = seq_state(tiny_target)
    policy.begin(seq)
    for _ in range(30):  # 6 of 7 drafts accepted: k = 5 within 1% of k = 6, the best
        policy.update(seq, 7, 6, 0.007, 0.013)
    acceptance = policy._acceptance(seq)
    rates = [acceptance.expected(k) / (0.001 * k + 0.010 + 0.0005 * (k + 1)) for k in range(9)]
    best = max(range(9), key=lambda k: rates[k])
    assert min(k for k in range(1, 9) if rates[k] >= 0.99 * rates[best]) < best  # a near-tie exists
    assert policy.choose(seq, 8) == best


def test_cost_model_chooses_a_large_k_when_drafts_are_always_accepted(tiny_target):
    policy = CostModelPolicy(max_gamma=8, costs=ControlledCosts())
    seq = seq_state(tiny_target)
    policy.begin(seq)
    for _ in range(20):
        policy.update(seq, 4, 4, 0.004, 0.013)
    assert policy.choose(seq, 8) == 8
    assert policy.choose(seq, 3) == 3  # never beyond what the loop allows


def probing_policy(target):
    """A policy that switched speculation off (drafts never accepted) and has just chosen its first probe."""
    policy = CostModelPolicy(costs=ControlledCosts(), probe_every=5)
    seq = seq_state(target)
    policy.begin(seq)
    for _ in range(20):
        policy.update(seq, 4, 0, 0.004, 0.013)
    assert [policy.choose(seq, 8) for _ in range(5)] == [0, 0, 0, 0, 1]
    return policy, seq


def test_cost_model_probes_again_after_a_run_of_zeros(tiny_target):
    policy, seq = probing_policy(tiny_target)
    policy.update(seq, 1, 0, 0.001, 0.011)  # the probe failed: the next one waits twice as long
    assert [policy.choose(seq, 8) for _ in range(10)] == [0] * 9 + [1]


def test_a_probe_that_drafted_nothing_is_tried_again_next_step(tiny_target):
    """A proposer with nothing to propose (ngram without a match) turns a probe into a plain step that tested
    nothing: waiting twice as long for the next one would leave speculation off on no evidence."""
    policy, seq = probing_policy(tiny_target)
    policy.update(seq, 0, 0, 0.0, 0.010)  # nothing drafted
    assert policy.choose(seq, 8) == 1
    policy.update(seq, 1, 0, 0.001, 0.011)  # drafted and rejected: now the wait doubles
    assert [policy.choose(seq, 8) for _ in range(10)] == [0] * 9 + [1]


def test_a_batch_probe_that_drafted_nothing_moves_to_another_row(tiny_target):
    policy, seqs = rows_accepting_0_to_3(tiny_target)
    assert [policy.choose_batch(seqs, [4] * 4) for _ in range(3)][-1] == [0, 0, 0, 1]
    step = {"drafted": 0, "draft_time": 0.0, "verify_time": 0.05, "batch_size": 4, "scored": 1, "draft_rows": 0,
            "backlog_rows": 0}
    for seq in seqs:
        seq.scratch["batch_step"] = step
        policy.update(seq, 0, 0, 0.0, 0.05, 4)
    assert policy.choose_batch(seqs, [4] * 4) == [0, 0, 1, 0]  # the next likeliest row, at once


class WrongGuess(Proposer):
    """Greedy drafts that are never right: the token the target ranks last."""

    def propose(self, seq, k):
        return Proposal.point_mass([0] * k)


def test_cost_model_switches_speculation_off_in_a_real_run_and_stays_exact(tiny_target):
    base = specplug.generate(tiny_target, None, "def add(a, b):", max_new_tokens=80, sampling=specplug.GREEDY)
    assert 0 not in base.tokens  # so WrongGuess is always rejected
    policy = CostModelPolicy(costs=ControlledCosts())  # a tiny model's costs are flat noise; control them
    result = specplug.generate(tiny_target, WrongGuess(), "def add(a, b):", max_new_tokens=80,
                               sampling=specplug.GREEDY, num_speculative_tokens=policy)
    assert result.tokens == base.tokens
    gammas = result.stats.step_gammas
    assert gammas[0] > 0 and gammas[-20:].count(0) >= 15


def test_heuristic_policy_grows_by_two_on_full_acceptance_and_shrinks_by_one_otherwise(tiny_target):
    policy = HeuristicPolicy(gamma=4)
    seq = seq_state(tiny_target)
    policy.begin(seq)
    seen = []
    for accepted_all in (True, True, False, False, False, False, False):
        k = policy.choose(seq, 100)
        seen.append(k)
        policy.update(seq, k, k if accepted_all else 0, 0.0, 0.0)
    assert seen == [4, 6, 8, 7, 6, 5, 4]


def test_sampling_with_an_adaptive_policy_stays_exact(small_vocab_dirs, small_target):
    proposer = specplug.get_proposer("draft-model", target=small_target, model=small_vocab_dirs["draft"])
    prompt, sampling = [1, 2, 3, 4, 5, 0, 1, 2], specplug.SamplingParams(temperature=1.0)
    counts = sampled_distribution(small_target, proposer, prompt, 3, sampling, 2000,
                                  num_speculative_tokens=HeuristicPolicy(gamma=1))
    assert chi_square_pvalue(counts, exact_distribution(small_target, prompt, 3, sampling)) > EXACTNESS_ALPHA


class Crashing(GammaPolicy):
    name = "crashy"

    def choose(self, seq, max_k):
        if len(seq.output_ids) >= 3:
            raise RuntimeError("no idea")
        return 2


def test_a_policy_crash_is_a_clear_error_naming_it(tiny_dirs, tiny_target):
    proposer = specplug.get_proposer("ngram", target=tiny_target)
    with pytest.raises(specplug.SpeculationError, match="policy 'crashy': choose\\(\\) raised") as info:
        # seeded: an unseeded run of the random tiny model may sample EOS before the policy's third call
        specplug.generate(tiny_target, proposer, "def add(a, b):", max_new_tokens=20, num_speculative_tokens=Crashing(),
                          sampling=specplug.SamplingParams(temperature=1.0, seed=0))
    assert info.value.culprit == "crashy" and len(info.value.partial.tokens) >= 3


def test_cost_model_measures_a_plain_step_and_a_short_draft_then_revisits_an_extrapolated_choice(tiny_target):
    policy = CostModelPolicy(max_gamma=6)
    seq = seq_state(tiny_target)
    policy.begin(seq)
    assert policy.choose(seq, 8) == 0  # nothing measured at batch size 1: a plain step first
    policy.update(seq, 0, 0, 0.0, 0.010)
    assert policy.choose(seq, 8) == MEASURE_K  # then a short draft, measuring a longer scoring pass
    policy.update(seq, 2, 2, 0.050, 0.011)  # its drafting also prefilled the prompt: 50 ms
    assert policy.choose(seq, 8) == MEASURE_K  # so once more, to measure drafting without the backlog
    policy.update(seq, 2, 2, 0.001, 0.011)
    # scoring looks nearly free (0.5 ms a token, extrapolated) and drafts are accepted: the longest draft wins
    assert policy.choose(seq, 8) == 6
    policy.update(seq, 6, 6, 0.003, 0.060)  # measured: scoring 7 tokens costs 6 plain steps, not 1.3
    assert policy.costs.draft_time(1) <= 2 * 0.0005  # the prefill does not poison the drafting estimate
    assert 0 < policy.choose(seq, 8) < 6  # decided again on the measured far end of the line


def test_a_policy_kept_across_proposers_keeps_each_ones_costs_and_off_state_apart(tiny_target):
    """One policy serving two proposers (the load bench's warm cells): a drafter measured dear switches
    speculation off for itself only; the next proposer is measured from scratch, and the first one's
    measurements are still there when it comes back."""
    policy = CostModelPolicy(max_gamma=6, probe_every=1000)

    def request(proposer):
        seq = seq_state(tiny_target)
        seq.scratch["proposer"] = proposer
        policy.begin(seq)
        return seq

    dear = request("dear")
    for _ in range(8):  # drafting a token costs five plain steps
        k = policy.choose(dear, 8)
        policy.update(dear, k, k, 0.050 * k, 0.010 + 0.001 * k)
    assert policy.choose(dear, 8) == 0
    cheap = request("cheap")
    assert policy.choose(cheap, 8) == 0  # nothing measured for it: a plain step first, as a fresh policy
    policy.update(cheap, 0, 0, 0.0, 0.010)
    assert policy.choose(cheap, 8) == MEASURE_K  # then a short draft: not priced at the other's drafting cost
    policy.update(cheap, 2, 2, 0.0002, 0.011)
    assert policy.choose(request("dear"), 8) == 0  # what was measured of the first is kept


def test_cost_model_never_drafts_long_where_a_short_draft_already_shows_scoring_is_dear(tiny_target):
    policy = CostModelPolicy(max_gamma=8, probe_every=1000)
    seqs = [seq_state(tiny_target) for _ in range(8)]
    for seq in seqs:
        policy.begin(seq)
    choices = []
    for _ in range(10):
        ks = policy.choose_batch(seqs, [8] * 8)
        choices.append(max(ks))
        k = max(ks)
        # at batch 8 scoring costs 20 ms a token per row: each drafted token adds a plain step
        policy.costs.observe(k, 0.001 * k, 0.020 * (k + 1), 8, scored=k + 1, draft_rows=8)
    # measured, at most one exploratory token (scoring 2 tokens was not measured), then off: no full draft
    assert choices[:2] == [0, MEASURE_K] and max(choices[2:]) <= 1 and choices[-5:] == [0] * 5


def rows_accepting_0_to_3(target):
    """A batch policy (probing every 3 idle steps) over 4 rows; row j accepted j of 4 drafts: row 3 the most."""
    policy = CostModelPolicy(max_gamma=4, costs=BatchCosts(0.004), probe_every=3)
    seqs = [seq_state(target) for _ in range(4)]
    for j, seq in enumerate(seqs):
        policy.begin(seq)
        policy.update(seq, 4, j, 0.004, 0.013)
    return policy, seqs


def test_cost_model_probes_a_batch_with_one_row_only(tiny_target):
    policy, seqs = rows_accepting_0_to_3(tiny_target)
    chosen = [policy.choose_batch(seqs, [4, 4, 4, 4]) for _ in range(3)]
    assert chosen == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1]]


class BatchCosts(MeasuredCosts):
    """Scoring cost grows with every token in the batch (compute-bound): 10 ms + slope·n·B; drafting 0.1 ms
    a token per row."""

    def __init__(self, slope):
        super().__init__()
        self.slope = slope

    def observe(self, *args):
        pass

    def draft_time(self, k, rows=1):
        return 0.0001 * k * rows

    def drafting_measured(self, rows):
        return True

    def verify_time(self, n, batch_size):
        return 0.010 + self.slope * n * batch_size


def test_cost_model_does_not_probe_where_even_full_acceptance_could_not_pay(tiny_target):
    # batch 16: scoring 2 tokens a row costs 0.138 s against 0.074 s for one, so even if every draft were
    # accepted one drafted token would gain 6%, below the 10% switch-on margin: probing could change nothing
    policy = CostModelPolicy(max_gamma=4, costs=BatchCosts(0.004), probe_every=3)
    seqs = [seq_state(tiny_target) for _ in range(16)]
    for seq in seqs:
        policy.begin(seq)
    assert all(policy.choose_batch(seqs, [4] * 16) == [0] * 16 for _ in range(20))
    # at batch 4 the same costs leave room (23% at full acceptance): it probes, one row
    assert any(sum(policy.choose_batch(seqs[:4], [4] * 4)) == 1 for _ in range(6))


class RaggedCosts(BatchCosts):
    """:class:`BatchCosts` whose every pass was measured lately (none needs exploring)."""

    def is_fresh(self, n, batch_size, stale_after=REMEASURE_AFTER):
        return True


def rows_one_accepting_all_three_rejecting(target, padded=False, slope=0.0005):
    """A batch policy over 4 rows: row 0's drafts all accepted, the other rows' first draft nearly always
    rejected; scoring 10 ms + ``slope`` a position over all rows (ragged) or over the longest draft (padded)."""
    policy = CostModelPolicy(max_gamma=8, costs=RaggedCosts(slope), probe_every=1000)
    policy._padded = padded
    seqs = [seq_state(target) for _ in range(4)]
    for j, seq in enumerate(seqs):
        policy.begin(seq)
        for step in range(20):
            policy.update(seq, 4, 4 if j == 0 else int(step % 10 == 0), 0.0004, 0.012)
    return policy, seqs


def test_in_a_batch_a_row_whose_deeper_drafts_would_not_repay_their_positions_drafts_one_token(tiny_target):
    # the step's k is set by row 0; over ragged rows each drafted token costs a position in its own row only,
    # so the rows whose first draft is rarely accepted draft one token (still measured) and not the step's k
    policy, seqs = rows_one_accepting_all_three_rejecting(tiny_target)
    ks = policy.choose_batch(seqs, [8] * 4)
    assert ks[0] >= 4 and ks[1:] == [1, 1, 1]


def test_a_batch_step_is_priced_as_its_rows_will_draft_it_so_one_row_that_repays_drafting_switches_it_on(
        tiny_target):
    # 1 ms a position: with every row drafting the step's k, the three rejecting rows' positions cost more
    # than row 0's accepted drafts bring (it chose no drafting); trimmed to one token each, as they will be
    # drafted, they cost little and row 0's drafts pay: priced that way, the step drafts
    policy, seqs = rows_one_accepting_all_three_rejecting(tiny_target, slope=0.001)
    assert policy.choose_batch(seqs, [8] * 4) == [8, 1, 1, 1]


def test_padded_rows_all_draft_the_steps_k_since_every_row_is_scored_over_the_longest_draft(tiny_target):
    policy, seqs = rows_one_accepting_all_three_rejecting(tiny_target, padded=True)
    ks = policy.choose_batch(seqs, [8] * 4)
    assert ks[0] >= 4 and ks[1:] == [ks[0]] * 3


@pytest.mark.parametrize("slope, expect_speculation", [(0.0001, True), (0.004, False)])
def test_cost_model_batch_choice_follows_the_scoring_cost_of_the_batch(tiny_target, slope, expect_speculation):
    policy = CostModelPolicy(max_gamma=8, costs=BatchCosts(slope), probe_every=1000)
    seqs = [seq_state(tiny_target) for _ in range(8)]
    for seq in seqs:
        policy.begin(seq)
        for _ in range(5):  # in every row half the steps reject the first draft, half accept all four
            policy.update(seq, 4, 0, 0.004, 0.013)
            policy.update(seq, 4, 4, 0.004, 0.013)
    ks = policy.choose_batch(seqs, [8, 8, 8, 8, 8, 8, 8, 2])
    assert len(set(ks[:7])) == 1 and ks[7] == min(ks[0], 2)  # one k for the step, capped per row
    assert (ks[0] > 0) == expect_speculation


def test_measured_costs_estimate_unseen_batch_sizes_from_a_bilinear_fit():
    costs = MeasuredCosts()
    truth = lambda n, b: 0.008 + 0.0003 * n + 0.001 * b + 0.0002 * n * b
    for n, b in [(1, 1), (5, 1), (1, 4), (5, 4), (3, 8)]:
        costs.observe(n - 1, 0.0, truth(n, b), b)
    assert costs.verify_time(3, 2) == pytest.approx(truth(3, 2), rel=1e-6)
    assert costs.verify_time(2, 4) == pytest.approx(truth(2, 4), rel=1e-6)  # a line in n at a measured B
    assert MeasuredCosts().verify_time(1, 1) is None  # nothing measured: no guess


def test_estimates_memoised_for_one_choice_never_outlive_it(tiny_target):
    costs = MeasuredCosts()
    for n in (1, 3, 5):
        costs.observe(n - 1, 0.001 * n, 0.010 + 0.001 * n, 1)
    plain = [costs.verify_time(n, 1) for n in range(1, 9)], [costs.draft_time(k) for k in range(9)]
    with costs.frozen():
        assert ([costs.verify_time(n, 1) for n in range(1, 9)], [costs.draft_time(k) for k in range(9)]) == plain
    costs.observe(2, 0.002, 0.050, 1)  # a new measurement after the choice: the next estimate sees it
    assert costs.verify_time(3, 1) != plain[0][2]
    policy = CostModelPolicy(max_gamma=8, costs=costs)
    policy.choose_batch([seq_state(tiny_target)], [8])
    assert costs._memo is None


def test_measured_costs_learn_how_drafting_scales_with_the_rows_drafting():
    costs = MeasuredCosts()
    assert costs.draft_time(1, 4) is None
    costs.observe(3, 0.003, 0.010, 1)  # one row, three passes of 1 ms
    costs.observe(16, 0.003, 0.020, 8, scored=3, draft_rows=8)  # a batched drafter: two passes of 1.5 ms
    assert costs.draft_time(2, 1) == pytest.approx(0.002)
    assert costs.draft_time(2, 4) == pytest.approx(2 * (0.001 + 0.0005 * 3 / 7))
    costs.observe(16, 0.100, 0.020, 8, scored=3, draft_clean=False, draft_rows=8)  # paid a backlog: ignored
    assert costs.draft_time(1, 8) == pytest.approx(0.0015)


def test_drafting_cost_separates_a_fixed_part_per_step_from_the_cost_per_token():
    """A step's first drafting pass also feeds the accepted tokens and finds the draft's weights evicted, so
    drafting costs fixed + per_token × k; an average per token taken at one k would misprice other k."""
    costs = MeasuredCosts()
    truth = lambda k: 0.0006 + 0.0002 * k
    costs.observe(4, truth(4), 0.004, 1)
    assert costs.draft_time(8) == pytest.approx(2 * truth(4))  # one k seen: proportional, nothing better known
    for k in (2, 6, 4, 8, 3, 5):
        costs.observe(k, truth(k), 0.004, 1)
    assert costs.draft_time(8) == pytest.approx(truth(8), rel=0.01)
    assert costs.draft_time(1) == pytest.approx(truth(1), rel=0.01)


def test_a_drafting_cost_that_does_not_grow_with_k_is_priced_flat_not_per_token():
    # ngram drafts by a lookup per row: ~1 ms a step whatever k, so noise fits a slope at or below 0; priced
    # proportionally from its mean instead, 8 tokens cost ~2.7 times what they do and long drafts lost
    noisy = MeasuredCosts()
    for k, seconds in [(2, 0.0010), (4, 0.0009), (3, 0.0011)]:
        noisy.observe(k, seconds, 0.004, 1)
    assert noisy.draft_pass[1] == 0 and noisy.draft_time(8) == pytest.approx(0.001, rel=0.01)


def test_a_scoring_pass_that_caught_a_pause_moves_the_estimate_by_at_most_twice_the_expected_cost():
    costs = MeasuredCosts()
    for n in (1, 3, 5):
        costs.observe(n - 1, 0.0, 0.010 + 0.001 * n, 1)
    costs.observe(4, 0.0, 0.100, 1)  # the 5-token pass caught a 85 ms pause
    assert costs.verify_time(5, 1) == pytest.approx(0.8 * 0.015 + 0.2 * 0.030)
    first = MeasuredCosts()
    first.observe(0, 0.0, 0.010, 1)
    first.observe(1, 0.0, 0.100, 1)  # nothing to expect a 2-token pass's cost from: taken as measured
    assert first.verify_time(2, 1) == pytest.approx(0.100)


def test_what_was_measured_ages_while_off_so_one_accepted_probe_switches_speculation_back_on(tiny_target):
    # 80 steps of rejected drafts switch speculation off; then the proposer starts matching the text (suffix
    # reaching a repeat). A probe accepted after a long pause outweighs the old rejections it followed: it
    # switches speculation on, where counted like a step drafted just before it, it took a second probe
    # after a doubled wait (163 steps instead of 35)
    policy = CostModelPolicy(max_gamma=8, costs=ControlledCosts())
    chosen = drive_one_request(policy, tiny_target, 400, accepted=lambda step, d: 0 if step < 80 else d)
    assert chosen[70:80] == [0] * 10
    switched_on = next(i for i in range(80, 400) if chosen[i] > 1)
    assert chosen[80:switched_on].count(1) == 1  # the one probe


def test_both_acceptance_rates_age_over_the_steps_that_did_not_ask(tiny_target):
    policy = CostModelPolicy(max_gamma=8, costs=ControlledCosts())
    seq = seq_state(tiny_target)
    policy.begin(seq)
    for _ in range(60):
        policy.update(seq, 4, 4, 0.004, 0.0125)
    state = policy._state(seq)
    weights = state["first"][1], state["then"][1]
    for _ in range(30):  # off: nothing asked, nothing measured
        policy.update(seq, 0, 0, 0.0, 0.0105)
    policy.update(seq, 4, 4, 0.004, 0.0125)
    assert state["first"][1] == pytest.approx(0.95 * 0.95 ** 30 * weights[0] + 1)
    assert state["then"][1] == pytest.approx(0.95 * 0.95 ** 30 * weights[1] + 3)


def off_on_a_bad_stretch(target):
    """A row whose first drafts were rejected (first-token rate 0.05: speculation off) of a proposer that usually
    does well (running rates 0.8 / 0.9); no probe is due."""
    seq = seq_state(target)
    seq.scratch["policy:cost-model"] = {"successes": 0.05, "trials": 1.0, "first": [0.05, 1.0], "then": [0.9, 1.0],
                                        "idle": 0, "wait": 1000, "k": 0}
    return seq


@pytest.mark.parametrize("batched", [False, True])
def test_a_row_switched_off_on_a_bad_stretch_drafts_again_once_its_proposers_usual_rate_would_pay(tiny_target,
                                                                                                  batched):
    policy = CostModelPolicy(max_gamma=4, costs=ControlledCosts(), probe_every=1000)
    policy.acceptance_by_proposer[""] = Acceptance(0.8, 0.9)
    policy._catch_up = 0.0001  # a drafter that catches up cheaply (ngram): switching on repays nothing
    if batched:
        rows = [off_on_a_bad_stretch(tiny_target) for _ in range(2)]
        chosen = [max(policy.choose_batch(rows, [4, 4])) for _ in range(40)]
    else:
        row = off_on_a_bad_stretch(tiny_target)
        chosen = [policy.choose(row, 4) for _ in range(40)]
    assert chosen[0] == 0
    assert any(chosen), "off for good: nothing measured the row again"
    assert policy._acceptance((rows if batched else [row])[0]).first < 0.8  # moved towards it, not set to it


def test_cost_model_switches_back_on_only_for_a_clear_gain(tiny_target):
    # α = 0.2 with ControlledCosts: drafting one token is predicted 5% faster than not drafting
    policy = CostModelPolicy(max_gamma=4, costs=ControlledCosts(), probe_every=1000)
    rates = {"successes": 0.2, "trials": 1.0, "first": [0.2, 1.0], "then": [0.2, 1.0], "wait": 1000}
    on, off = seq_state(tiny_target), seq_state(tiny_target)
    on.scratch["policy:cost-model"] = {**rates, "idle": 0}
    assert policy.choose(on, 4) == 1  # speculating already: keep the better k
    off.scratch["policy:cost-model"] = {**rates, "idle": 3, "k": 0}
    assert policy.choose(off, 4) == 0  # off: 5% does not repay every drafter's catching up
    assert CostModelPolicy(max_gamma=4, costs=ControlledCosts(), switch_on_margin=0.0).best_k(0.2, 4, off=True) == 1


def test_a_probe_leaves_speculation_off_so_switching_on_still_needs_a_clear_gain(tiny_target):
    # α = 0.2 with ControlledCosts (drafting one token predicted 5% faster): a probe drafts a token, but
    # speculation stays off after it; only a predicted gain above the margin would switch it on
    policy = CostModelPolicy(max_gamma=4, costs=ControlledCosts(), probe_every=2)
    seq = seq_state(tiny_target)
    alpha = lambda: {"successes": 0.2, "trials": 1.0, "first": [0.2, 1.0], "then": [0.2, 1.0]}  # noqa: E731
    seq.scratch["policy:cost-model"] = {**alpha(), "idle": 1, "wait": 2, "k": 0}
    assert policy.choose(seq, 4) == 1  # the probe
    policy.update(seq, 1, 1, 0.001, 0.011)
    seq.scratch["policy:cost-model"].update(alpha())  # as before the probe: still a 5% gain
    assert policy.choose(seq, 4) == 0


def run_with_true_costs(policy, seq, truth, accepted_share, steps):
    """Drive a policy for one sequence: every choice is "run" with scoring cost truth(n), 0.1 ms of drafting a
    token, and the given share of drafts accepted; the chosen ks are returned."""
    chosen = []
    for _ in range(steps):
        k = policy.choose(seq, 4)
        chosen.append(k)
        policy.update(seq, k, round(k * accepted_share), 0.0001 * k, truth(k + 1))
    return chosen


def test_cost_model_measures_a_long_draft_when_a_short_pass_only_looks_dear(tiny_target):
    # scoring 2-3 tokens hits a slow kernel (25 ms, 2.5 plain steps) while 4-5 tokens cost 13 ms: the line
    # through 1 and 3 tokens (what the measuring steps score) would rule drafting out; exploring tries the long
    # pass (at most twice a measured length, hoped to rise at HOPE_RISE of the measured rate), finds it cheap,
    # and keeps it
    truth = {1: 0.010, 2: 0.025, 3: 0.025, 4: 0.0125, 5: 0.013}.get
    policy = CostModelPolicy(max_gamma=4, probe_every=1000)
    seq = seq_state(tiny_target)
    policy.begin(seq)
    assert run_with_true_costs(policy, seq, truth, 1.0, 8) == [0, MEASURE_K, MEASURE_K, 4, 4, 4, 4, 4]


def test_cost_model_explores_a_dear_long_pass_once_and_then_stays_off(tiny_target):
    truth = lambda n: 0.020 * n  # compute-bound: every token scored costs a plain step
    policy = CostModelPolicy(max_gamma=4, probe_every=1000)
    seq = seq_state(tiny_target)
    policy.begin(seq)
    assert run_with_true_costs(policy, seq, truth, 1.0, 2) == [0, MEASURE_K]  # a plain step, then a short draft
    seq.scratch["policy:cost-model"].update(successes=0.9, trials=1.0, first=[0.9, 1.0], then=[0.9, 1.0])  # α = 0.9
    chosen = run_with_true_costs(policy, seq, truth, 0.75, 2 * REMEASURE_AFTER)
    # it measures drafting once more, tries 4 tokens (which could have paid had its pass cost no more than
    # the 3 measured; every first draft is accepted), finds it dear and stays off: a bounded price for not
    # trusting the line
    assert chosen[:2] == [MEASURE_K, 4] and set(chosen[2:]) == {0}


def test_a_stale_pass_measured_again_as_dear_waits_twice_as_long_before_it_is_explored_again():
    """Re-measuring a stale estimate guards against one unlucky measurement; a kept policy re-explored a dear
    pass every REMEASURE_AFTER steps of every wave. Each confirmation doubles the wait; a cheaper pass resets it."""
    costs = MeasuredCosts()

    def short_passes(steps):
        for _ in range(steps):
            costs.observe(2, 0.0, 0.015, 16)

    for n, seconds in [(1, 0.010), (3, 0.015), (9, 0.030)]:
        costs.observe(n - 1, 0.0, seconds, 16)
    short_passes(REMEASURE_AFTER)
    assert not costs.is_fresh(9, 16)
    costs.observe(8, 0.0, 0.029, 16)  # as dear as it was
    short_passes(REMEASURE_AFTER)
    assert costs.is_fresh(9, 16)
    short_passes(REMEASURE_AFTER)
    assert not costs.is_fresh(9, 16)
    costs.observe(8, 0.0, 0.018, 16)  # much cheaper than estimated: the estimate was unlucky, the wait starts over
    short_passes(REMEASURE_AFTER)
    assert not costs.is_fresh(9, 16)


def test_a_pass_between_two_measured_lately_is_interpolated_not_explored():
    # at 16 rows, passes of 1, 2, 4 and 8 tokens a row measured lately, steeply dearer with each token (a
    # compute-bound step): a 6-token pass lies between two of them, so it is no candidate for exploring at
    # the 4-token pass's cost (that once had a policy switched on under load try every length in turn, each
    # step drafting in all 16 rows)
    costs = MeasuredCosts()
    for n in (1, 2, 4, 8):
        costs.observe(n - 1, 0.0, 0.016 + 0.010 * (n - 1), 16)
    assert costs.hopeful_verify_time(6, 16) == pytest.approx(0.016 + 0.010 * 5)
    assert costs.hopeful_verify_time(9, 16) == pytest.approx(costs.verify_time(8, 16) + HOPE_RISE * 0.010)  # beyond


def test_a_pass_beyond_those_measured_lately_is_hoped_to_rise_with_their_flattest_rate_not_to_cost_nothing_more():
    # at 16 rows on a CPU every scored token costs arithmetic: a plain pass 10 ms, 3 tokens a row 16 ms, 5 tokens
    # 21 ms. Hoping a 6- to 10-token pass costs the 5-token pass's 21 ms made every unmeasured length look like
    # a clear win, so a fresh policy spent its first steps drafting deep to measure passes that lost. The hope
    # now rises at HOPE_RISE of the flattest rise measured lately (2.5 ms a token), where it once rose not at all.
    costs = MeasuredCosts()
    for n, seconds in [(1, 0.010), (3, 0.016), (5, 0.021)]:
        costs.observe(n - 1, 0.0, seconds, 16)
    hope = costs.hopeful_verify_time(8, 16)
    assert 0.021 < hope <= 0.021 + 3 * 0.0025 and hope == pytest.approx(0.021 + HOPE_RISE * 3 * 0.0025)
    assert costs.hopeful_verify_time(11, 16) == pytest.approx(costs.verify_time(11, 16))  # beyond twice: no hope
    flat = MeasuredCosts()
    for n, seconds in [(1, 0.010), (2, 0.010), (5, 0.013)]:  # a flat first step: longer passes may be as cheap
        flat.observe(n - 1, 0.0, seconds, 1)
    assert flat.hopeful_verify_time(8, 1) == pytest.approx(0.013)


def test_drafting_more_rows_is_never_estimated_cheaper_nor_fewer_rows_dearer():
    costs = MeasuredCosts()
    costs.draft_pass.update({15: 0.0063, 16: 0.0026})  # a noisy 15-row pass beside a clean 16-row one
    assert costs.draft_time(1, 13) <= 0.0026 and costs.draft_time(1, 15) <= 0.0026
    assert costs.draft_time(2, 32) == pytest.approx(2 * 0.0026 * 2)  # beyond the measured: proportional
    costs.verify.update({(1, 8): 0.010, (2, 8): 0.017, (3, 8): 0.012})  # a slow kernel for 2 tokens a row
    assert costs.verify_time(2, 8) == pytest.approx(0.012)  # no dearer than scoring 3


def test_a_proposers_running_alpha_is_accepted_over_tried_not_a_mean_of_step_ratios(tiny_target):
    policy = CostModelPolicy(max_gamma=4)
    seq = seq_state(tiny_target)
    seq.scratch["proposer"] = "p"
    policy.begin(seq)
    for _ in range(100):  # steps alternately reject the first draft and accept all four
        policy.update(seq, 4, 0, 0.001, 0.010)
        policy.update(seq, 4, 4, 0.001, 0.010)
    # 4 accepted of 5 tried positions per pair of steps: α = 0.8 (the mean of the ratios 0/1 and 4/4 is 0.5)
    assert policy.alpha_by_proposer["p"] == pytest.approx(0.8, abs=0.02)
    fresh = seq_state(tiny_target)
    fresh.scratch["proposer"] = "p"
    assert policy._alpha(fresh) == pytest.approx(0.8, abs=0.02)  # and a new request starts from it


def test_cost_model_prices_drafts_accepted_in_streaks_by_their_first_and_later_acceptance(tiny_target):
    """Half the steps reject the first draft, half accept all eight: a step drafting k emits 1 + k/2 tokens on
    average. One i.i.d. α (8 accepted of 9 tried) would predict 5.9 for k = 8; the two rates predict 5."""
    policy = CostModelPolicy(max_gamma=8)
    seq = seq_state(tiny_target)
    seq.scratch["proposer"] = "p"
    policy.begin(seq)
    for _ in range(100):
        policy.update(seq, 8, 0, 0.001, 0.010)
        policy.update(seq, 8, 8, 0.001, 0.010)
    acceptance = policy._acceptance(seq)
    assert acceptance.first == pytest.approx(0.5, abs=0.03) and acceptance.then == pytest.approx(1.0, abs=0.01)
    for k in (1, 4, 8):
        assert acceptance.expected(k) == pytest.approx(1 + k / 2, rel=0.03)
    assert policy.acceptance_by_proposer["p"].expected(8) == pytest.approx(5.0, rel=0.03)  # what new requests start from


def test_cost_model_prices_only_the_drafts_a_proposer_makes_when_asked(tiny_target):
    """A proposer that drafts nothing on half the steps it is asked (ngram without a match) and otherwise has
    every draft accepted: a step asking for k emits 1 + k/2 tokens on average, not k + 1."""
    policy = CostModelPolicy(max_gamma=8, costs=ControlledCosts(), probe_every=1000)
    seq = seq_state(tiny_target)
    seq.scratch["proposer"] = "p"
    policy.begin(seq)
    for step in range(100):
        k = policy.choose(seq, 8)
        drafted = 0 if step % 2 else k
        policy.update(seq, drafted, drafted, 0.001 * drafted, 0.010)
    assert k == 8
    assert policy._acceptance(seq).expected(8) == pytest.approx(5.0, rel=0.05)


class SteepScoringCosts(ControlledCosts):
    """Scoring n tokens 10 ms + 2 ms·n: a long pass is dear (a compute-bound target)."""

    def verify_time(self, n, batch_size):
        return 0.010 + 0.002 * n


def drive_one_request(policy, target, steps, drafted=lambda step, k: k, accepted=lambda step, d: d):
    """Run one request ``steps`` steps: of the k chosen the proposer drafts drafted(step, k), of which
    accepted(step, d) are accepted; drafting 1 ms a token, scoring 10 ms + 0.5 ms a position (as reported:
    a replaced ``costs`` prices them its own way). Each step's k."""
    seq = seq_state(target)
    seq.scratch["proposer"] = "p"
    policy.begin(seq)
    chosen = []
    for step in range(steps):
        chosen.append(policy.choose(seq, 8))
        d = drafted(step, chosen[-1])
        policy.update(seq, d, accepted(step, d), 0.001 * d, 0.010 + 0.0005 * (d + 1))
    return chosen


def test_cost_model_prices_a_draft_at_the_pass_it_scores_not_at_the_k_asked(tiny_target):
    """A proposer that drafts at most 3 tokens on half the steps (a short match) and whatever it is asked on
    the others, every draft accepted: asking for 8 scores 6.5 positions on average, not 9. Priced at 9,
    asking for 3 looks best (4 tokens in 21 ms against 6.5 in 36 ms); priced at 6.5, asking for 8 is
    (6.5 tokens in 31 ms)."""
    policy = CostModelPolicy(max_gamma=8, costs=SteepScoringCosts(), probe_every=1000)
    chosen = drive_one_request(policy, tiny_target, 200, lambda step, k: min(k, 3) if step % 2 else k)
    assert chosen[-50:] == [8] * 50


def test_a_padded_pass_is_priced_at_the_longest_draft_and_a_ragged_one_at_the_rows_mean():
    # 8 rows asked for 8 drafts, each drafting 3 and, one time in 8, all 8: ragged rows score 1 + 3 + 5/8
    # positions a row on average; padded rows score every row over the longest draft, and some row drafts
    # each depth beyond 3 with chance 1 − (7/8)^8
    reaching = Acceptance(1.0, 1.0, reach=(1.0, 1.0, 1.0) + (1 / 8,) * 5)
    ragged = _step_positions([reaching] * 8, [8] * 8, 8)
    padded = _step_positions([reaching] * 8, [8] * 8, 8, padded=True)
    assert ragged[8] == pytest.approx(4.625) and ragged[:4] == [1.0, 2.0, 3.0, 4.0]
    assert padded[8] == pytest.approx(4 + 5 * (1 - (7 / 8) ** 8)) and padded[:4] == [1.0, 2.0, 3.0, 4.0]
    assert _step_positions([reaching, 1.0], [8, 0], 8)[8] == pytest.approx(1 + 3.625 / 2)  # one row not drafting


def test_a_batch_size_whose_only_measured_pass_was_drafted_is_measured_further(tiny_target):
    # one 3-token pass measured at this batch size, nothing longer: a 9-token pass has no estimate, which
    # once raised a TypeError deep in the choice instead of measuring
    policy = CostModelPolicy(max_gamma=8)
    policy.costs.observe(2, 0.002, 0.012, 1)
    seq = seq_state(tiny_target)
    policy.begin(seq)
    assert policy.choose(seq, 8) == MEASURE_K


def test_a_spell_of_short_drafts_does_not_keep_the_cost_model_short_for_good(tiny_target):
    """A proposer that drafts at most 2 tokens for 60 steps (ngram on short matches), then whatever it is asked,
    every draft accepted: once the policy settles at k = 2 it no longer sees how far the proposer reaches, so
    it must ask deeper again of its own accord to find that 8 pays."""
    policy = CostModelPolicy(max_gamma=8, costs=ControlledCosts(), probe_every=1000)
    chosen = drive_one_request(policy, tiny_target, 400, lambda step, k: min(k, 2) if step < 60 else k)
    assert chosen[20:60].count(2) >= 30  # the short spell: asking for more buys nothing (bar a look deeper)
    assert chosen[-100:] == [8] * 100


def test_early_rejections_of_a_second_draft_do_not_keep_the_cost_model_at_one_token_for_good(tiny_target):
    """The first 12 steps reject every draft after the first, then every draft is accepted (an MTP head whose
    second position starts badly). Drafting one token never measures the later-token rate that chose it, so
    that rate must move back towards the first-token rate while the policy drafts one token, or k = 1 sticks."""
    policy = CostModelPolicy(max_gamma=8, costs=ControlledCosts(), probe_every=1000)
    chosen = drive_one_request(policy, tiny_target, 200, accepted=lambda step, d: min(d, 1) if step < 12 else d)
    assert chosen[6:12].count(1) >= 3  # the bad start does push it to one token
    assert chosen[-50:] == [8] * 50


def test_cost_model_measures_a_stale_dear_choice_again_so_one_unlucky_measurement_does_not_stick(tiny_target):
    truth = {1: 0.010, 2: 0.0105, 3: 0.011, 4: 0.0115, 5: 0.012}.get
    policy = CostModelPolicy(max_gamma=4, probe_every=1000)
    seq = seq_state(tiny_target)
    policy.begin(seq)
    assert run_with_true_costs(policy, seq, truth, 1.0, 3) == [0, MEASURE_K, MEASURE_K]
    paused = lambda n: 0.040 if n == 5 else truth(n)  # the first 4-token draft's pass caught a 28 ms pause
    assert run_with_true_costs(policy, seq, paused, 1.0, 1) == [4]
    chosen = run_with_true_costs(policy, seq, truth, 1.0, 8 * REMEASURE_AFTER)
    assert 4 not in chosen[:REMEASURE_AFTER // 2]  # the pause makes k = 4 look dear for a while
    assert chosen[-REMEASURE_AFTER:] == [4] * REMEASURE_AFTER  # measured again when stale: back to the best k


def test_scoring_cost_at_an_unmeasured_batch_size_comes_from_the_batch_sizes_around_it():
    costs = MeasuredCosts()
    truth = lambda n, b: 0.003 + 0.0004 * n + 0.0006 * b + 0.0001 * n * b
    for n, b in [(1, 4), (5, 4), (1, 16), (5, 16)]:
        costs.observe(n - 1, 0.0, truth(n, b), b)
    assert costs.verify_time(3, 8) == pytest.approx(truth(3, 8))  # between 4 and 16: linear in B here
    assert costs.verify_time(3, 2) == pytest.approx(truth(3, 4))  # below 4: bounded by it
    costs.observe(4, 0.0, 2 * truth(5, 13), 13)  # one length measured at 13 rows, twice the interpolation
    assert costs.verify_time(5, 13) == pytest.approx(2 * truth(5, 13))
    assert costs.verify_time(1, 13) == pytest.approx(2 * truth(1, 13))  # the neighbours' shape at its level


def drive_batch(policy, seqs, steps, verify, accepted_share=0.75):
    """Run ``steps`` batch steps of ``seqs`` at scoring cost verify(n, B) and 0.5 ms + 0.2 ms a token of
    drafting; the chosen k of each step."""
    chosen = []
    for _ in range(steps):
        ks = policy.choose_batch(seqs, [4] * len(seqs))
        k, rows = max(ks), sum(1 for x in ks if x)
        step = {"drafted": sum(ks), "draft_time": 0.0005 + 0.0002 * k if k else 0.0,
                "verify_time": verify(k + 1, len(seqs)), "batch_size": len(seqs), "scored": k + 1, "draft_rows": rows}
        for seq, kr in zip(seqs, ks):
            seq.scratch["batch_step"] = step
            policy.update(seq, kr, round(kr * accepted_share), step["draft_time"], step["verify_time"], len(seqs))
        chosen.append(k)
    return chosen


def test_a_batch_that_shrinks_keeps_drafting_without_measuring_again(tiny_target):
    # rows finishing at the end of a wave: 16 -> 13 -> 7 rows; each new batch size used to cost a plain step
    # and two measuring steps, a fifth of a 16-request wave
    verify = lambda n, b: 0.004 + 0.0004 * b + 0.0002 * n * b
    policy = CostModelPolicy(max_gamma=4, probe_every=1000)
    seqs = [seq_state(tiny_target) for _ in range(16)]
    for seq in seqs:
        policy.begin(seq)
    assert drive_batch(policy, seqs, 6, verify)[:3] == [0, MEASURE_K, MEASURE_K]
    assert 0 not in drive_batch(policy, seqs[:13], 3, verify) + drive_batch(policy, seqs[:7], 3, verify)


def test_a_batch_that_shrank_to_a_size_priced_only_from_others_drafts_to_measure_it_rather_than_switch_off(
        tiny_target):
    """Rows leaving a wave bring batch sizes never measured, priced from the sizes around them. Where those
    estimates say drafting loses (here a slow spell measured at 16 rows) switching off would never measure a
    drafted pass at the new size, probes aside: it drafts once to measure, and the measurement decides."""
    verify = lambda n, b: 0.004 + 0.0004 * b + 0.0002 * n * b
    policy = CostModelPolicy(max_gamma=4, probe_every=1000)
    seqs = [seq_state(tiny_target) for _ in range(16)]
    for seq in seqs:
        policy.begin(seq)
    assert min(drive_batch(policy, seqs, 8, verify)[3:]) > 0
    for (n, b) in list(policy.costs.verify):  # a slow spell: every drafted pass at 16 rows measured 3x dear
        if n > 1:
            policy.costs.verify[n, b] = 3 * verify(n, b)
    assert policy.costs.carried_over(12) and not policy.costs.carried_over(16)
    chosen = drive_batch(policy, seqs[:12], 6, verify)
    assert chosen[0] > 0  # drafts to measure a drafted pass at 12 rows (then a plain one, in this case)
    assert min(chosen[-4:]) > 0  # measured at 12 rows, drafting pays there: it goes on


def test_a_step_in_which_no_row_may_draft_leaves_speculation_on(tiny_target):
    """The last step of a wave (every row at its last token) is no choice of k = 0: a kept policy that was
    drafting for a 5% gain keeps drafting in the next wave, without the switch-on margin's 10%."""
    policy = CostModelPolicy(max_gamma=4, prior_alpha=0.5, costs=ControlledCosts(), probe_every=1000)
    seqs = [seq_state(tiny_target) for _ in range(4)]
    for seq in seqs:
        policy.begin(seq)
    assert max(policy.choose_batch(seqs, [4] * 4)) == 1
    assert policy.choose_batch(seqs, [0] * 4) == [0] * 4
    assert max(policy.choose_batch(seqs, [4] * 4)) == 1


def test_a_policy_kept_from_one_row_measures_drafting_in_many_rows_before_pricing_it(tiny_target):
    """Drafting measured in one row prices four rows at four times as much, a bound a batched drafter stays far
    below: a policy kept from B = 1 (a server, the load bench's warm cells) measures drafting in every row at
    B = 4 rather than switch speculation off on that bound."""
    policy = CostModelPolicy(max_gamma=4, probe_every=1000)
    one = seq_state(tiny_target)
    policy.begin(one)
    for _ in range(8):  # one row: a drafted token costs 2 ms against a 3 ms plain step, and still pays
        k = policy.choose(one, 4)
        policy.update(one, k, k, 0.002 * k, 0.003 + 0.0001 * k)
    assert policy.choose(one, 4) > 0
    verify = lambda n, b: 0.006 + 0.0005 * n  # four rows drafting together: 0.5 ms + 0.2 ms a token
    seqs = [seq_state(tiny_target) for _ in range(4)]
    for seq in seqs:
        policy.begin(seq)
    chosen = drive_batch(policy, seqs, 6, verify, accepted_share=1.0)
    assert chosen[:3] == [0, MEASURE_K, MEASURE_K] and min(chosen[3:]) > 0


def test_drafting_is_priced_by_the_rows_asked_so_a_drafter_that_finds_nothing_in_one_row_is_priced_at_all(tiny_target):
    """``ngram`` drafts nothing in a row without a match, so all 16 rows rarely draft in the same step. Keyed by
    the rows that drafted, drafting in every row asked was never measured, and the policy kept drafting
    MEASURE_K tokens to measure it, whatever the costs and acceptance said."""
    policy = CostModelPolicy(max_gamma=4, probe_every=1000)
    seqs = [seq_state(tiny_target) for _ in range(4)]
    for seq in seqs:
        policy.begin(seq)
    chosen, before = [], [0] * 4
    for _ in range(8):
        ks = policy.choose_batch(seqs, [4] * 4)
        drafted = ks[:3] + [0]  # the last row finds no match
        k = max(drafted)
        step = {"drafted": sum(drafted), "draft_time": 0.0001 * bool(k), "verify_time": 0.010 + 0.0005 * (k + 1),
                "batch_size": 4, "scored": k + 1, "tokens": sum(d + 1 for d in drafted),
                "draft_rows": sum(1 for d in drafted if d), "asked_rows": sum(1 for a in ks if a),
                "backlog_rows": sum(1 for a, b in zip(ks, before) if a and not b)}
        before = ks
        for seq, d in zip(seqs, drafted):
            seq.scratch["batch_step"] = step
            policy.update(seq, d, d, 0.0, step["verify_time"], 4)  # every draft accepted: scoring is cheap
        chosen.append(max(ks))
    assert chosen[:3] == [0, MEASURE_K, MEASURE_K] and chosen[-1] > MEASURE_K


def test_a_long_pass_is_not_priced_on_a_nearly_flat_line_through_two_noisy_neighbours():
    """Beyond the longest pass measured, scoring is extrapolated no flatter than from the shortest to the longest:
    two neighbours 0.8 ms apart (noise) priced a pass three times as long at hardly more, and a shrinking
    batch drafted 8 tokens where 2 paid."""
    costs = MeasuredCosts()
    for n, seconds in [(1, 0.0124), (2, 0.0169), (3, 0.0177)]:
        costs.observe(n - 1, 0.0, seconds, 16)
    slope = (0.0177 - 0.0124) / 2
    assert costs.verify_time(9, 16) == pytest.approx(0.0177 + 6 * slope)
    assert costs.verify_time(9, 15) == pytest.approx(0.0177 + 6 * slope)  # fewer rows: bounded by 16's


def test_a_pass_measured_at_a_new_batch_size_is_not_clipped_by_an_estimate_carried_from_others():
    """The first passes measured at a batch size correct what was carried over from the others, so they are
    taken as measured; and a fit the points leave free (one length at one of two batch sizes) is no estimate:
    it priced four-row passes at nothing, and clipped each one measured to twice that."""
    costs = MeasuredCosts()
    for n in range(1, 6):
        costs.observe(n - 1, 0.0, 0.003, 1)  # one row: every length costs a plain step
    costs.observe(0, 0.0, 0.006, 4)
    assert costs.verify_time(3, 4) is None
    costs.observe(2, 0.0, 0.007, 4)
    assert costs.verify_time(3, 4) == pytest.approx(0.007)
    assert costs.verify_time(1, 8) >= costs.verify_time(1, 4)  # above them all: never below a measured pass
    flat = lambda b: 0.003 + 0.001 * b  # few rows: scoring more tokens costs hardly more
    carried = MeasuredCosts()
    for n, b in [(1, 1), (5, 1), (1, 4), (5, 4)]:
        carried.observe(n - 1, 0.0, flat(b), b)
    carried.observe(0, 0.0, 0.020, 16)
    carried.observe(6, 0.0, 0.057, 16)  # sixteen rows: seven tokens a row cost 2.85 plain steps, as measured
    assert carried.verify_time(7, 16) == pytest.approx(0.057)


def test_a_new_row_count_takes_the_fixed_share_of_drafting_from_a_solved_one():
    """One k seen at a row count: proportional pricing from it would overprice longer drafts by the fixed
    part and keep k where it was (so its passes never vary); the fixed share measured at another row count
    is the better guess."""
    costs = MeasuredCosts()
    one_row = lambda k: 0.0006 + 0.0002 * k
    for k in (2, 4, 6, 3, 5):
        costs.observe(k, one_row(k), 0.004, 1)
    costs.observe(2 * 8, 0.0030, 0.010, 8, scored=3, draft_rows=8)  # 8 rows, k = 2 only: 3 ms
    share = one_row(0) / one_row(2)  # the fixed part's share of a 2-pass step at one row
    assert costs.draft_time(4, 8) == pytest.approx(0.0030 * (share + (1 - share) * 2))
    assert costs.draft_time(4, 8) < 0.0030 * 2  # below proportional


def test_a_step_in_which_a_joining_row_caught_up_is_not_a_drafting_measurement(tiny_target):
    policy = CostModelPolicy(max_gamma=4)
    seqs = [seq_state(tiny_target) for _ in range(8)]
    for i, (draft_time, backlog) in enumerate([(0.004, 0), (0.004, 0), (0.012, 1), (0.004, 0)]):
        step = {"drafted": 32, "draft_time": draft_time, "verify_time": 0.015, "batch_size": 8, "scored": 5,
                "draft_rows": 8, "backlog_rows": backlog}
        for seq in seqs:
            seq.scratch["batch_step"] = step
            policy.update(seq, 4, 3, draft_time / 8, 0.015, 8)
    # same rows drafting as the step before, but one had just joined and drafted its prompt first: left out
    assert policy.costs.draft_time(4, 8) == pytest.approx(0.004)


def test_scoring_fewer_tokens_than_measured_is_bounded_not_extrapolated():
    # two odd measurements at the end of a batch (3 tokens cheap, 5 dear): a line through them priced a
    # plain step at 0 s, and the policy stopped drafting for the rest of the batch
    costs = MeasuredCosts()
    costs.observe(2, 0.0, 0.0051, 4)
    costs.observe(4, 0.0, 0.0152, 4)
    assert costs.verify_time(1, 4) == pytest.approx(0.0051)
    assert costs.verify_time(9, 4) >= 0.0152  # beyond the longest: on their line, never below it


def run_batch(policy, seqs, steps, scoring, drafting, catch_up, alpha):
    """Drive a batch policy over ragged rows: a step whose rows draft ks costs scoring(ks) to score,
    drafting(max k) to draft, and catch_up seconds more for each row whose drafter sat idle the step before;
    drafts accepted at rate alpha (a fixed pseudo-random draw per step, row and depth). Each step's ks."""
    idle = [True] * len(seqs)
    chosen = []
    for _ in range(steps):
        ks = policy.choose_batch(seqs, [8] * len(seqs))
        k = max(ks)
        drafting_rows = [j for j, kj in enumerate(ks) if kj]
        backlog = [j for j in drafting_rows if idle[j]]
        step = {"drafted": sum(ks), "draft_time": drafting(k) * bool(k) + catch_up * len(backlog),
                "verify_time": scoring(ks), "batch_size": len(seqs), "scored": k + 1,
                "tokens": sum(kj + 1 for kj in ks), "draft_rows": len(drafting_rows), "backlog_rows": len(backlog)}
        for j, (seq, kj) in enumerate(zip(seqs, ks)):
            idle[j] = kj == 0
            seq.scratch["batch_step"] = step
            accepted = next((i for i in range(kj) if (hash((len(chosen), j, i)) % 100) >= 100 * alpha), kj)
            policy.update(seq, kj, accepted, 0.0, 0.0, len(seqs))
        chosen.append(ks)
    return chosen


def run_compute_bound_batch(policy, seqs, steps, alpha=0.96):
    """:func:`run_batch` over 16 rows with costs shaped like the zoo's at batch 16 on two AVX2 cores: scoring
    16.6 ms + 10.7 ms a token of the longest draft, drafting k tokens 11.7 ms + 3.3 ms·k, and a row whose
    drafter sat idle catching up 20 ms on its first drafting step; drafts accepted at rate α."""
    return run_batch(policy, seqs, steps, lambda ks: 0.0166 + 0.0107 * max(ks), lambda k: 0.0117 + 0.0033 * k,
                     0.020, alpha)


def test_switched_off_under_load_the_cost_model_drafts_in_all_rows_no_more():
    # every row drafting costs each row a catch-up, and scoring grows by 0.65 plain steps a token: with what a
    # kept policy measured in an earlier run (scoring 1-3 tokens a row lately, 5 long ago), speculation
    # stays off. Probes (one token in one row) are all the drafting it does: neither speculation being off nor
    # a probe may lead to drafting in every row to explore longer passes (each such step pays every row's
    # catch-up, and the measured growth per token already shows they cannot pay)
    policy = CostModelPolicy(max_gamma=8)
    seqs = [seq_state(None) for _ in range(16)]
    for seq in seqs:
        policy.begin(seq)
        policy.update(seq, 4, 4, 0.0, 0.0)  # the proposer's drafts are mostly accepted
    for k in [4] + [0, 1, 2] * 40:
        policy.costs.observe(16 * k, (0.0117 + 0.0033 * k) * bool(k), 0.0166 + 0.0107 * k, 16, scored=k + 1,
                             draft_rows=16)
    policy._batch_idle, policy._batch_k = 1, 0  # off, as the earlier run ended
    chosen = run_compute_bound_batch(policy, seqs, 400)
    assert all(sum(1 for k in ks if k) <= 1 and max(ks) <= 1 for ks in chosen)


def test_a_probe_pass_over_ragged_rows_is_priced_as_the_plain_step_it_nearly_is(tiny_target):
    # one row of 16 drafted a token: the ragged pass scored 17 positions, not 2 in every row; counted as a
    # 2-token pass it once priced drafting a token in every row at a plain step and switched speculation on
    policy = CostModelPolicy(max_gamma=4)
    seqs = [seq_state(tiny_target) for _ in range(16)]
    step = {"drafted": 1, "draft_time": 0.004, "verify_time": 0.018, "batch_size": 16, "scored": 2, "tokens": 17,
            "draft_rows": 1, "backlog_rows": 1}
    for j, seq in enumerate(seqs):
        policy.begin(seq)
        seq.scratch["batch_step"] = step
        policy.update(seq, int(j == 0), int(j == 0), 0.0, 0.018, 16)
    assert set(policy.costs.verify) == {(1, 16)}
    policy.costs.observe(1, 0.004, 0.030, 16, 2, False, 1, tokens=32)  # padded rows: 2 positions in every row
    assert policy.costs.verify[(2, 16)] == 0.030


def off_with_a_dear_pass_measured_long_ago(catch_up, rows=4, dear=0.024):
    """A kept policy over ``rows`` rows, off: a 2-token pass measured twice, long ago, on a slow spell (``dear``;
    every row's drafter catching up ``catch_up`` seconds in the first), plain steps measured lately at 13.5 ms;
    the proposer's drafts mostly accepted."""
    policy = CostModelPolicy(max_gamma=8)
    seqs = [seq_state(None) for _ in range(rows)]
    step = {"drafted": rows, "draft_time": 0.0002 + catch_up * rows, "verify_time": dear, "batch_size": rows,
            "scored": 2, "tokens": 2 * rows, "draft_rows": rows, "backlog_rows": rows}
    for seq in seqs:
        policy.begin(seq)
        seq.scratch["batch_step"] = step
        policy.update(seq, 1, 1, 0.0, 0.0, rows)
    policy.costs.observe(rows, 0.0002, dear, rows, scored=2, draft_rows=rows, tokens=2 * rows)  # no backlog
    for _ in range(REMEASURE_AFTER + 1):
        policy.costs.observe(0, 0.0, 0.0135, rows, scored=1, tokens=rows)
    policy._batch_idle, policy._batch_k = 1, 0
    return policy, seqs


def ngram_like_batch(policy, seqs, steps, catch_up):
    """:func:`run_batch` with costs like ``ngram``'s at batch 4 on two AVX2 cores: scoring 13.5 ms + 4 ms a
    position per row, averaged over the ragged rows; drafting 0.2 ms; drafts accepted at 0.9."""
    return run_batch(policy, seqs, steps, lambda ks: 0.0135 + 0.004 * sum(ks) / len(ks), lambda k: 0.0002,
                     catch_up, 0.9)


def test_where_catching_up_is_cheap_a_probe_measures_every_row_so_one_dear_pass_cannot_keep_speculation_off():
    # Over ragged rows a one-row probe scores a plain pass: a 2-token pass measured dear once (24 ms, 1.8×
    # a plain step, where it costs 1.3×) kept a kept ngram policy at k = 0 for 508 of 511 steps at B = 4.
    # Where every drafter catching up was measured cheap, a probe drafts MEASURE_K in every row instead: it
    # measures a drafted pass and every row's rates, and speculation switches on. (Measured at 27 ms, twice a
    # plain step: at 24 ms the predicted gain of drafting at once is beyond a tie, which switches it on unprobed)
    policy, seqs = off_with_a_dear_pass_measured_long_ago(catch_up=0.0003, dear=0.027)
    chosen = ngram_like_batch(policy, seqs, 100, catch_up=0.0003)
    probe = next(i for i, ks in enumerate(chosen) if max(ks))
    assert chosen[probe] == [MEASURE_K] * 4
    assert all(min(ks) > 0 for ks in chosen[probe + 1:])


def test_a_single_sequence_whose_drafter_catches_up_cheaply_is_not_kept_off_by_one_dear_pass():
    # the same at B = 1 (ngram alone): a one-token probe scores a 2-token pass measured at twice a plain step
    # long ago, and only a 10% predicted gain switched speculation on, so it stayed off for all 100 steps.
    # Catching up is as cheap for one row as for four: the probe measures a drafted pass and it switches on
    policy, seqs = off_with_a_dear_pass_measured_long_ago(catch_up=0.0003, rows=1, dear=0.027)
    chosen = [ks[0] for ks in ngram_like_batch(policy, seqs, 100, catch_up=0.0003)]
    assert max(chosen[:50]) >= MEASURE_K
    assert min(chosen[-20:]) > 0


def test_where_catching_up_is_dear_a_probe_drafts_in_one_row_only():
    # the same dear pass, but each drafter catching up costs 20 ms (a model drafter): all four would cost far
    # more than a plain step, so probes stay in one row and speculation off ("Off means off")
    policy, seqs = off_with_a_dear_pass_measured_long_ago(catch_up=0.020)
    chosen = ngram_like_batch(policy, seqs, 100, catch_up=0.020)
    assert any(max(ks) for ks in chosen)
    assert all(sum(1 for k in ks if k) <= 1 and max(ks) <= 1 for ks in chosen)


def test_after_a_long_enough_wait_a_probe_drafts_in_every_row_even_where_catching_up_is_dear():
    # a kept policy's drafted passes measured on a slow spell: one-row probes score plain passes and never
    # measure a drafted one again, so a model drafter's policy stayed off for every later run (the replay's
    # --spell). Here the dear pass rules drafting out even at full acceptance, so there were no probes at all.
    # Once all four drafters catching up (80 ms) is within 1/32 of the plain steps since they last drafted
    # (190 steps), a probe drafts in every row, pricing stale passes on hope: it measures the pass, and
    # speculation is back
    policy, seqs = off_with_a_dear_pass_measured_long_ago(catch_up=0.020, dear=0.027)
    chosen = ngram_like_batch(policy, seqs, 400, catch_up=0.020)
    every_row = next(i for i, ks in enumerate(chosen) if min(ks) > 0)
    assert all(sum(1 for k in ks if k) <= 1 for ks in chosen[:every_row])
    assert every_row >= 32 * 4 * 0.020 / 0.0135  # not before: the catch-up would cost more than 1/32 of the wait
    assert chosen[every_row] == [chosen[every_row][0]] * 4 and chosen[every_row][0] >= MEASURE_K
    assert all(min(ks) > 0 for ks in chosen[every_row + 1:])


def test_probes_in_every_row_where_catching_up_is_dear_spend_at_most_a_32nd_of_the_steps_off():
    # where drafting truly does not pay (each drafted position costs a plain step, drafts accepted half the
    # time), the probes in every row repeat no sooner than their drafters' catch-up allows: 80 ms, 1/32 of
    # 190 plain steps since every row last drafted
    policy, seqs = off_with_a_dear_pass_measured_long_ago(catch_up=0.020, dear=0.027)
    chosen = run_batch(policy, seqs, 1000, lambda ks: 0.0135 * (1 + sum(ks) / len(ks)), lambda k: 0.0002, 0.020,
                       0.5)
    every_row = [i for i, ks in enumerate(chosen) if min(ks) > 0]
    assert len(every_row) >= 2
    assert all(b - a >= 32 * 4 * 0.020 / 0.0135 for a, b in zip(every_row, every_row[1:]))


def off_over_four_rows_with_a_small_predicted_gain(catch_up):
    """A policy off over four rows whose drafting a token each is predicted ~5% faster than a plain step (plain
    10 ms, a 2-token pass 10.8 ms, drafting 0.2 ms, first drafts accepted 0.16 of the time), each row's drafter
    measured to catch up in ``catch_up`` seconds."""
    policy = CostModelPolicy(max_gamma=1, probe_every=1000)
    for _ in range(3):
        policy.costs.observe(0, 0.0, 0.010, 4, scored=1, tokens=4)
        policy.costs.observe(4, 0.0002, 0.0108, 4, scored=2, draft_rows=4, tokens=8)
    seqs = [seq_state(None) for _ in range(4)]
    for seq in seqs:
        seq.scratch["policy:cost-model"] = {"successes": 0.16, "trials": 1.0, "first": [0.16, 1.0],
                                            "then": [0.16, 1.0], "idle": 0, "wait": 1000}
    policy._batch_k, policy._catch_up = 0, catch_up
    tokens = [4.0, 4 * 1.16]
    rates = policy._rates(tokens, [1] * 4, 4, 1, positions=[1.0, 2.0])
    assert 1.02 < rates[1] / rates[0] < 1 + policy.switch_on_margin  # the gain the rule is about
    return policy, seqs


def test_where_catching_up_is_cheap_speculation_switches_back_on_for_any_gain_beyond_a_tie():
    # the switch-on margin pays for every drafter catching up on what it missed; where that was measured to
    # cost less than a plain step (ngram, suffix) there is nothing to repay, and staying off loses what
    # drafting wins (the replay put ngram at B = 16 a few points behind static γ while off early in requests)
    policy, seqs = off_over_four_rows_with_a_small_predicted_gain(catch_up=0.0003)
    assert policy.choose_batch(seqs, [1] * 4) == [1] * 4
    policy, seqs = off_over_four_rows_with_a_small_predicted_gain(catch_up=0.020)  # a model drafter's
    assert policy.choose_batch(seqs, [1] * 4) == [0] * 4


def test_a_probe_in_every_row_drafts_the_length_that_would_pay_best_were_longer_passes_no_dearer():
    # ngram at B = 4: measured only at MEASURE_K (the pass of 3 positions, drafting at k = 2), and off after
    # a request's poor start. A probe of MEASURE_K again would measure the same short pass, on whose line
    # longer drafts look too dear to ever switch on; this one asks the length that would pay best were a pass
    # up to twice the longest measured no dearer than it
    policy = CostModelPolicy(max_gamma=8, probe_every=4)
    seqs = [seq_state(None) for _ in range(4)]
    for backlog in (4, 0):  # the two measuring steps: every row's drafter catching up (cheaply), then clean
        step = {"drafted": 8, "draft_time": 0.0002 + 0.0003 * backlog, "verify_time": 0.0215, "batch_size": 4,
                "scored": 3, "tokens": 12, "draft_rows": 4, "backlog_rows": backlog}
        for seq in seqs:
            if backlog:
                policy.begin(seq)
            seq.scratch["batch_step"] = step
            policy.update(seq, 2, 2, 0.0, 0.0, 4)
    for i in range(40):  # first drafts accepted 0.3 of the time, later ones always
        for seq in seqs:
            policy.update(seq, 2, 2 if i * 7 % 10 < 3 else 0, 0.0, 0.0)
    for _ in range(3):
        policy.costs.observe(0, 0.0, 0.0135, 4, scored=1, tokens=4)
    policy._batch_idle, policy._batch_k = 0, 0  # off
    chosen = [policy.choose_batch(seqs, [8] * 4) for _ in range(4)]
    assert chosen[:3] == [[0] * 4] * 3
    assert len(set(chosen[3])) == 1 and chosen[3][0] > MEASURE_K


def next_probes(accepted_in_drafting_steps, steps=16):
    """A batch of 4 like ``ngram`` at B = 4 (scoring 13.5 ms + 4 ms a drafted position per row, drafting and
    catching up cheap), probing every 4 steps, whose measuring steps saw no draft accepted; from then on each
    row accepts its share of ``accepted_in_drafting_steps``. The steps that drafted."""
    policy = CostModelPolicy(max_gamma=8, probe_every=4)
    seqs = [seq_state(None) for _ in range(4)]
    for seq in seqs:
        policy.begin(seq)
    drafted_before, drafting_steps = [False] * 4, []
    for i in range(steps):
        ks = policy.choose_batch(seqs, [8] * 4)
        backlog = sum(1 for j, k in enumerate(ks) if k and not drafted_before[j])
        step = {"drafted": sum(ks), "draft_time": (0.0002 + 0.0003 * backlog) * bool(max(ks)),
                "verify_time": 0.0135 + 0.004 * max(ks), "batch_size": 4, "scored": max(ks) + 1,
                "tokens": sum(k + 1 for k in ks), "draft_rows": sum(1 for k in ks if k), "backlog_rows": backlog}
        accepted = accepted_in_drafting_steps if i >= 3 else [0] * 4
        for j, (seq, k) in enumerate(zip(seqs, ks)):
            seq.scratch["batch_step"] = step
            policy.update(seq, k, min(k, accepted[j]), 0.0, 0.0, 4)
            drafted_before[j] = k > 0
        if max(ks):
            drafting_steps.append(i)
    return drafting_steps


def test_a_probe_in_every_row_that_paid_for_itself_is_repeated_without_doubling_the_wait():
    # a probe whose rows' tokens per second beat a plain step's (3 drafts of 8 accepted: 7 tokens in 21.7 ms
    # against 4 in 13.5) comes back after probe_every steps: acceptance rising along a request is caught
    # early; one that lost (1 of 8) doubles the wait, which bounds what probes cost where drafting never pays
    paid, lost = next_probes([2, 1, 0, 0]), next_probes([1, 0, 0, 0])
    first = lost[2]  # after the two measuring steps, speculation off: the first probe
    assert paid[2] == first and paid[3] == first + 4
    assert lost[3] == first + 8


def test_what_an_acceptance_returns_is_the_callers_to_change():
    # the expected tokens and reach are cached per (first, then, reach, cap): a caller extending or changing
    # the list it got must not change what the next caller gets
    acceptance = Acceptance(0.7, 0.9, (1.0, 0.5))
    expected, reach = acceptance.expected_upto(4), acceptance.reach_upto(4)
    expected += [0.0]
    reach[0] = 0.0
    assert acceptance.expected_upto(4) == expected[:5] and len(acceptance.expected_upto(4)) == 5
    assert acceptance.reach_upto(4) == [1.0, 0.5, 1.0, 1.0]


def test_a_drafting_choice_is_kept_by_the_same_rows_then_priced_again(tiny_target):
    # pricing a choice costs 2-4% of a run (docs/policies.md): the same rows keep their k for the next
    # REPRICE_EVERY - 1 steps, each capped by its own budget; a row leaving or joining is priced at once
    assert REPRICE_EVERY == 2
    policy = CostModelPolicy(max_gamma=4, costs=ControlledCosts(), probe_every=1000)
    seqs = [seq_state(tiny_target) for _ in range(4)]
    priced, choose_batch = [], policy._choose_batch
    policy._choose_batch = lambda s, m: priced.append(len(s)) or choose_batch(s, m)
    first = policy.choose_batch(seqs, [4] * 4)
    assert any(first)
    assert policy.choose_batch(seqs, [4, 4, 1, 4]) == [min(k, m) for k, m in zip(first, [4, 4, 1, 4])]
    assert priced == [4]
    policy.choose_batch(seqs, [4] * 4)
    assert priced == [4, 4]  # REPRICE_EVERY steps on
    policy.choose_batch(seqs[:3], [4] * 3)
    assert priced == [4, 4, 3]  # a row left: at once


def test_a_kept_choice_is_priced_again_once_a_pass_is_measured_anew(tiny_target):
    # a choice made on an estimated pass cost is decided again on the measurement, not kept
    class EveryPassNew(ControlledCosts):
        def observe(self, *args):
            return True

    for costs, times_priced in ((ControlledCosts(), 1), (EveryPassNew(), 2)):
        policy = CostModelPolicy(max_gamma=4, costs=costs, probe_every=1000)
        seq, priced, choose = seq_state(tiny_target), [], policy._choose
        policy._choose = lambda s, m: priced.append(m) or choose(s, m)
        k = policy.choose(seq, 4)
        assert k > 0
        policy.update(seq, k, k, 0.004, 0.012)
        policy.choose(seq, 4)
        assert len(priced) == times_priced
