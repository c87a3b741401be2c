"""The engine's tree steps: what a step does differently when a proposer hands it a
:class:`~specplug.verifier.TreeProposal` instead of a chain, in small functions the engine calls.

A tree row is scored in the same target pass as chain rows (:mod:`specplug.rows`: positions by depth, each
node sees the prefix and its ancestors only), verified by the tree rule (greedy: the longest path of argmax
tokens; sampled: multi-candidate speculative sampling with uniforms from the row's own generator), and its
cache keeps ``[last, accepted path]`` afterwards, as a chain row keeps ``[last, accepted prefix]``.
"""
from __future__ import annotations

import torch

from specplug.verifier import (Proposal, ProposalError, TreeProposal, TreeVerdict, stack_trees, validate_tree,
                               verify_tree_batch)

__all__ = ["is_tree", "drafted", "tree_shape", "checked_tree", "kept_rows", "verify_sampled_trees"]


def is_tree(proposal: Proposal | TreeProposal | None) -> bool:
    return isinstance(proposal, TreeProposal)


def drafted(proposal: Proposal | TreeProposal) -> int:
    """Tokens (a chain's k) or nodes (a tree's n) the target scores after the last token."""
    return proposal.n if is_tree(proposal) else proposal.k


def tree_shape(proposal: Proposal | TreeProposal) -> tuple[int, int] | None:
    """(nodes, depth) of a tree, None for a chain: what a γ policy is told about the step."""
    if not is_tree(proposal):
        return None
    return proposal.n, int(proposal.depths().max()) if proposal.n else 0


def checked_tree(tree: TreeProposal, asked: int, vocab_size: int, device) -> TreeProposal:
    """``tree`` on ``device`` once it is known to be verifiable and no deeper than ``asked`` (a step may emit
    depth + 1 tokens, and the engine asked for at most asked + 1); raises ProposalError otherwise."""
    validate_tree(tree, vocab_size)
    deepest = int(tree.depths().max()) if tree.n else 0
    if deepest > asked:
        raise ProposalError(f"proposed a tree {deepest} deep when asked for at most {asked} tokens "
                            f"(a tree's depth plays the role of k; its node budget is the proposer's tree= option)")
    return tree.to(device)


def kept_rows(proposal: Proposal | TreeProposal, verdict) -> list[int]:
    """Rows of the scored block [last, drafted...] the cache keeps: the last token and what was accepted."""
    if is_tree(proposal):
        return proposal.kept_block_indices(verdict.path)
    return list(range(verdict.accepted + 1))


def verify_sampled_trees(p_target: torch.Tensor, trees: list[TreeProposal],
                         generators: list[torch.Generator]) -> list[TreeVerdict]:
    """The tree rule for B sampled rows at once: ``p_target`` [B, N+1, V] the processed target distributions at
    each row's [last, nodes] (zero-padded past a row's n + 1). Row b draws ``rand(1, n_b + 1)`` from its own
    generator (n_b for its nodes, one for the final token), the draw :func:`~specplug.verifier.verify_tree` makes
    for that row alone."""
    B, N1, V = p_target.shape
    device = p_target.device
    uniforms = torch.zeros(B, N1, dtype=torch.float32, device=device)
    for b, (tree, rng) in enumerate(zip(trees, generators)):
        u = torch.rand(1, tree.n + 1, generator=rng, device=device, dtype=torch.float32)[0]
        uniforms[b, : tree.n], uniforms[b, N1 - 1] = u[: tree.n], u[tree.n]
    stacked = stack_trees([_dense_or_one_hot(t, V, mixed=any(x.q is not None for x in trees)) for t in trees], V)
    out = verify_tree_batch(p_target, stacked["tokens"], stacked["parents"], stacked["q_draft"],
                            stacked["without_replacement"], stacked["num_nodes"], uniforms=uniforms)
    return [TreeVerdict(accepted=int(out.accepted[b]), proposed=t.n, tokens=out.row(b), path=out.path_row(b),
                        bonus=bool(out.bonus[b])) for b, t in enumerate(trees)]


def _dense_or_one_hot(tree: TreeProposal, V: int, mixed: bool) -> TreeProposal:
    """A point-mass tree among dense ones gets one-hot q rows (the verifier's point-mass rule, spelled out)."""
    if tree.q is not None or not mixed:
        return tree
    q = torch.nn.functional.one_hot(tree.tokens, V).float()
    return TreeProposal(tree.tokens, tree.parents, q, tree.without_replacement)
