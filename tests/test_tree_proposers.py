"""Proposers that draft trees (``tree=N``): each tree fits the node budget and depth <= k, every branch is honest
about q, ``tree=0`` drafts exactly today's chain, and decoding with a tree stays exact (greedy: equal to
target-only; temperature > 0: the enumerated harness)."""
import importlib.util

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
    """The proposer ``name`` for the small target, random heads where it needs heads (the small draft model is
    found beside the small target)."""
    if name == "draft-model":
        options = {"model": str(target.path.parent / "draft"), **options}
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


TREE_PROPOSERS = {"mtp": PROMPT, "suffix": BRANCHY, "eagle": PROMPT, "draft-model": PROMPT}


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


@pytest.mark.parametrize("name", TREE_PROPOSERS)
def test_a_bad_budget_is_an_error_naming_the_proposer(name, small_target):
    for bad, error in ((-1, ValueError), (2.5, TypeError), ("8", TypeError), (True, TypeError)):
        with pytest.raises(error, match=name):
            make(name, small_target, tree=bad)


@pytest.mark.parametrize("name", ["eagle", "draft-model"])
def test_sampled_children_are_declared_drawn_without_replacement_and_the_check_sees_otherwise(name, small_target):
    proposer = make(name, small_target, tree=6, tree_width=3)  # k = 2: three siblings under the root each time

    def draw(flip):
        seeds = iter(range(10_000))

        def one():
            tree = first_proposal(proposer, small_target, PROMPT, SAMPLED, 2, next(seeds))
            assert tree.q is not None and bool(tree.without_replacement.all())
            if flip:  # the mutant: the same draws declared independent
                tree.without_replacement = ~tree.without_replacement
            return tree
        return one

    # the small draft's q is flat, so independent and without-replacement draws differ by little: many samples
    assert check_tree_q_honesty(draw(False), small_target.vocab_size, samples=1000).passed
    assert not check_tree_q_honesty(draw(True), small_target.vocab_size, samples=1000).passed


def test_draft_model_tree_children_follow_the_draft_along_their_path(small_target):
    """Each expanded node's first child is the draft's argmax after prompt + the node's path: the masked run
    sees the node's ancestors and nothing else."""
    tree = first_proposal(make("draft-model", small_target, tree=12, tree_width=3), small_target, PROMPT, GREEDY, 4)
    chain = make("draft-model", small_target)
    expanded = 0
    for node in range(tree.n):
        kids = (tree.parents == node).nonzero().flatten().tolist()
        if kids:
            path = tree.tokens[tree.path_to(node)].tolist()
            assert first_proposal(chain, small_target, PROMPT + path, GREEDY, 1).tokens.tolist() == [
                int(tree.tokens[kids[0]])]
            expanded += 1
    assert expanded >= 2


def test_eagle_tree_of_width_one_is_the_greedy_chain(small_target):
    chain = first_proposal(make("eagle", small_target), small_target, PROMPT, GREEDY, 4)
    tree = first_proposal(make("eagle", small_target, tree=4, tree_width=1), small_target, PROMPT, GREEDY, 4)
    assert tree.parents.tolist() == [-1, 0, 1, 2] and torch.equal(tree.tokens, chain.tokens)


def test_eagle_tree_keeps_only_verified_entries(small_target):
    proposer = make("eagle", small_target, tree=12, tree_width=3)
    seq = fresh_seq(small_target, PROMPT, SAMPLED)
    proposer.begin(seq)
    proposer.propose(seq, 4)
    assert seq.scratch["eagle"].cache.length == len(PROMPT) - 1


def test_draft_model_cache_holds_the_accepted_path_after_observe(small_target):
    from specplug.verifier import TreeVerdict

    proposer = make("draft-model", small_target, tree=12, tree_width=3)
    seq = fresh_seq(small_target, PROMPT, GREEDY)
    proposer.begin(seq)
    tree = proposer.propose(seq, 4)
    path = tree.path_to(int(tree.depths().argmax()))
    emitted = tree.tokens[path].tolist() + [0]
    seq.ids += emitted
    proposer.observe(seq, TreeVerdict(accepted=len(path), proposed=tree.n, tokens=emitted, path=path))
    # the path's entries are kept (a leaf at full depth was never run, as a chain's last draft is never fed)
    assert len(PROMPT) + len(path) - 1 <= seq.scratch["draft-model"].length <= len(seq.ids) - 1
    # what it drafts next is what a fresh proposer drafts from the same sequence
    fresh = first_proposal(make("draft-model", small_target, tree=12, tree_width=3), small_target, seq.ids, GREEDY, 3)
    after = proposer.propose(seq, 3)
    assert torch.equal(after.tokens, fresh.tokens) and torch.equal(after.parents, fresh.parents)


