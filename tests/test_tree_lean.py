"""The lean forward's tree primitives: a masked run scores each node over the prefix and its own ancestors
only, the accepted path scores as the chain of its tokens would, and compacting the cache onto that path
leaves the cache the chain would have left (the next step's logits bit for bit)."""
import pytest
import torch

import specplug
from specplug.lean_llama import lean_or_reason
from specplug.verifier import TreeProposal
from tiny import private_machine_cache  # noqa: F401 (autouse: a private speed-choice cache)


@pytest.fixture(scope="module")
def lean(tiny_dirs):
    target = specplug.Target.from_pretrained(tiny_dirs["target"], lean=False)
    lean, why = lean_or_reason(target.model)
    assert lean is not None, why
    return lean


def _tree(vocab: int, seed: int = 0) -> TreeProposal:
    """root -> {a, b}; a -> {c, d}; c -> {e}; b -> {f}: the path a, c, e is three deep."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (6,), generator=gen)
    return TreeProposal(tokens, [-1, -1, 0, 0, 2, 1])


def _prefilled(lean, prefix):
    cache = lean.new_cache()
    lean.run(cache, prefix)
    return cache


def _score_tree(lean, cache, last: int, tree: TreeProposal):
    start = cache.length
    mask = torch.cat([torch.ones(tree.n + 1, start, dtype=torch.bool), tree.attention_mask()], dim=1)
    logits, _ = lean.run_masked(cache, [last] + tree.tokens.tolist(), tree.positions(start), mask)
    return logits


def test_a_causal_masked_run_is_the_plain_run_bit_for_bit(lean):
    prefix, step = [5, 9, 17, 3, 8], [11, 12, 13]
    plain, masked = _prefilled(lean, prefix), _prefilled(lean, prefix)
    want, _ = lean.run(plain, step)
    L = masked.length
    mask = torch.ones(3, L + 3, dtype=torch.bool).tril(L)
    got, _ = lean.run_masked(masked, step, range(L, L + 3), mask)
    assert torch.equal(got, want)


def test_the_accepted_path_scores_as_its_chain_and_compaction_leaves_the_chains_cache(lean):
    prefix, last = [5, 9, 17, 3, 8, 40, 2], 77
    tree = _tree(lean.embedding.shape[0])
    path = [0, 2, 4]
    tree_cache = _prefilled(lean, prefix)
    start = tree_cache.length
    tree_logits = _score_tree(lean, tree_cache, last, tree)
    chain_cache = _prefilled(lean, prefix)
    chain_logits, _ = lean.run(chain_cache, [last] + tree.tokens[path].tolist())
    rows = tree.kept_block_indices(path)
    assert torch.equal(tree_logits[rows], chain_logits)
    tree_cache.keep_entries(start, [start + r for r in rows])
    assert tree_cache.length == chain_cache.length
    for a, b in zip(tree_cache.layers, chain_cache.layers):
        assert torch.equal(a.k[:, :a.length], b.k[:, :b.length]) and torch.equal(a.v[:, :a.length], b.v[:, :b.length])
    assert torch.equal(lean.run(tree_cache, [21])[0], lean.run(chain_cache, [21])[0])


def test_a_node_does_not_see_its_sibling(lean):
    """Changing node b's token leaves every node outside b's subtree scored exactly as before."""
    prefix, last = [5, 9, 17], 4
    tree = _tree(lean.embedding.shape[0])
    other = TreeProposal(tree.tokens.clone(), tree.parents)
    other.tokens[1] = (other.tokens[1] + 1) % lean.embedding.shape[0]
    a = _score_tree(lean, _prefilled(lean, prefix), last, tree)
    b = _score_tree(lean, _prefilled(lean, prefix), last, other)
    outside = [0, 1, 3, 4, 5]  # block rows of last, a, c, d, e (b is row 2, f row 6)
    assert torch.equal(a[outside], b[outside]) and not torch.equal(a[2], b[2])


def test_rows_mix_chains_and_trees_and_match_their_single_runs(lean):
    tree = _tree(lean.embedding.shape[0], seed=1)
    prefixes, last = ([5, 9, 17, 3], [1, 2, 3, 4, 5, 6, 7]), 30
    caches = [_prefilled(lean, p) for p in prefixes]
    start = caches[0].length
    mask = torch.cat([torch.ones(tree.n + 1, start, dtype=torch.bool), tree.attention_mask()], dim=1)
    logits, _ = lean.run_rows(caches, [[last] + tree.tokens.tolist(), [last, 8, 9]],
                              positions=[tree.positions(start), None], visible=[mask, None])
    want_tree = _score_tree(lean, _prefilled(lean, prefixes[0]), last, tree)
    want_chain, _ = lean.run(_prefilled(lean, prefixes[1]), [last, 8, 9])
    assert torch.equal(logits[:tree.n + 1], want_tree) and torch.equal(logits[tree.n + 1:], want_chain)


def test_a_wide_tree_runs_through_fused_attention_and_agrees_with_its_chain(lean):
    """Past SMALL_ATTENTION queries the masked run takes torch's fused attention: same values, other rounding."""
    V = lean.embedding.shape[0]
    gen = torch.Generator().manual_seed(2)
    parents = [-1] * 10 + [0, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # ten siblings, then a chain of ten under node 0
    tree = TreeProposal(torch.randint(0, V, (20,), generator=gen), parents)
    path = tree.path_to(19)
    cache = _prefilled(lean, [5, 9, 17])
    got = _score_tree(lean, cache, 4, tree)[tree.kept_block_indices(path)]
    want, _ = lean.run(_prefilled(lean, [5, 9, 17]), [4] + tree.tokens[path].tolist())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_masked_run_leaves_every_appended_entry_in_place(lean, monkeypatch):
    """Query by query the masked run writes a node's ancestors next to the prefix and puts back what it wrote:
    afterwards the cache holds each node's own keys and values, as torch's fused masked attention leaves them."""
    import specplug.lean_llama as lean_llama

    tree = _tree(lean.embedding.shape[0], seed=3)
    by_query = _prefilled(lean, [5, 9, 17, 3])
    _score_tree(lean, by_query, 4, tree)
    monkeypatch.setattr(lean_llama, "SMALL_ATTENTION", 0)  # every query through the fused masked call
    fused = _prefilled(lean, [5, 9, 17, 3])
    _score_tree(lean, fused, 4, tree)
    for a, b in zip(by_query.layers, fused.layers):
        torch.testing.assert_close(a.k[:, :a.length], b.k[:, :b.length], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.v[:, :a.length], b.v[:, :b.length], atol=1e-5, rtol=1e-5)


def test_keep_entries_refuses_indices_out_of_order(lean):
    cache = _prefilled(lean, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="ascend"):
        cache.keep_entries(1, [3, 2])
