"""The cost-model policy chooses a tree-drafting proposer's node budget as it chooses k: a tree where its measured
acceptance pays for the positions it adds to the scoring pass, the chain where it does not, each budget tried
before its acceptance counts; and whatever it chooses, decoding stays exact."""
import pytest
import torch

import specplug
from conftest import SMALL_V, make_llama
from specplug.node_budgets import TREE_TRIALS, candidate_budgets
from specplug.policies import CostModelPolicy, MeasuredCosts
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution
from specplug.types import NODE_BUDGET


class LinearCosts(MeasuredCosts):
    """Drafting 1 ms a token (a tree level as a chain token); scoring n positions 10 ms + ``slope``·n."""

    def __init__(self, slope: float):
        super().__init__()
        self.slope = slope

    def observe(self, *args):
        pass

    def draft_time(self, k, rows=1):
        return 0.001 * k * rows

    def drafting_measured(self, rows):
        return True

    def verify_time(self, n, batch_size):
        return 0.010 + self.slope * n


def tree_seq(target, max_budget: int):
    seq = specplug.SequenceState(ids=[1, 2, 3], num_prompt=3, sampling=specplug.GREEDY, rng=torch.Generator(),
                                 target=target)
    seq.scratch.update(proposer="p", max_node_budget=max_budget)
    return seq


def step(policy, seq, max_k, chain_accepts, tree_accepts, nodes_of=lambda b: b):
    """One step as the engine runs it: choose, then report a chain (``chain_accepts(k)`` accepted) or a tree of
    ``nodes_of(budget)`` nodes as deep as k (``tree_accepts(k)``). Returns (k, budget)."""
    k = policy.choose(seq, max_k)
    budget = seq.scratch.get(NODE_BUDGET, 0)
    if budget and k:
        seq.scratch["drafted_tree"] = (nodes_of(budget), k)
        policy.update(seq, nodes_of(budget), tree_accepts(k), 0.001 * k, 0.02)
    else:
        seq.scratch["drafted_tree"] = None
        policy.update(seq, k, chain_accepts(k) if k else 0, 0.001 * k, 0.02)
    return k, budget


def run(policy, seq, steps, chain_accepts, tree_accepts):
    return [step(policy, seq, 8, chain_accepts, tree_accepts) for _ in range(steps)]


def test_candidate_budgets_lie_under_the_proposers_option():
    assert candidate_budgets(0) == []
    assert candidate_budgets(6) == [6]
    assert candidate_budgets(32) == [8, 16, 32]
    assert candidate_budgets(20) == [8, 16, 20]


def test_each_budget_is_tried_before_its_acceptance_counts(tiny_target):
    policy, seq = CostModelPolicy(max_gamma=8, costs=LinearCosts(0.0005)), tree_seq(tiny_target, 32)
    policy.begin(seq)
    chosen = [b for _, b in run(policy, seq, 40, lambda k: k // 2, lambda k: k // 2)]
    for budget in (0, 8, 16, 32):
        assert chosen.count(budget) >= TREE_TRIALS
    assert chosen[:TREE_TRIALS] == [0] * TREE_TRIALS  # the chain first: its α prices every tree's gain


def test_a_tree_whose_acceptance_pays_for_its_nodes_is_chosen(tiny_target):
    """Scoring nearly flat in the positions (as with bf16 products on few rows): a tree that passes every level,
    where the chain passes half, wins."""
    policy, seq = CostModelPolicy(max_gamma=8, costs=LinearCosts(0.0002)), tree_seq(tiny_target, 16)
    policy.begin(seq)
    late = run(policy, seq, 60, lambda k: k // 2, lambda k: k)[-20:]
    assert all(b == 8 for _, b in late)  # a tree; of two that pass every level, the one with fewer nodes


def test_a_tree_that_costs_more_than_it_earns_loses_to_the_chain(tiny_target):
    """Scoring dear per position: a tree passing one level more than the chain cannot pay for its nodes."""
    policy, seq = CostModelPolicy(max_gamma=8, costs=LinearCosts(0.004)), tree_seq(tiny_target, 16)
    policy.begin(seq)
    steps = run(policy, seq, 60, lambda k: min(k, 2), lambda k: min(k, 3))
    assert all(b == 0 for _, b in steps[-20:])
    assert all(k > 0 for k, _ in steps[-20:])  # the chain still pays


def test_a_chain_proposer_is_never_given_a_node_budget(tiny_target):
    policy, seq = CostModelPolicy(max_gamma=8, costs=LinearCosts(0.0002)), tree_seq(tiny_target, 0)
    policy.begin(seq)
    assert all(b == 0 for _, b in run(policy, seq, 30, lambda k: k, lambda k: k))


def test_a_tree_proposer_drafts_the_budget_it_is_given_and_never_more_than_its_option(small_target):
    proposer = specplug.get_proposer("mtp", target=small_target, head="random", seed=3, num_heads=3, tree=16)
    seq = specplug.SequenceState(ids=[1, 2, 3, 4, 5, 0, 1, 2], num_prompt=8, sampling=specplug.GREEDY,
                                 rng=torch.Generator().manual_seed(0), target=small_target)
    sizes = {}
    for budget in (None, 0, 5, 64):
        seq.scratch.pop(NODE_BUDGET, None)
        if budget is not None:
            seq.scratch[NODE_BUDGET] = budget
        proposer.begin(seq)
        out = proposer.propose(seq, 3)
        sizes[budget] = (type(out).__name__, out.n if hasattr(out, "n") else out.k)
        proposer.end(seq)
    assert sizes[0] == ("Proposal", 3)
    assert sizes[5] == ("TreeProposal", 5)
    assert sizes[None][0] == sizes[64][0] == "TreeProposal" and sizes[None][1] == sizes[64][1] <= 16


@pytest.fixture(scope="module")
def tree_draft(tmp_path_factory, small_target):
    """A draft-model proposer drafting trees of 8 nodes with a draft that agrees with the small target a third of
    the time (its weights the target's, drawn at a smaller scale): some trees pay, some chains."""
    draft = make_llama(tmp_path_factory.mktemp("near") / "draft", SMALL_V, hidden=32, layers=2, seed=0, init=0.2)
    return specplug.get_proposer("draft-model", target=small_target, model=draft, tree=8)


def test_greedy_decoding_under_the_cost_model_with_a_tree_proposer_equals_target_only(small_target, tree_draft):
    prompt = [1, 2, 3, 4, 5, 0, 1, 2]
    base = specplug.generate(small_target, None, prompt, max_new_tokens=40, sampling=specplug.GREEDY)
    policy = CostModelPolicy(max_gamma=4, costs=LinearCosts(0.0002))
    result = specplug.generate(small_target, tree_draft, prompt, max_new_tokens=40, sampling=specplug.GREEDY,
                               num_speculative_tokens=policy)
    assert result.tokens == base.tokens
    scored = result.stats.step_scored
    assert any(n > 5 for n in scored) and any(1 < n <= 5 for n in scored)  # trees tried, chains too


def test_sampling_under_the_cost_model_with_a_tree_proposer_stays_exact(small_target, tree_draft):
    prompt, sampling = [1, 2, 3, 4, 5, 0, 1, 2], specplug.SamplingParams(temperature=1.0)
    counts = sampled_distribution(small_target, tree_draft, prompt, 3, sampling, 2000,
                                  num_speculative_tokens=CostModelPolicy(max_gamma=2, costs=LinearCosts(0.0002)))
    assert chi_square_pvalue(counts, exact_distribution(small_target, prompt, 3, sampling)) > EXACTNESS_ALPHA