def test_draft_model_tree_needs_the_lean_path(small_target):
    with pytest.raises(ValueError, match="draft-model: tree="):
        make("draft-model", small_target, tree=8, fast=False)


# --- decoding with trees, through the engine ---------------------------------------------------------------

from specplug import zoo  # noqa: E402
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue, exact_distribution, sampled_distribution  # noqa: E402

N_TOKENS = 3
N_SAMPLES = 1500
# the engine's tree steps (scoring, verifying and keeping a tree) arrive with the tree-engine branch
engine_trees = pytest.mark.skipif(importlib.util.find_spec("specplug.tree_steps") is None,
                                  reason="this engine does not verify trees yet")
TEXT_PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


@engine_trees
@pytest.mark.parametrize("name", TREE_PROPOSERS)
def test_greedy_with_a_tree_equals_target_only_on_tiny_models(name, small_target, tiny_target):
    for target, prompt in ((small_target, BRANCHY if name == "suffix" else PROMPT), (tiny_target, TEXT_PROMPT)):
        base = specplug.generate(target, None, prompt, max_new_tokens=120, sampling=GREEDY)
        for budget, gamma in ((4, 2), (12, 4)):
            out = specplug.generate(target, make(name, target, tree=budget, tree_width=3)
                                    if name in ("eagle", "draft-model") else make(name, target, tree=budget),
                                    prompt, max_new_tokens=120, sampling=GREEDY, num_speculative_tokens=gamma,
                                    strict=True)
            assert out.tokens == base.tokens, (name, budget, gamma)
            assert out.stats.draft_tokens > 0 and out.stats.fallback_steps == 0


@engine_trees
@pytest.mark.parametrize("sampling", [SAMPLED, CLIPPED], ids=["t1", "top-k-top-p"])
@pytest.mark.parametrize("name", TREE_PROPOSERS)
def test_sampling_with_a_tree_is_exact(name, sampling, small_target):
    prompt = BRANCHY if name == "suffix" else PROMPT
    options = {"tree": 6, "tree_width": 3} if name in ("eagle", "draft-model") else {"tree": 6}
    expected = exact_distribution(small_target, prompt, N_TOKENS, sampling)
    counts = sampled_distribution(small_target, make(name, small_target, **options), prompt, N_TOKENS, sampling,
                                  N_SAMPLES)
    assert chi_square_pvalue(counts, expected) > EXACTNESS_ALPHA


@pytest.fixture(scope="module")
def zoo_target_only():
    """The zoo's target and its greedy target-only output for each of ZOO_PROMPTS (one target: a finished
    decode leaves nothing behind for the next one)."""
    for name in ("pycode", zoo.DEFAULT_EAGLE["pycode"], zoo.DEFAULT_MTP["pycode"], zoo.DEFAULT_DRAFT["pycode"]):
        if not (zoo.models_dir() / name / "model.safetensors").is_file():
            pytest.skip(f"bundled {name} is absent from this checkout")
    target = specplug.Target.from_pretrained("zoo:pycode")
    return target, {p: specplug.generate(target, None, p, max_new_tokens=200, sampling=GREEDY).tokens
                    for p in ZOO_PROMPTS}


ZOO_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\n\n\ndef list_files(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "def is_prime(n: int) -> bool:\n",
    "def read_json(path):\n    with open(path) as f:\n",
]


@engine_trees
@pytest.mark.slow
@pytest.mark.parametrize("budget", [8, 32])
@pytest.mark.parametrize("name", TREE_PROPOSERS)
def test_greedy_with_a_tree_equals_target_only_on_the_zoo(name, budget, zoo_target_only):
    target, target_only = zoo_target_only
    proposer = specplug.get_proposer(name, target=target, tree=budget)
    for prompt in ZOO_PROMPTS:
        out = specplug.generate(target, proposer, prompt, max_new_tokens=200, sampling=GREEDY,
                                num_speculative_tokens=4, strict=True)
        assert out.tokens == target_only[prompt], (name, prompt)


@engine_trees
def test_the_harness_fails_a_tree_whose_sampled_siblings_are_declared_independent(small_target, monkeypatch):
    """Power: the same draws without replacement, declared independent, move the output law."""
    import specplug.feature_heads as feature_heads

    grow = feature_heads.grow_tree

    def declared_independent(*args, **kwargs):
        tree, kept = grow(*args, **kwargs)
        tree.without_replacement = torch.zeros_like(tree.without_replacement)
        return tree, kept

    monkeypatch.setattr(feature_heads, "grow_tree", declared_independent)
    expected = exact_distribution(small_target, PROMPT, N_TOKENS, SAMPLED)
    counts = sampled_distribution(small_target, make("eagle", small_target, tree=6, tree_width=3), PROMPT, N_TOKENS,
                                  SAMPLED, N_SAMPLES)
    assert chi_square_pvalue(counts, expected) < EXACTNESS_ALPHA
