"""Multi-candidate speculative sampling over a draft tree (SpecInfer's multi-step speculative sampling, i.e.
recursive rejection sampling; the without-replacement variant as in Recursive Speculative Decoding).

One step, per row, starting at the root (the last emitted token) with r = p_target there:
  1. try the current node's children x_1, x_2, ... in order; q_j is the law child j was drawn from: its q row,
     renormalised over the tokens not taken by its earlier siblings when the set is drawn without replacement.
  2. accept x_j with probability min(1, r(x_j) / q_j(x_j)).
  3. after a rejection, r = norm(max(0, r - q_j)) before the next sibling.
  4. accepted: emit x_j, move to it with r = p_target at x_j, and repeat from 1 with its children.
  5. all children rejected: emit a sample from r; at an accepted leaf r is p_target there (the bonus).
A step emits 1..depth+1 tokens. Vectorised over rows; a Python loop over tree levels and sibling ranks.

Why exact (for either way of drawing): let R_j be the procedure "try siblings j, j+1, ..., else sample from the
residual". Claim: its first token has law r_j, whatever x_1..x_{j-1} were. Given the history, x_j ~ q_j and
r_{j+1} = norm(max(0, r_j - q_j)) depends on x_1..x_{j-1} only (through q_j), not on x_j. So
  P(y) = q_j(y) min(1, r_j(y)/q_j(y)) + (1 - sum_x min(r_j, q_j)(x)) r_{j+1}(y)
       = min(r_j, q_j)(y) + max(0, r_j - q_j)(y) = r_j(y),
using the claim for R_{j+1} and sum_x max(0, r_j - q_j) = 1 - sum_x min(r_j, q_j); with no sibling left R is a
sample from r_j. Hence the emitted token follows p_target at the node. An accepted child's subtree was drafted
given its path, independently of the coins, so by induction over depth every emitted token follows p given
the tokens before it. Without replacement, x_j's law *is* q renormalised over the untaken tokens, so that is
the q_j the step must use; verifying such siblings with q itself, or independent siblings (which may repeat a
token, q_j(x_j) = 0 after renormalising) as without replacement, breaks the first line and the output law.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .proposal import ProposalError
from .rule import acceptance_probability, residual_distribution, sample_from_weights
from .tree import TreeProposal, TreeVerdict, ancestors, validate_tree


def sibling_draft_distribution(q_rows: torch.Tensor, taken: torch.Tensor,
                               without_replacement: torch.Tensor) -> torch.Tensor:
    """Line 1: the law a sibling was drawn from, [B, V]: its q row, or that row renormalised over the tokens
    its earlier siblings did not take (``taken`` [B, V] bool) when it was drawn without replacement."""
    remaining = q_rows * ~taken
    remaining = remaining / remaining.sum(-1, keepdim=True).clamp(min=torch.finfo(q_rows.dtype).tiny)
    return torch.where(without_replacement.unsqueeze(-1), remaining, q_rows)


def next_residual(residual: torch.Tensor, q_sibling: torch.Tensor) -> torch.Tensor:
    """Line 3: norm(max(0, r - q_j)), the distribution the next sibling (or the final sample) is measured against."""
    weights = residual_distribution(residual, q_sibling)
    return weights / weights.sum(-1, keepdim=True)


@dataclass
class TreeBatchVerdict:
    """Per-row outcome of :func:`verify_tree_batch`; ``path`` [B, D] accepted node indices and ``tokens`` [B, D+1]
    are padded with -1 beyond ``accepted`` / ``num_emitted``; ``bonus`` [B]: the last token is a bonus sample."""

    accepted: torch.Tensor
    path: torch.Tensor
    tokens: torch.Tensor
    num_emitted: torch.Tensor
    bonus: torch.Tensor

    def row(self, b: int) -> list[int]:
        return self.tokens[b, : int(self.num_emitted[b])].tolist()

    def path_row(self, b: int) -> list[int]:
        return self.path[b, : int(self.accepted[b])].tolist()


def stack_trees(trees: list[TreeProposal], vocab_size: int) -> dict[str, torch.Tensor | None]:
    """Pad B trees to one node count N for :func:`verify_tree_batch` (tokens, parents, q_draft,
    without_replacement, num_nodes). Point-mass and dense trees may not be mixed: pass one-hot q rows instead."""
    N = max([t.n for t in trees] + [0])
    device = trees[0].tokens.device if trees else torch.device("cpu")
    B = len(trees)
    tokens = torch.zeros(B, N, dtype=torch.long, device=device)
    parents = torch.full((B, N), -1, dtype=torch.long, device=device)
    flags = torch.zeros(B, N, dtype=torch.bool, device=device)
    dense = [t.q is not None for t in trees]
    if any(dense) and not all(dense):
        raise ProposalError("stack_trees: mix of point-mass and dense trees; give the point-mass ones one-hot q rows")
    q = torch.zeros(B, N, vocab_size, device=device) if any(dense) else None
    for b, t in enumerate(trees):
        tokens[b, : t.n], parents[b, : t.n], flags[b, : t.n] = t.tokens, t.parents, t.without_replacement
        if q is not None:
            q[b, : t.n] = t.q
    num_nodes = torch.tensor([t.n for t in trees], dtype=torch.long, device=device)
    return {"tokens": tokens, "parents": parents, "q_draft": q, "without_replacement": flags, "num_nodes": num_nodes}


def verify_tree_batch(p_target: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                      q_draft: torch.Tensor | None, without_replacement: torch.Tensor | None = None,
                      num_nodes: torch.Tensor | None = None, generator: torch.Generator | None = None, *,
                      uniforms: torch.Tensor | None = None) -> TreeBatchVerdict:
    """Apply the tree rule to B padded trees (validate each with :func:`validate_tree` first; see :func:`stack_trees`).

    p_target: [B, N+1, V] processed target distributions at [last, node 0..N-1] (the tree scored in one pass).
    tokens, parents: [B, N]; q_draft: [B, N, V] or None (point masses); without_replacement: [B, N] bool.
    num_nodes: [B] nodes per row (the rest is padding). uniforms: [B, N+1] U[0,1): column i tests node i,
    column N draws the final token; from ``generator`` when omitted.
    """
    B, N1, V = p_target.shape
    N = N1 - 1
    if tokens.shape != (B, N) or parents.shape != (B, N):
        raise ProposalError(f"p_target {tuple(p_target.shape)} needs tokens and parents of shape [B, N] = [{B}, {N}], "
                            f"got {tuple(tokens.shape)} and {tuple(parents.shape)}")
    device = p_target.device
    rows = torch.arange(B, device=device)
    num_nodes = torch.full((B,), N, device=device) if num_nodes is None else num_nodes.to(device)
    without_replacement = (torch.zeros(B, N, dtype=torch.bool, device=device) if without_replacement is None
                           else without_replacement.to(device))
    if uniforms is None:
        uniforms = torch.rand(B, N1, generator=generator, device=device, dtype=p_target.dtype)
    children, depth = _children_table(parents.to(device), num_nodes)

    node = torch.full((B,), -1, dtype=torch.long, device=device)  # -1: the root
    residual = p_target[:, 0]
    path = torch.full((B, depth), -1, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for level in range(depth + 1):
        if bool(done.all()):  # every row has stopped: the deeper levels cannot change anything
            break
        kids = torch.where(done.unsqueeze(-1), -1, children[rows, node + 1])  # [B, C] in order of trial
        chosen, residual = _try_children(residual, kids, tokens, q_draft, without_replacement, uniforms)
        moving = chosen >= 0  # 4.
        if level < depth:
            path[:, level] = chosen
        node = torch.where(moving, chosen, node)
        residual = torch.where(moving.unsqueeze(-1), p_target[rows, chosen + 1], residual)
        done = done | ~moving
    final = sample_from_weights(residual, uniforms[:, N])  # 5.
    accepted = (path >= 0).sum(-1)
    bonus = (children[rows, node + 1] < 0).all(-1) if children.shape[-1] else torch.ones(B, dtype=torch.bool,
                                                                                           device=device)
    emitted = torch.where(path >= 0, tokens.gather(1, path.clamp(min=0)) if N else path, -1)
    out = torch.cat([emitted, torch.full((B, 1), -1, dtype=torch.long, device=device)], dim=1)
    out[rows, accepted] = final
    return TreeBatchVerdict(accepted=accepted, path=path, tokens=out, num_emitted=accepted + 1, bonus=bonus)


def verify_tree(p_target: torch.Tensor, tree: TreeProposal, generator: torch.Generator | None = None, *,
                uniforms: torch.Tensor | None = None, validate: bool = True) -> TreeVerdict:
    """Verify one tree against ``p_target`` [n+1, V] (rows: the last token, then node 0..n-1)."""
    if p_target.dim() != 2 or p_target.shape[0] != tree.n + 1:
        raise ProposalError(f"p_target must have shape [n+1, V] = [{tree.n + 1}, V] for a tree of {tree.n} nodes, "
                            f"got {tuple(p_target.shape)}")
    if validate:
        validate_tree(tree, p_target.shape[-1])
    out = verify_tree_batch(p_target.unsqueeze(0), tree.tokens.unsqueeze(0), tree.parents.unsqueeze(0),
                            None if tree.q is None else tree.q.unsqueeze(0), tree.without_replacement.unsqueeze(0),
                            None, generator, uniforms=None if uniforms is None else uniforms.unsqueeze(0))
    return TreeVerdict(accepted=int(out.accepted[0]), proposed=tree.n, tokens=out.row(0), path=out.path_row(0),
                       bonus=bool(out.bonus[0]))


def verify_tree_greedy(target_argmax: torch.Tensor | list[int], tree: TreeProposal) -> TreeVerdict:
    """Temperature 0: the longest root-to-node path whose every token is the target's argmax at its parent,
    then the argmax at its end. ``target_argmax`` [n+1]: argmax at the last token, then at each node.

    Ties between equally deep paths (repeated siblings) go to the earliest node. Deterministic, no uniforms.
    """
    best = torch.as_tensor(target_argmax, dtype=torch.long, device=tree.tokens.device).reshape(-1)
    if best.numel() != tree.n + 1:
        raise ProposalError(f"need the argmax of n+1 = {tree.n + 1} target rows, got {best.numel()}")
    match = tree.tokens == best[tree.parents + 1]  # node i is the argmax after its parent
    on_path = ~(ancestors(tree.parents) & ~match.unsqueeze(0)).any(-1)  # ... and so is every ancestor
    depth = torch.where(on_path, tree.depths(), 0)
    end = int(depth.argmax()) if tree.n and int(depth.max()) > 0 else -1
    path = tree.path_to(end)
    leaf = not bool((tree.parents == end).any())  # the root is a leaf of an empty tree
    return TreeVerdict(accepted=len(path), proposed=tree.n, tokens=tree.tokens[path].tolist() + [int(best[end + 1])],
                       path=path, bonus=leaf)


def _try_children(residual: torch.Tensor, kids: torch.Tensor, tokens: torch.Tensor, q_draft: torch.Tensor | None,
                  without_replacement: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lines 1-3 at one node per row: the accepted child (-1 if none) and the residual left after the rejections."""
    B, V = residual.shape
    rows = torch.arange(B, device=residual.device)
    chosen = torch.full((B,), -1, dtype=torch.long, device=residual.device)
    taken = torch.zeros(B, V, dtype=torch.bool, device=residual.device)  # tokens of the siblings tried so far
    for s in range(kids.shape[1]):
        trying = (kids[:, s] >= 0) & (chosen < 0)
        if not bool(trying.any()):  # children are packed in rank order: no row has a sibling left to try
            break
        child = kids[:, s].clamp(min=0)
        x = tokens[rows, child]
        x_hot = torch.nn.functional.one_hot(x, V)
        q_rows = x_hot.to(residual.dtype) if q_draft is None else q_draft[rows, child].to(residual.dtype)
        q_sibling = sibling_draft_distribution(q_rows, taken, without_replacement[rows, child])  # 1.
        ratio = acceptance_probability(residual.gather(-1, x[:, None]).squeeze(-1),
                                       q_sibling.gather(-1, x[:, None]).squeeze(-1))
        accept = trying & (uniforms[rows, child] < ratio)  # 2.
        chosen = torch.where(accept, child, chosen)
        rejected = trying & ~accept
        residual = torch.where(rejected.unsqueeze(-1), next_residual(residual, q_sibling), residual)  # 3.
        taken = taken | (x_hot.bool() & trying.unsqueeze(-1))
    return chosen, residual


