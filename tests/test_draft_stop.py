"""draft-model's and eagle's early stop (``stop_below``): a draft ends after a token the draft itself doubts, the output
stays exactly the target's (sampled and greedy, single and batched), and a bad threshold is a clear error."""
import json
import shutil

import pytest
import torch

import specplug
from specplug.drafting_vocab import FREQUENT_TOKENS
from specplug import heads
from specplug.proposers.draft_model import DraftModelProposer
from specplug.proposers.eagle import EagleHead, EagleProposer
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution
from specplug.types import SequenceState

PROMPT = [1, 2, 3, 4, 5, 0, 1, 2]


class CountingLengths(DraftModelProposer):
    """Records how many tokens each proposal holds."""

    lengths: list[tuple[int, int]]  # (asked, proposed) per proposal

    def propose(self, seq, k):
        proposal = super().propose(seq, k)
        self.lengths.append((k, proposal.k))
        return proposal


def test_draft_stops_after_a_doubted_token_and_stays_exact(small_vocab_dirs, small_target):
    sampling = specplug.SamplingParams(temperature=1.0)
    proposer = CountingLengths(target=small_target, model=small_vocab_dirs["draft"], stop_below=0.35)
    proposer.lengths = []
    expected = exact_distribution(small_target, PROMPT, 3, sampling)
    counts = sampled_distribution(small_target, proposer, PROMPT, 3, sampling, 3000)
    cut = sum(1 for asked, got in proposer.lengths if got < asked)
    # the threshold must cut some drafts and not others, or this would test nothing
    assert 0.1 * len(proposer.lengths) < cut < 0.9 * len(proposer.lengths)
    assert all(got >= 1 for _, got in proposer.lengths)  # the doubted token itself is still proposed
    assert chi_square_pvalue(counts, expected) > EXACTNESS_ALPHA


def test_stopped_draft_proposes_exactly_the_tokens_up_to_the_first_doubted_one(tiny_dirs, tiny_target):
    sampling = specplug.SamplingParams(temperature=1.0)
    full = DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"])
    stopping = DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"], stop_below=0.2)
    ids = tiny_target.encode("def add(a, b):")
    for seed in range(10):
        proposals = []
        for proposer in (full, stopping):
            seq = SequenceState(ids=list(ids), num_prompt=len(ids), target=tiny_target, sampling=sampling,
                                rng=torch.Generator().manual_seed(seed))
            proposer.begin(seq)
            proposals.append(proposer.propose(seq, 6))
        whole, cut = proposals
        doubted = [i for i in range(whole.k) if float(whole.q[i, whole.tokens[i]]) < 0.2]
        n = doubted[0] + 1 if doubted else whole.k
        assert cut.tokens.tolist() == whole.tokens[:n].tolist()
        torch.testing.assert_close(cut.q, whole.q[:n])


@pytest.mark.parametrize("batched", [False, True])
def test_greedy_output_with_early_stop_equals_target_only(tiny_dirs, tiny_target, batched):
    proposer = DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"], stop_below=0.3)
    prompts = ["import os\n", "def add(a, b):", "class A:\n"]
    want = [specplug.generate(tiny_target, None, p, max_new_tokens=30, sampling=specplug.GREEDY).tokens for p in prompts]
    if batched:
        results = specplug.generate_batch(tiny_target, proposer, prompts, max_new_tokens=30,
                                          sampling=specplug.GREEDY, num_speculative_tokens=4)
        got = [r.tokens for r in results]
    else:
        got = [specplug.generate(tiny_target, proposer, p, max_new_tokens=30, sampling=specplug.GREEDY,
                                 num_speculative_tokens=4, strict=True).tokens for p in prompts]
    assert got == want


@pytest.mark.parametrize("bad", [1.0, -0.1, "often"])
def test_bad_stop_below_names_the_proposer_and_argument(tiny_dirs, tiny_target, bad):
    with pytest.raises(ValueError, match="draft-model: stop_below"):
        DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"], stop_below=bad)


def test_stop_below_defaults_to_the_drafts_recommendation(tiny_dirs, tiny_target, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_dirs["draft"], draft)
    assert DraftModelProposer(target=tiny_target, model=draft).stop_below == 0.0
    (draft / FREQUENT_TOKENS).write_text(json.dumps({"tokens": list(range(tiny_target.vocab_size)),
                                                     "stop_below": 0.25}))
    assert DraftModelProposer(target=tiny_target, model=draft).stop_below == 0.25
    assert DraftModelProposer(target=tiny_target, model=draft, stop_below=0).stop_below == 0.0


class CountingEagle(EagleProposer):
    """Records (asked, proposed) per proposal."""

    lengths: list[tuple[int, int]]

    def propose(self, seq, k):
        proposal = super().propose(seq, k)
        self.lengths.append((k, proposal.k))
        return proposal


def test_eagle_draft_stops_after_a_doubted_token_and_stays_exact(small_target):
    sampling = specplug.SamplingParams(temperature=1.0)
    proposer = CountingEagle(small_target, head="random", seed=3, init_std=0.15, stop_below=0.3)
    proposer.lengths = []
    expected = exact_distribution(small_target, PROMPT, 3, sampling)
    counts = sampled_distribution(small_target, proposer, PROMPT, 3, sampling, 2000)
    cut = sum(1 for asked, got in proposer.lengths if got < asked)
    assert 0.1 * len(proposer.lengths) < cut < 0.9 * len(proposer.lengths)
    assert all(got >= 1 for _, got in proposer.lengths)
    assert chi_square_pvalue(counts, expected) > EXACTNESS_ALPHA


def test_eagle_stop_below_defaults_to_the_heads_recommendation(small_target, tmp_path):
    module = EagleHead.for_target(small_target.model.config, seed=1)
    heads.save_head(tmp_path / "e", "eagle", module.state_dict(), module.config, small_target,
                    drafting={"stop_below": 0.25})
    assert EagleProposer(small_target, head=tmp_path / "e").stop_below == 0.25
    assert EagleProposer(small_target, head=tmp_path / "e", stop_below=0).stop_below == 0.0
    with pytest.raises(ValueError, match="eagle: stop_below"):
        EagleProposer(small_target, head=tmp_path / "e", stop_below=1.5)
