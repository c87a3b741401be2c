"""``ngram`` with ``q="counts"``: q is the empirical distribution of what followed every earlier occurrence of
the longest matching n-gram, the draft is drawn from exactly that q, and drafting continues from the drawn
token. The default ``q="point"`` keeps its behaviour."""
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import specplug
from specplug.proposers.ngram import NgramProposer
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution
from specplug.types import SequenceState

PROMPT = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2]  # "1 2" was followed by 3, 4, 3; "1 2 3" by 1 and 5
N_TOKENS = 3
N_SAMPLES = 2000
SETTINGS = {
    "temperature-1": specplug.SamplingParams(temperature=1.0),
    "top-k-3": specplug.SamplingParams(temperature=1.0, top_k=3),
    "top-p-0.8-temp-0.7": specplug.SamplingParams(temperature=0.7, top_p=0.8),
}
PROMPTS = ["def add(a, b):", "class Point:\n    def __init__(self", "for i in range(10):\n", "import os\n"]


def stub_seq(ids, temperature=1.0, seed=0, vocab=16):
    params = specplug.SamplingParams(temperature=temperature, seed=seed)
    target = SimpleNamespace(device=torch.device("cpu"), vocab_size=vocab)
    return SequenceState(ids=list(ids), num_prompt=len(ids), sampling=params, rng=params.generator(), target=target)


def propose(proposer, ids, k, **seq_options):
    seq = stub_seq(ids, **seq_options)
    proposer.begin(seq)
    return proposer.propose(seq, k)


def pvalue(target, proposer, sampling, n=N_SAMPLES):
    expected = exact_distribution(target, PROMPT, N_TOKENS, sampling)
    counts = sampled_distribution(target, proposer, PROMPT, N_TOKENS, sampling, n)
    return chi_square_pvalue(counts, expected)


@pytest.mark.parametrize("setting", SETTINGS)
def test_counts_sampling_matches_target_distribution(setting, small_target):
    proposer = specplug.get_proposer("ngram", target=small_target, q="counts")
    assert pvalue(small_target, proposer, SETTINGS[setting]) > EXACTNESS_ALPHA


class ArgmaxWithSoftQ(NgramProposer):
    """The classic bug: drafts the most frequent continuation but reports the frequencies as q."""

    @staticmethod
    def _draw(follow, total, u):
        return max(follow, key=follow.get)


def test_harness_rejects_counts_drafting_argmax_with_soft_q(small_target):
    proposer = ArgmaxWithSoftQ(target=small_target, q="counts")
    assert pvalue(small_target, proposer, SETTINGS["temperature-1"], 800) < EXACTNESS_ALPHA


def test_greedy_counts_output_equals_target_only(tiny_target):
    proposer = specplug.get_proposer("ngram", target=tiny_target, q="counts")
    for prompt in PROMPTS:
        base = specplug.generate(tiny_target, None, prompt, max_new_tokens=200, sampling=specplug.GREEDY)
        spec = specplug.generate(tiny_target, proposer, prompt, max_new_tokens=200, sampling=specplug.GREEDY,
                                 num_speculative_tokens=4, strict=True)
        assert len(base.tokens) == 200
        assert spec.tokens == base.tokens
        assert spec.stats.target_calls < base.stats.target_calls


def test_q_is_the_empirical_continuation_distribution_and_the_draft_is_drawn_from_it():
    ids = [5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2, 3, 8, 1, 2]  # "1 2" followed by 3, 4, 3; no longer n-gram recurs
    drawn = Counter()
    for seed in range(600):
        proposal = propose(NgramProposer(q="counts"), ids, 1, seed=seed)
        assert torch.allclose(proposal.q[0, [3, 4]], torch.tensor([2 / 3, 1 / 3]))
        assert float(proposal.q[0].sum()) == pytest.approx(1)
        drawn[proposal.tokens.item()] += 1
    assert set(drawn) == {3, 4}
    assert chi_square_pvalue(drawn, {3: 2 / 3, 4: 1 / 3}) > EXACTNESS_ALPHA


def test_longest_matching_ngram_decides():
    # "8 1 2" occurred once, followed by 6: with n up to 3 that match wins over the counts of "1 2"
    ids = [8, 1, 2, 6, 5, 1, 2, 3, 9, 1, 2, 3, 8, 1, 2]
    assert propose(NgramProposer(q="counts"), ids, 1).tokens.tolist() == [6]
    proposal = propose(NgramProposer(q="counts", prompt_lookup_max=2), ids, 1)
    assert proposal.q[0, [6, 3]].tolist() == pytest.approx([1 / 3, 2 / 3])


def test_drafting_continues_from_the_drawn_token():
    # after "1 2 3" came 9, after "1 2 4" came 7: the second draft follows the first one
    ids = [5, 1, 2, 3, 9, 6, 1, 2, 4, 7, 8, 1, 2, 3, 9, 0, 1, 2]
    seen = set()
    for seed in range(40):
        proposal = propose(NgramProposer(q="counts"), ids, 2, seed=seed)
        tokens = proposal.tokens.tolist()
        assert tokens in ([3, 9], [4, 7])
        if proposal.q is not None:
            assert proposal.q[1, tokens[1]] == 1.0
        seen.add(tuple(tokens))
    assert seen == {(3, 9), (4, 7)}


def test_greedy_drafts_the_argmax_with_a_one_hot_q_ties_to_the_most_recent():
    ids = [5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2, 3, 8, 1, 2]
    proposal = propose(NgramProposer(q="counts"), ids, 1, temperature=0)
    assert proposal.tokens.tolist() == [3] and proposal.is_point_mass
    tie = [5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2]  # 3 and 4 once each: 4 followed last
    assert propose(NgramProposer(q="counts"), tie, 1, temperature=0).tokens.tolist() == [4]


def test_point_mode_is_unchanged_and_default():
    ids = [5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2, 3, 8, 1, 2]
    assert NgramProposer().q == "point"
    proposal = propose(NgramProposer(), ids, 3)
    assert proposal.is_point_mass and proposal.tokens.tolist() == [3, 8, 1]  # the most recent run, verbatim


def test_only_accepted_tokens_are_counted():
    proposer = NgramProposer(q="counts")
    seq = stub_seq([1, 2, 3, 1, 2])
    proposer.begin(seq)
    proposer.propose(seq, 3)
    seq.ids.extend([4, 1, 2])  # what the verifier emitted, whatever was drafted
    proposer.observe(seq, None)
    index = seq.scratch[proposer.name]
    assert index.tables[2][(1, 2)] == {3: 1, 4: 1}
    assert index.tables[1][(2,)] == {3: 1, 4: 1}


def test_bad_q_option_is_an_error():
    with pytest.raises(ValueError, match="ngram: q must be"):
        NgramProposer(q="soft")
