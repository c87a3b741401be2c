"""draft-model over a subset of the vocabulary: drafts only inside it, reports q over it (zero elsewhere), stays
exact, and says clearly what is wrong with a bad ``vocab``."""
import json
import shutil

import pytest
import torch

import specplug
from specplug.drafting_vocab import FREQUENT_TOKENS
from specplug.proposers.draft_model import DraftModelProposer
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution
from specplug.types import SequenceState


def test_subset_draft_proposes_only_subset_tokens_with_q_zero_elsewhere(tiny_dirs, tiny_target):
    subset = list(range(0, tiny_target.vocab_size, 3))
    for fast in (True, False):
        proposer = DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"], vocab=subset, fast=fast)
        seq = SequenceState(ids=tiny_target.encode("def add(a, b):"), num_prompt=5, target=tiny_target,
                            sampling=specplug.SamplingParams(temperature=1.0), rng=torch.Generator().manual_seed(1))
        proposer.begin(seq)
        for _ in range(20):
            proposal = proposer.propose(seq, 4)
            assert set(proposal.tokens.tolist()) <= set(subset)
            outside = torch.ones(tiny_target.vocab_size, dtype=torch.bool)
            outside[subset] = False
            assert torch.allclose(proposal.q.sum(-1), torch.ones(4)) and not proposal.q[:, outside].any()
            proposer.begin(seq)


