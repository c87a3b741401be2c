"""Proposers that draft trees (``tree=N``): each tree fits the node budget and depth <= k, every branch is honest
about q, ``tree=0`` drafts exactly today's chain, and decoding with a tree stays exact (greedy: equal to
target-only; temperature > 0: the enumerated harness)."""
import pytest
import torch

import specplug
from specplug.tree_conformance import check_tree_q_honesty
from specplug.verifier import Proposal, TreeProposal, validate_tree

PROMPT = [1, 2, 3, 4, 5, 0, 1, 2]
# a context whose last tokens "1 2" were followed by 3, 4, 3 and 5: several continuations for suffix
BRANCHY = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2, 5, 1, 2]
GREEDY = specplug.SamplingParams(temperature=0.0)
SAMPLED = specplug.SamplingParams(temperature=1.0)
CLIPPED = specplug.SamplingParams(temperature=0.7, top_k=3, top_p=0.8)


def make(name, target, **options):
    """The proposer ``name`` for the small target, random heads where it needs heads."""
    if name == "mtp":
        options = {"head": "random", "seed": 3, "num_heads": 3, "init_std": 0.3, **options}
    if name == "eagle":
        options = {"head": "random", "seed": 3, "init_std": 0.15, **options}
    return specplug.get_proposer(name, target=target, **options)


def fresh_seq(target, ids, sampling, seed=0):
    return specplug.SequenceState(ids=list(ids), num_prompt=len(ids), sampling=sampling,
                                  rng=torch.Generator().manual_seed(seed), target=target)


def first_proposal(proposer, target, ids, sampling, k, seed=0):
    seq = fresh_seq(target, ids, sampling, seed)
    proposer.begin(seq)
    out = proposer.propose(seq, k)
    proposer.end(seq)
    return out


def as_tree(proposal) -> TreeProposal:
    return proposal if isinstance(proposal, TreeProposal) else TreeProposal.chain(proposal)


TREE_PROPOSERS = {"mtp": PROMPT, "suffix": BRANCHY}


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED, CLIPPED], ids=["greedy", "t1", "clipped"])
@pytest.mark.parametrize("budget", [1, 4, 16])
@pytest.mark.parametrize("name", TREE_PROPOSERS)
def test_a_tree_fits_its_node_budget_and_depth_k(name, budget, sampling, small_target):
    proposer = make(name, small_target, tree=budget)
    for k in (1, 2, 3):
        tree = as_tree(first_proposal(proposer, small_target, TREE_PROPOSERS[name], sampling, k))
        validate_tree(tree, small_target.vocab_size)
        assert 0 < tree.n <= budget
        assert int(tree.depths().max()) <= k


@pytest.mark.parametrize("name", TREE_PROPOSERS)
def test_a_larger_budget_drafts_several_candidates(name, small_target):
    tree = first_proposal(make(name, small_target, tree=16), small_target, TREE_PROPOSERS[name], GREEDY, 3)
    assert isinstance(tree, TreeProposal) and tree.n > int(tree.depths().max())  # not just a chain


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "t1"])
@pytest.mark.parametrize("name", TREE_PROPOSERS)
def test_tree_zero_drafts_todays_chain(name, sampling, small_target):
    ids = TREE_PROPOSERS[name]
    for seed in range(5):
        today = first_proposal(make(name, small_target), small_target, ids, sampling, 3, seed)
        zero = first_proposal(make(name, small_target, tree=0), small_target, ids, sampling, 3, seed)
        assert isinstance(zero, Proposal) and torch.equal(zero.tokens, today.tokens)
        assert (zero.q is None) == (today.q is None) and (zero.q is None or torch.equal(zero.q, today.q))


@pytest.mark.parametrize("sampling", [SAMPLED, CLIPPED], ids=["t1", "clipped"])
@pytest.mark.parametrize("name", TREE_PROPOSERS)
def test_every_branch_is_honest_about_q(name, sampling, small_target):
    proposer = make(name, small_target, tree=8)
    seeds = iter(range(10_000))
    report = check_tree_q_honesty(
        lambda: as_tree(first_proposal(proposer, small_target, TREE_PROPOSERS[name], sampling, 3, next(seeds))),
        small_target.vocab_size, samples=200)
    assert report.passed, report.evidence


@pytest.mark.parametrize("name", ["mtp", "suffix"])
def test_a_bad_budget_is_an_error_naming_the_proposer(name, small_target):
    for bad in (-1, 2.5, "8"):
        with pytest.raises(ValueError, match=name):
            make(name, small_target, tree=bad)
