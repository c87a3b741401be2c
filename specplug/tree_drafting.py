"""What the tree-drafting proposers share: the ``tree`` node-budget option and best-first tree building.

A proposer with ``tree=N`` (N > 0) may return a :class:`~specplug.verifier.TreeProposal` of at most N nodes and
depth at most k; ``tree=0`` keeps its chain. :func:`best_first` builds a tree of deterministic candidates: it
adds nodes in order of their path probability (the product of the candidates' probabilities root to node), so
a node always follows its parent and its higher-ranked siblings, and stops at the budget. Every node is a
deterministic function of the context, so the tree is a point-mass proposal (q=None), exact at any temperature.
"""
from __future__ import annotations

import heapq
from typing import Callable, Hashable, Iterable

import torch

from .types import ProposalError
from specplug.verifier import TreeProposal

# children(state) -> (token, probability given the parent, state of the child), in the order to try them
Children = Callable[[Hashable], Iterable[tuple[int, float, Hashable]]]


def tree_budget(tree: object, who: str) -> int:
    """The ``tree`` option checked: a node budget >= 0 (0: draft a chain)."""
    if isinstance(tree, bool) or not isinstance(tree, int) or tree < 0:
        raise ValueError(f"{who}: tree must be a node budget (an int >= 0; 0 drafts a chain), got {tree!r}")
    return tree


def best_first(children: Children, root, budget: int, max_depth: int, min_prob: float = 0.0
               ) -> tuple[list[int], list[int], list[float]]:
    """(tokens, parents, path probabilities) of the ``budget`` most probable nodes up to ``max_depth``, each at
    least ``min_prob``: topological order, siblings in the order ``children`` gives them (ties keep it)."""
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    heap: list = []
    order = 0  # ties: first pushed, first popped (siblings keep their order)

    def push(parent: int, depth: int, score: float, state) -> None:
        nonlocal order
        if depth >= max_depth:
            return
        for token, prob, child in children(state):
            if score * prob > 0 and score * prob >= min_prob:
                heapq.heappush(heap, (-score * prob, order, int(token), parent, depth + 1, child))
                order += 1

    push(-1, 0, 1.0, root)
    while heap and len(tokens) < budget:
        neg, _, token, parent, depth, state = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        scores.append(-neg)
        push(len(tokens) - 1, depth, -neg, state)
    return tokens, parents, scores


def point_mass_tree(tokens: list[int], parents: list[int], device) -> TreeProposal:
    """A tree of deterministic candidates (q=None) on ``device``."""
    if len(tokens) != len(parents):
        raise ProposalError(f"{len(tokens)} tree tokens but {len(parents)} parents")
    return TreeProposal(torch.tensor(tokens, dtype=torch.long, device=device),
                        torch.tensor(parents, dtype=torch.long, device=device))
