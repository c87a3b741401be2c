"""A tree of draft tokens: what a multi-candidate proposer hands to the verifier, and the helpers the engine
needs to score it in one pass (positions by depth, the ancestors-only mask) and to keep the accepted path.

Chains stay :class:`~specplug.verifier.Proposal`; a tree is only for proposers that draft several candidates.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .proposal import DraftIds, Proposal, ProposalError, Verdict
from .rule import validate_draft_rows


@dataclass
class TreeProposal(DraftIds):
    """n draft nodes in topological order (parent before child), siblings in the order they are to be tried.

    tokens: [n] drafted ids. parents: [n] index of each node's parent node, -1 for a child of the root (the
    last emitted token). q: [n, V], row i the distribution node i was drawn from (siblings usually share one
    row; they may differ, e.g. candidates of several drafters), or None for point masses (a deterministic
    drafter, e.g. the top-k children of a head).
    without_replacement: [n] bool (or one bool for all): node i was drawn from q_i *renormalised over the
    tokens not taken by its earlier siblings* (successive sampling without replacement, e.g.
    ``torch.multinomial(q, m, replacement=False)``); False: drawn from q_i independently of its siblings.
    Exactness needs each node drawn from what it declares given its path and its earlier siblings, and from
    nothing else of the tree.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    q: torch.Tensor | None = None
    without_replacement: torch.Tensor | bool = False
    _depths: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1)
        self.parents = torch.as_tensor(self.parents, dtype=torch.long, device=self.tokens.device).reshape(-1)
        flag = torch.as_tensor(self.without_replacement, dtype=torch.bool, device=self.tokens.device)
        self.without_replacement = flag.expand(self.n).clone() if flag.dim() == 0 else flag.reshape(-1)

    @classmethod
    def chain(cls, proposal: Proposal) -> "TreeProposal":
        """The chain x1..xk as a tree (each node the only child of the previous one)."""
        parents = torch.arange(-1, proposal.k - 1, device=proposal.tokens.device)
        return cls(proposal.tokens, parents, proposal.q)

    @property
    def n(self) -> int:
        return int(self.tokens.numel())

    @property
    def is_point_mass(self) -> bool:
        return self.q is None

    def to(self, device: torch.device | str) -> "TreeProposal":
        return TreeProposal(self.tokens.to(device), self.parents.to(device),
                            None if self.q is None else self.q.to(device), self.without_replacement.to(device))

    def depths(self) -> torch.Tensor:
        """[n] depth of each node: 1 for the root's children. Node i's position is position(last) + depth."""
        if self._depths is None:
            self._depths = ancestors(self.parents).sum(-1)
        return self._depths

    def positions(self, last_position: int = 0) -> torch.Tensor:
        """[n+1] position ids of the scored block [last, node 0..n-1]: last_position, then last_position + depth."""
        zero = torch.zeros(1, dtype=torch.long, device=self.tokens.device)
        return last_position + torch.cat([zero, self.depths()])

    def attention_mask(self) -> torch.Tensor:
        """[n+1, n+1] bool over the scored block [last, nodes]: row r may attend to column c. The last token sees
        itself; node i sees the last token, its ancestors and itself, never a sibling or a cousin. (The engine
        prepends the committed prefix, visible to all.)"""
        n = self.n
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=self.tokens.device)
        mask[:, 0] = True
        mask[1:, 1:] = ancestors(self.parents)
        return mask

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (empty for node -1, the root)."""
        path, parents = [], self.parents.tolist()
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def kept_block_indices(self, path: list[int]) -> list[int]:
        """Indices into the scored block [last, nodes] to keep in the cache after a verdict with ``path``:
        the last token, then the accepted nodes in order (each a block row i + 1). Compact those K/V into place."""
        return [0] + [i + 1 for i in path]


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[n, n] bool: entry (i, j) is True iff node j is node i or one of its ancestors (a root-to-i path).

    Pointer jumping: one vectorised step per tree level.
    """
    n = parents.numel()
    idx = torch.arange(n, device=parents.device)
    seen = torch.eye(n, dtype=torch.bool, device=parents.device)
    up = parents.clone()
    while bool((up >= 0).any()):
        live = up >= 0
        seen[idx[live], up[live]] = True
        up = torch.where(live, parents[up.clamp(min=0)], up)
    return seen


def earlier_siblings(parents: torch.Tensor) -> torch.Tensor:
    """[n, n] bool: entry (i, j) is True iff node j is a sibling of node i tried before it (j < i, same parent)."""
    n = parents.numel()
    before = torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)
    return (parents[:, None] == parents[None, :]) & before


@dataclass
class TreeVerdict(Verdict):
    """A tree step's outcome: ``path`` the accepted nodes root to leaf (``accepted == len(path)``), ``tokens`` their
    tokens then one more (residual or bonus). ``proposed`` counts the nodes scored."""

    path: list[int] = field(default_factory=list)
    bonus: bool = False  # the last token came from p at an accepted leaf

    @property
    def all_accepted(self) -> bool:
        return self.bonus


def validate_tree(tree: TreeProposal, vocab_size: int) -> None:
    """Raise ProposalError unless ``tree`` can be scored and verified over ``vocab_size`` tokens."""
    n, tokens, parents = tree.n, tree.tokens, tree.parents
    if parents.shape != (n,) or tree.without_replacement.shape != (n,):
        raise ProposalError(f"a tree of {n} nodes needs {n} parents and {n} without_replacement flags, got "
                            f"{tuple(parents.shape)} and {tuple(tree.without_replacement.shape)}")
    idx = torch.arange(n, device=tokens.device)
    bad = (parents < -1) | (parents >= idx)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ProposalError(f"node {i} has parent {int(parents[i])}: a parent must be an earlier node or -1 (the "
                            f"root); nodes come in topological order")
    q = tree.q
    if q is not None and (q.dim() != 2 or q.shape[0] != n):
        raise ProposalError(f"q has shape {tuple(q.shape)} for {n} tree nodes; it must be [n, V] = [{n}, {vocab_size}]")
    validate_draft_rows(tokens.unsqueeze(0), None if q is None else q.unsqueeze(0),
                        torch.full((1,), n, device=tokens.device), torch.ones(1, n, dtype=torch.bool,
                                                                              device=tokens.device),
                        vocab_size, what="node")
    # a set drawn without replacement cannot repeat a token
    repeat = earlier_siblings(parents) & (tokens[:, None] == tokens[None, :]) & tree.without_replacement[:, None]
    if bool(repeat.any()):
        i, j = (int(v) for v in repeat.nonzero()[0])
        raise ProposalError(f"node {i} repeats token {int(tokens[i])} of its earlier sibling {j}, but is declared "
                            f"drawn without replacement")
