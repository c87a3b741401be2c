"""``fallback``: the first proposer drafts; where it drafts nothing, the second does, and the step's q is the
drafting proposer's. Both hear every begin, observe and end. Exact under sampling (with the power to catch a
second proposer whose q is dishonest), greedy output equal to target-only, alone and in a batch."""
from collections import Counter

import pytest

import specplug
from specplug.proposers.draft_model import DraftModelProposer
from specplug.proposers.fallback import FallbackProposer
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution
from specplug.types import Proposal, Proposer, SequenceState

# bigrams only: "1 2" recurs (ngram drafts), most other contexts have no earlier bigram (the draft model drafts)
BIGRAMS = {"prompt_lookup_min": 2, "prompt_lookup_max": 2}
PROMPT = [1, 2, 3, 4, 5, 0, 1, 2]
N_TOKENS = 3
SETTINGS = {
    "temperature-1": specplug.SamplingParams(temperature=1.0),
    "top-k-3": specplug.SamplingParams(temperature=1.0, top_k=3),
    "top-p-0.8-temp-0.7": specplug.SamplingParams(temperature=0.7, top_p=0.8),
}


def fallback(target, draft_dir, **options) -> FallbackProposer:
    return specplug.get_proposer("fallback", target=target, first_options=BIGRAMS,
                                 then_options={"model": draft_dir}, **options)


class Counting(Proposer):
    """Counts who drafted: wraps a proposer, passing everything through."""

    def __init__(self, inner):
        self.inner, self.name, self.drafted, self.heard = inner, inner.name, 0, Counter()

    def begin(self, seq):
        self.heard["begin"] += 1
        self.inner.begin(seq)

    def propose(self, seq, k):
        proposal = self.inner.propose(seq, k)
        self.drafted += proposal.tokens.numel() > 0
        return proposal

    def observe(self, seq, verdict):
        self.heard["observe"] += 1
        self.inner.observe(seq, verdict)

    def end(self, seq):
        self.heard["end"] += 1
        self.inner.end(seq)


def counted(target, draft_dir) -> FallbackProposer:
    proposer = fallback(target, draft_dir)
    proposer.first, proposer.then = Counting(proposer.first), Counting(proposer.then)
    return proposer


def pvalue(target, proposer, sampling, n):
    expected = exact_distribution(target, PROMPT, N_TOKENS, sampling)
    return chi_square_pvalue(sampled_distribution(target, proposer, PROMPT, N_TOKENS, sampling, n), expected)


@pytest.mark.parametrize("setting", SETTINGS)
def test_fallback_sampling_matches_target_distribution(setting, small_vocab_dirs, small_target):
    proposer = counted(small_target, small_vocab_dirs["draft"])
    assert pvalue(small_target, proposer, SETTINGS[setting], 2000) > EXACTNESS_ALPHA
    assert proposer.first.drafted > 200 and proposer.then.drafted > 200  # both paths were exercised


class GreedyWithSoftQ(DraftModelProposer):
    """A dishonest second proposer: drafts its argmax but reports its soft distribution as q."""

    @staticmethod
    def _sample(q, rng):
        return int(q.argmax())


def test_harness_rejects_a_fallback_whose_second_proposer_reports_a_false_q(small_vocab_dirs, small_target):
    proposer = fallback(small_target, small_vocab_dirs["draft"])
    proposer.then = GreedyWithSoftQ(target=small_target, model=small_vocab_dirs["draft"])
    assert pvalue(small_target, proposer, SETTINGS["temperature-1"], 1000) < EXACTNESS_ALPHA


def test_the_second_proposer_drafts_only_where_the_first_drafts_nothing(small_vocab_dirs, small_target):
    proposer = fallback(small_target, small_vocab_dirs["draft"])
    sampling = specplug.SamplingParams(temperature=1.0, seed=0)
    seq = SequenceState(ids=list(PROMPT), num_prompt=len(PROMPT), sampling=sampling, rng=sampling.generator(),
                        target=small_target)
    proposer.begin(seq)
    assert proposer.propose(seq, 2).q is None  # "1 2" was followed by 3: ngram's point mass
    seq.ids.append(3)  # "2 3" recurs too: ngram again
    assert proposer.propose(seq, 2).tokens.tolist() == [4, 5]
    seq.ids[-1] = 5  # "2 5" never occurred: the draft model drafts, with its dense q
    drafted = proposer.propose(seq, 2)
    assert drafted.tokens.numel() == 2 and drafted.q is not None and drafted.q.shape == (2, small_target.vocab_size)
    proposer.end(seq)


def test_both_proposers_hear_every_begin_observe_and_end(small_vocab_dirs, small_target):
    proposer = counted(small_target, small_vocab_dirs["draft"])
    result = specplug.generate(small_target, proposer, PROMPT, max_new_tokens=12, num_speculative_tokens=2)
    steps = result.stats.target_calls
    for inner in (proposer.first, proposer.then):
        assert inner.heard == Counter(begin=1, observe=steps, end=1)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_fallback_equals_target_only_alone_and_in_a_batch(batch_size, tiny_dirs, tiny_target):
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(", "for i in range(10):\n", "import os\nimport "]
    reference = [specplug.generate(tiny_target, None, p, max_new_tokens=24, sampling=specplug.GREEDY).tokens
                 for p in prompts]
    proposer = specplug.get_proposer("fallback", target=tiny_target, then_options={"model": tiny_dirs["draft"]})
    results = specplug.generate_batch(tiny_target, proposer, prompts, max_new_tokens=24, num_speculative_tokens=3,
                                      sampling=specplug.GREEDY, max_batch_size=batch_size)
    assert [r.tokens for r in results] == reference


def test_bad_choices_name_the_fallback_and_the_role(tiny_target):
    with pytest.raises(ValueError, match="first and then are both 'ngram'"):
        specplug.get_proposer("fallback", target=tiny_target, then="ngram")
    with pytest.raises(KeyError, match="fallback: then='no-such'"):
        specplug.get_proposer("fallback", target=tiny_target, then="no-such")
    with pytest.raises(TypeError, match="fallback: first='ngram'.*bad options"):
        specplug.get_proposer("fallback", target=tiny_target, first_options={"colour": 1})


class Empty(Proposer):
    name = "empty"

    def propose(self, seq, k):
        return Proposal.empty()


def test_a_step_neither_proposer_drafts_is_a_plain_target_step(small_target):
    proposer = specplug.get_proposer("fallback", target=small_target, then="suffix")
    proposer.first, proposer.then = Empty(), Empty()
    sampling = specplug.SamplingParams(temperature=1.0, seed=3)
    result = specplug.generate(small_target, proposer, PROMPT, max_new_tokens=4, num_speculative_tokens=2,
                               sampling=sampling)
    reference = specplug.generate(small_target, None, PROMPT, max_new_tokens=4, sampling=sampling)
    assert result.tokens == reference.tokens and result.stats.draft_tokens == 0


def test_an_error_that_cannot_be_renamed_reaches_the_caller_as_it_was():
    from specplug.proposers import fallback as module

    def factory(name, **options):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    with pytest.raises(UnicodeDecodeError, match="invalid start byte"):
        module._build(factory, "then", "draft-model", None, None)
