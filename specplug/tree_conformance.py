"""Is a tree-drafting proposer honest about q? A check that needs no verifier and no target.

Each node must be drawn from the law it declares given everything drafted before it (its path and its earlier
siblings): its q row, renormalised over the tokens its earlier siblings took when the set is drawn without
replacement. Then the randomised probability integral transform of each node, in drafting order,

    u = F(x-) + v * law(x),  F the law's CDF over token ids, v ~ U(0, 1) independent,

is U(0, 1) given the past, so the u's of all nodes are i.i.d. uniform (Rosenblatt). A drafter that takes the
argmax but reports a soft q, drops repeated siblings but declares them independent, or draws without
replacement and declares independent draws, moves u away from uniform at the nodes concerned. Nodes are grouped
by branch (depth, rank among siblings) and each group is tested against uniform; the verdict is the smallest
p-value, Bonferroni-corrected over groups. Point masses are honest by definition (u is uniform).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from specplug.verifier import TreeProposal, earlier_siblings, validate_tree

HONESTY_ALPHA = 1e-3
# The PIT's uniforms must not replay a drafter's stream (a drafter seeded 0 would correlate with v).
PIT_SEED_BASE = 0x5EED_F00D


@dataclass
class TreeHonesty:
    """``passed`` unless some branch's u values are not uniform (p-value < alpha after correction).

    ``by_branch`` maps (depth, rank among siblings) to its p-value; (-1, -1) pools the branches too rare to test
    alone."""

    passed: bool
    p_value: float
    by_branch: dict[tuple[int, int], float] = field(default_factory=dict)
    nodes: int = 0

    @property
    def evidence(self) -> str:
        worst = min(self.by_branch, key=self.by_branch.get) if self.by_branch else None
        where = f"; worst branch depth {worst[0]} sibling {worst[1]} (p = {self.by_branch[worst]:.3g})" if worst else ""
        return f"{self.nodes} nodes, corrected p = {self.p_value:.3g}{where}"


def declared_laws(tree: TreeProposal) -> torch.Tensor:
    """[n, V] the law each node declares given its earlier siblings (renormalised where drawn without replacement)."""
    q = tree.q.double()
    drafted = torch.nn.functional.one_hot(tree.tokens, q.shape[-1]).double()
    taken = (earlier_siblings(tree.parents).double() @ drafted) > 0  # tokens of each node's earlier siblings
    remaining = q * ~taken
    remaining = remaining / remaining.sum(-1, keepdim=True)
    return torch.where(tree.without_replacement.unsqueeze(-1), remaining, q)


def pit_values(tree: TreeProposal, generator: torch.Generator) -> torch.Tensor:
    """[n] randomised PIT of every node under its declared law (uniform for point masses)."""
    v = torch.rand(tree.n, generator=generator, dtype=torch.float64)
    if tree.q is None:
        return v
    law = declared_laws(tree)
    below = (law.cumsum(-1) - law).gather(-1, tree.tokens[:, None]).squeeze(-1)
    return below + v * law.gather(-1, tree.tokens[:, None]).squeeze(-1)


def uniformity_pvalue(u: torch.Tensor, bins: int) -> float:
    """Pearson chi-square p-value of ``u`` against U(0, 1) on ``bins`` equal bins."""
    counts = torch.bincount((u * bins).long().clamp(0, bins - 1), minlength=bins).double()
    expected = u.numel() / bins
    stat = float(((counts - expected) ** 2 / expected).sum())
    return float(torch.special.gammaincc(torch.tensor((bins - 1) / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def check_tree_q_honesty(draw_tree: Callable[[], TreeProposal], vocab_size: int, *, samples: int = 500, seed: int = 0,
                         bins: int = 10, alpha: float = HONESTY_ALPHA) -> TreeHonesty:
    """Draw ``samples`` trees with ``draw_tree()`` (same context each time, or not: only conditional honesty is
    tested) and test every branch's PIT values for uniformity. Branches with fewer than 5 values per bin are
    pooled into one group. Each tree is validated first (a ProposalError names the bad node)."""
    generator = torch.Generator().manual_seed(PIT_SEED_BASE + seed)  # a stream apart from the drafter's own seeds
    groups: dict[tuple[int, int], list[torch.Tensor]] = {}
    nodes = 0
    for _ in range(samples):
        tree = draw_tree().to("cpu")
        validate_tree(tree, vocab_size)
        if tree.n == 0:
            continue
        u = pit_values(tree, generator)
        ranks = earlier_siblings(tree.parents).sum(-1)
        for i, (depth, rank) in enumerate(zip(tree.depths().tolist(), ranks.tolist())):
            groups.setdefault((depth, rank), []).append(u[i : i + 1])
        nodes += tree.n
    pooled, by_branch = [], {}
    for key, values in groups.items():
        values = torch.cat(values)
        if values.numel() >= 5 * bins:
            by_branch[key] = uniformity_pvalue(values, bins)
        else:
            pooled.append(values)
    if pooled and sum(v.numel() for v in pooled) >= 5 * bins:
        by_branch[(-1, -1)] = uniformity_pvalue(torch.cat(pooled), bins)
    corrected = min([1.0] + [p * len(by_branch) for p in by_branch.values()])
    return TreeHonesty(passed=corrected >= alpha, p_value=corrected, by_branch=by_branch, nodes=nodes)
