"""What the tree-drafting proposers share: the ``tree`` node-budget option, best-first trees of fixed
candidates, and dynamic trees grown from a drafter run level by level.

A proposer with ``tree=N`` (N > 0) may return a :class:`~specplug.verifier.TreeProposal` of at most N nodes and
depth at most k; ``tree=0`` keeps its chain. A γ policy may lower the budget per step (:func:`node_budget`; 0: the
chain). :func:`best_first` builds a tree of deterministic candidates: it
adds the chain of first choices, then nodes in order of their path probability (the product of the
candidates' probabilities root to node), so a node always follows its parent and its higher-ranked siblings,
and stops at the budget. Every node is a
deterministic function of the context, so the tree is a point-mass proposal (q=None), exact at any temperature.
:func:`grow_tree` grows an EAGLE-2-style tree from a drafter that conditions on the path (a head, a draft
model), through a masked run per level whose mask :func:`visible_rows` builds.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable

import torch

from specplug.verifier import ProposalError, TreeProposal

from .drafting_vocab import full_q
from .sampling import SamplingParams, processed_probs
from .types import NODE_BUDGET

# children(state) -> (token, probability given the parent, state of the child), in the order to try them
Children = Callable[[Hashable], Iterable[tuple[int, float, Hashable]]]


def tree_budget(tree: object, who: str) -> int:
    """The ``tree`` option checked: a node budget >= 0 (0: draft a chain); a wrong type is a TypeError, as the
    registry raises for it."""
    if isinstance(tree, bool) or not isinstance(tree, int) or tree < 0:
        error = ValueError if isinstance(tree, int) and not isinstance(tree, bool) else TypeError
        raise error(f"{who}: tree must be a node budget (an int >= 0; 0 drafts a chain), got {tree!r}")
    return tree


def node_budget(tree: int, seq) -> int:
    """The node budget this step: the γ policy's choice (``seq.scratch[NODE_BUDGET]``) within the proposer's own
    ``tree`` option, which is the most it drafts."""
    chosen = seq.scratch.get(NODE_BUDGET)
    return tree if chosen is None else max(0, min(tree, int(chosen)))


def tree_width_checked(width: object, who: str) -> int:
    """The ``tree_width`` option checked: children per expanded node, an int >= 1."""
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"{who}: tree_width must be an int >= 1 (children per expanded node), got {width!r}")
    return width


def best_first(children: Children, root, budget: int, max_depth: int, min_prob: float = 0.0
               ) -> tuple[list[int], list[int], list[float]]:
    """(tokens, parents, path probabilities) of the ``budget`` most probable nodes up to ``max_depth``, each at
    least ``min_prob``, after the spine (the first child of the root, of that child, ...: the chain the
    candidates' first choices make, so a tree accepts at least what that chain would): topological order,
    siblings in the order ``children`` gives them (ties keep it)."""
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    heap: list = []
    order = 0  # ties: first pushed, first popped (siblings keep their order)

    def push(parent: int, depth: int, score: float, state, spine: bool) -> None:
        nonlocal order
        if depth >= max_depth:
            return
        for rank, (token, prob, child) in enumerate(children(state)):
            if score * prob > 0 and score * prob >= min_prob:
                first = spine and rank == 0
                heapq.heappush(heap, (not first, -score * prob, order, int(token), parent, depth + 1, child))
                order += 1

    push(-1, 0, 1.0, root, True)
    while heap and len(tokens) < budget:
        later, neg, _, token, parent, depth, state = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        scores.append(-neg)
        push(len(tokens) - 1, depth, -neg, state, not later)
    return tokens, parents, scores


def point_mass_tree(tokens: list[int], parents: list[int], device) -> TreeProposal:
    """A tree of deterministic candidates (q=None) on ``device``."""
    if len(tokens) != len(parents):
        raise ProposalError(f"{len(tokens)} tree tokens but {len(parents)} parents")
    return TreeProposal(torch.tensor(tokens, dtype=torch.long, device=device),
                        torch.tensor(parents, dtype=torch.long, device=device))


# run_level(tree, nodes) -> the drafter's logits [len(nodes), S] for the children of ``nodes`` (indices into tree)
RunLevel = Callable[["GrowingTree", list[int]], torch.Tensor]


@dataclass
class GrowingTree:
    """The nodes drafted so far, in drafting order: tokens, parents (-1: the root), depths (1: the root's
    children), cumulative draft probabilities and, when sampled, the q row each was drawn from."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    q_rows: list[torch.Tensor] = field(default_factory=list)
    spine: set[int] = field(default_factory=set)  # the first child of the root, of that child, ...: the chain

    def rank(self, node: int) -> tuple:
        """Sort key, best first: the spine (greedy: the chain the drafter would draft), then by cumulative
        probability, then first drafted (a node always ranks below its parent)."""
        return node not in self.spine, -self.scores[node], node

    @property
    def n(self) -> int:
        return len(self.tokens)

    def ancestors(self, node: int) -> list[int]:
        """``node`` and its ancestors, nearest first."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out


def grow_tree(root_logits: torch.Tensor, run_level: RunLevel, sampling: SamplingParams, rng: torch.Generator, *,
              budget: int, max_depth: int, width: int, subset: torch.Tensor | None,
              vocab_size: int) -> tuple[TreeProposal, list[int]]:
    """An EAGLE-2-style dynamic tree from a drafter's logits over S drafting tokens (``subset``: their ids;
    None: all V): level by level, the ``width`` nodes of highest cumulative draft probability are expanded,
    each with ``width`` children.

    Greedy: the children are the drafter's top tokens (point masses), the tree is grown to full depth and then
    reranked: the chain the drafter would draft (its spine: first children) and then the nodes of highest
    cumulative probability stay, ``budget`` in all (a node's parent always ranks above it). The spine first,
    because a head's probabilities are no calibrated ranking: with it, a tree accepts at least what its chain
    would. Sampling: the children are drawn from the drafter's q without replacement (``torch.multinomial``),
    q reported; nothing drawn is ever dropped, since a set pruned by the values drawn is no longer a draw from
    q (exactness needs it): each sibling set's size is fixed before it is drawn (see :func:`_rooms`).

    Returns the tree and, for each of its nodes, its index in the :class:`GrowingTree` ``run_level`` saw."""
    greedy = sampling.greedy
    tree = GrowingTree()
    frontier, logits = [-1], root_logits.reshape(1, -1)
    for depth in range(1, max_depth + 1):
        probs = torch.softmax(logits.float(), -1) if greedy else processed_probs(logits, sampling)
        drawn = []
        for row, (parent, room) in enumerate(zip(frontier, _rooms(len(frontier), width, greedy, budget - tree.n,
                                                                  max_depth - depth + 1))):
            drawn += _children(tree, probs[row], parent, depth, room, greedy, rng, subset, vocab_size)
        if depth == max_depth or not drawn or (not greedy and tree.n >= budget):
            break
        frontier = sorted(drawn, key=tree.rank)[:width]
        logits = run_level(tree, frontier)
    keep = range(tree.n) if not greedy else sorted(sorted(range(tree.n), key=tree.rank)[:budget])
    index = {old: new for new, old in enumerate(keep)}
    device = root_logits.device
    proposal = TreeProposal(torch.tensor([tree.tokens[i] for i in keep], dtype=torch.long, device=device),
                            torch.tensor([index.get(tree.parents[i], -1) for i in keep], dtype=torch.long,
                                         device=device),
                            None if greedy else torch.stack([tree.q_rows[i] for i in keep]),
                            without_replacement=not greedy)
    return proposal, list(keep)


def _rooms(frontier: int, width: int, greedy: bool, left: int, levels: int) -> list[int]:
    """How many children each frontier node (best first) gets: ``width`` each when greedy (the rerank prunes);
    when sampling, this level's share of the budget left (an equal part per level still to come), spread over
    the frontier, at most ``width`` each."""
    if greedy:
        return [width] * frontier
    share = min(frontier * width, -(-left // levels))
    return [min(width, share // frontier + (j < share % frontier)) for j in range(frontier)]


def _children(tree: GrowingTree, probs: torch.Tensor, parent: int, depth: int, room: int, greedy: bool,
              rng: torch.Generator, subset: torch.Tensor | None, vocab_size: int) -> list[int]:
    """Add up to ``room`` children of ``parent`` from the drafter's distribution ``probs`` [S]: its top tokens
    (greedy), or a draw from it without replacement; return their indices."""
    room = min(room, int((probs > 0).sum()))
    if room <= 0:
        return []
    if greedy:
        picked = probs.topk(room).indices
    else:
        picked = torch.multinomial(probs, room, replacement=False, generator=rng)
    q_row = None if greedy else full_q(probs, subset, vocab_size)
    ids = picked if subset is None else subset[picked]
    base = 1.0 if parent < 0 else tree.scores[parent]
    if parent < 0 or parent in tree.spine:
        tree.spine.add(tree.n)
    added = []
    for token, p in zip(ids.tolist(), probs[picked].tolist()):
        added.append(tree.n)
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.scores.append(base * p)
        if q_row is not None:
            tree.q_rows.append(q_row)
    return added


def visible_rows(tree: GrowingTree, nodes: list[int], entry: dict[int, int], prefix: int, length: int) -> torch.Tensor:
    """The attention mask [len(nodes), length + len(nodes)] of a masked run appending ``nodes`` to a drafter's
    cache of ``length`` entries: each sees the ``prefix`` entries of the verified sequence, the entries of its
    ancestors (``entry``: node -> cache index, of the nodes run so far) and itself, never a sibling or cousin.
    Records the new nodes' entries in ``entry``."""
    for j, node in enumerate(nodes):
        entry[node] = length + j
    mask = torch.zeros(len(nodes), length + len(nodes), dtype=torch.bool)
    mask[:, :prefix] = True
    for j, node in enumerate(nodes):
        mask[j, [entry[a] for a in tree.ancestors(node) if a in entry]] = True
    return mask