def test_subset_draft_decodes_greedy_as_target_only_and_the_same_on_lean_and_hf_paths(tiny_dirs, tiny_target):
    subset = list(range(tiny_target.vocab_size // 2))
    fast = DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"], vocab=subset)
    slow = DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"], vocab=subset, fast=False)
    base = specplug.generate(tiny_target, None, "import os\n", max_new_tokens=40, sampling=specplug.GREEDY)
    for sampling in (specplug.GREEDY, specplug.SamplingParams(temperature=1.0, seed=4)):
        a = specplug.generate(tiny_target, fast, "import os\n", max_new_tokens=40, sampling=sampling, strict=True)
        b = specplug.generate(tiny_target, slow, "import os\n", max_new_tokens=40, sampling=sampling, strict=True)
        assert a.tokens == b.tokens
        if sampling.greedy:
            assert a.tokens == base.tokens


@pytest.mark.parametrize("sampling", [specplug.SamplingParams(temperature=1.0),
                                      specplug.SamplingParams(temperature=0.7, top_k=3)], ids=["T1", "top-k-3"])
def test_subset_draft_sampling_matches_target_distribution(sampling, small_vocab_dirs, small_target):
    prompt = [1, 2, 3, 4, 5, 0, 1, 2]
    proposer = DraftModelProposer(target=small_target, model=small_vocab_dirs["draft"], vocab=[0, 2, 3, 5])
    expected = exact_distribution(small_target, prompt, 3, sampling)
    counts = sampled_distribution(small_target, proposer, prompt, 3, sampling, 1500)
    assert chi_square_pvalue(counts, expected) > EXACTNESS_ALPHA


@pytest.mark.parametrize("weights", ["loaded", "int8"])
def test_sampled_vocab_serves_sampling_rows_and_vocab_greedy_ones_single_and_batched(tiny_dirs, tiny_target, weights):
    subset = list(range(0, tiny_target.vocab_size, 3))
    proposer = DraftModelProposer(target=tiny_target, model=tiny_dirs["draft"], vocab=subset, sampled_vocab="all",
                                  weights=weights)
    outside = [i for i in range(tiny_target.vocab_size) if i not in subset]
    ids = tiny_target.encode("def add(a, b):")

    def seq(temperature, seed):
        return SequenceState(ids=list(ids), num_prompt=len(ids), target=tiny_target, rng=torch.Generator().manual_seed(seed),
                             sampling=specplug.SamplingParams(temperature=temperature))

    sampled, greedy = seq(1.0, 1), seq(0.0, 2)
    for s in (sampled, greedy):
        proposer.begin(s)
    assert float(proposer.propose(sampled, 4).q[:, outside].sum()) > 0  # drawn from the whole vocabulary
    assert set(proposer.propose(greedy, 4).tokens.tolist()) <= set(subset)
    # a batch of greedy rows drafts over the subset; a mixed one over the sampled vocabulary for all its rows
    rows = [seq(0.0, 3), seq(0.0, 4)]
    for s in rows:
        proposer.begin(s)
    assert all(set(p.tokens.tolist()) <= set(subset) for p in proposer.propose_batch(rows, [4, 4]))
    mixed = [seq(1.0, 5), seq(0.0, 6)]
    for s in mixed:
        proposer.begin(s)
    first, second = proposer.propose_batch(mixed, [4, 4])
    assert float(first.q[:, outside].sum()) > 0 and second.q is None


def test_draft_with_a_sampled_vocab_is_exact(small_vocab_dirs, small_target):
    sampling = specplug.SamplingParams(temperature=1.0)
    proposer = DraftModelProposer(target=small_target, model=small_vocab_dirs["draft"], vocab=[0, 2, 3],
                                  sampled_vocab=[1, 2, 4, 5])
    expected = exact_distribution(small_target, [1, 2, 3, 4, 5, 0, 1, 2], 3, sampling)
    counts = sampled_distribution(small_target, proposer, [1, 2, 3, 4, 5, 0, 1, 2], 3, sampling, 1500)
    assert chi_square_pvalue(counts, expected) > EXACTNESS_ALPHA


def test_vocab_count_reads_the_ranks_file_in_the_draft_directory(tiny_dirs, tiny_target, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_dirs["draft"], draft)
    with pytest.raises(ValueError, match=f"draft-model: vocab=8 needs {FREQUENT_TOKENS}"):
        DraftModelProposer(target=tiny_target, model=draft, vocab=8)
    ranked = list(range(tiny_target.vocab_size))[::-1]
    (draft / FREQUENT_TOKENS).write_text(json.dumps({"tokens": ranked}))
    proposer = DraftModelProposer(target=tiny_target, model=draft, vocab=8)
    assert proposer.subset.tolist() == sorted(ranked[:8])
    assert DraftModelProposer(target=tiny_target, model=draft).subset is None  # no recommendation: all tokens
    (draft / FREQUENT_TOKENS).write_text(json.dumps({"tokens": ranked, "default_vocab": 5}))
    assert DraftModelProposer(target=tiny_target, model=draft).subset.tolist() == sorted(ranked[:5])
    assert DraftModelProposer(target=tiny_target, model=draft, vocab="all").subset is None
    assert DraftModelProposer(target=tiny_target, model=draft).sampled_subset.tolist() == sorted(ranked[:5])
    (draft / FREQUENT_TOKENS).write_text(json.dumps({"tokens": ranked, "default_vocab": 5, "sampled_vocab": "all"}))
    assert DraftModelProposer(target=tiny_target, model=draft).sampled_subset is None  # the recommendation
    with pytest.raises(ValueError, match="outside 1.."):
        DraftModelProposer(target=tiny_target, model=draft, vocab=0)
    with pytest.raises(ValueError, match="within"):
        DraftModelProposer(target=tiny_target, model=draft, vocab=[tiny_target.vocab_size])
    with pytest.raises(TypeError, match="draft-model: vocab"):
        DraftModelProposer(target=tiny_target, model=draft, vocab="many")


def test_bundled_draft_ships_a_ranking_of_the_whole_vocabulary():
    from specplug import zoo

    ranks = json.loads((zoo.resolve("zoo:pycode") / FREQUENT_TOKENS).read_text())
    target = specplug.Target.from_pretrained("zoo:pycode")
    assert sorted(ranks["tokens"]) == list(range(target.vocab_size))
    assert specplug.get_proposer("draft-model", target=target).subset.numel() == ranks["default_vocab"]
    proposer = specplug.get_proposer("draft-model", target=target, vocab=1024)
    prompt = "def parse(text):\n"
    base = specplug.generate(target, None, prompt, max_new_tokens=32, sampling=specplug.GREEDY)
    spec = specplug.generate(target, proposer, prompt, max_new_tokens=32, sampling=specplug.GREEDY, strict=True)
    assert spec.tokens == base.tokens and spec.stats.accepted_tokens > 0