def _children_table(parents: torch.Tensor, num_nodes: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[B, N+1, C] children of the root (slot 0) and of node i (slot i+1) in order of trial, -1 padded; and the
    deepest level."""
    B, N = parents.shape
    device = parents.device
    valid = torch.arange(N, device=device).unsqueeze(0) < num_nodes.unsqueeze(1)
    slot = torch.where(valid, parents + 1, -1)  # padding joins no sibling set
    same = (slot.unsqueeze(2) == slot.unsqueeze(1)) & valid.unsqueeze(1)
    rank = (same & torch.ones(N, N, dtype=torch.bool, device=device).tril(-1)).sum(-1)  # earlier siblings
    C = int(rank[valid].max()) + 1 if bool(valid.any()) else 0
    children = torch.full((B, N + 1, C), -1, dtype=torch.long, device=device)
    b, i = valid.nonzero(as_tuple=True)
    children[b, slot[b, i], rank[b, i]] = i
    depth = torch.where(valid, 1, 0)
    up = torch.where(valid, parents, -1)
    while bool((up >= 0).any()):  # pointer jumping: one step per level
        depth = depth + (up >= 0).long()
        up = torch.where(up >= 0, parents.gather(1, up.clamp(min=0)), up)
    return children, int(depth.max()) if N else 0
