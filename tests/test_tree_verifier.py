"""The tree rule on hand-made distributions: exactness with power, and the mutants the harness must reject.

The toy target: p(next | context) = TABLE[sum of w(token) over the context mod S, position parity], w(t) = t + 1.
So a node's distribution depends on *which* tokens it sees and on its position: the harness scores each tree
through the TreeProposal's own attention mask and positions, as the engine will, and a mask that shows a node
its sibling, or positions not by depth, change p. Seeds are fixed, so every verdict is deterministic; honest
rules land far above EXACTNESS_ALPHA, the mutants far below.
"""
import itertools
import sys

import pytest
import torch

import specplug.verifier.tree_rule as tree_rule
from specplug.testing import EXACTNESS_ALPHA, chi_square_pvalue
from specplug.verifier import (Proposal, ProposalError, TreeProposal, ancestors, stack_trees, verify,
                               verify_tree, verify_tree_batch, verify_tree_greedy)

V, S = 5, 7
M = 3  # emitted tokens compared with plain sampling
N_SAMPLES = 60_000
_g = torch.Generator().manual_seed(2026)
TABLE = torch.softmax(1.5 * torch.randn(S, 2, V, generator=_g, dtype=torch.float64), -1)
DRAFT = torch.softmax(torch.log(TABLE) + 1.2 * torch.randn(S, 2, V, generator=_g, dtype=torch.float64), -1)
PREFIX_SUM, LAST, LAST_POS = 3, 2, 5  # the committed context: its weight sum (without LAST), last token, position

SHAPES = {"3x2": [3, 2], "2x2x2": [2, 2, 2], "3x1x2": [3, 1, 2]}


def weight(tokens):
    return tokens + 1


def exact_target(m=M):
    """P(y1..ym) under plain sampling from the toy target after the committed context."""
    dist = {}
    for ys in itertools.product(range(V), repeat=m):
        s, pos, prob = PREFIX_SUM + LAST + 1, LAST_POS, 1.0
        for y in ys:
            prob *= float(TABLE[s % S, pos % 2, y])
            s, pos = s + y + 1, pos + 1
        dist[ys] = prob
    return dist


def tree_structure(shape):
    """parents [N] of a tree with shape[l] children under every node of level l, breadth first."""
    parents, level = [], [-1]
    for m in shape:
        nxt = []
        for parent in level:
            for _ in range(m):
                nxt.append(len(parents))
                parents.append(parent)
        level = nxt
    return torch.tensor(parents)


def draft_trees(shape, n, kind, gen):
    """n honest trees: every sibling set drawn from the draft at its parent's (true) context.

    kind: "independent" (with replacement), "without" (successive sampling without replacement), "mixed" (the
    root's children without replacement, deeper sets independent) or "top" (the deterministic top-m tokens of
    the draft: point masses).
    """
    parents = tree_structure(shape)
    N = parents.numel()
    tokens = torch.zeros(n, N, dtype=torch.long)
    q = torch.zeros(n, N, V, dtype=torch.float64)
    ctx = torch.zeros(n, N + 1, dtype=torch.long)  # weight sum of each block row's context, row 0 the last token
    ctx[:, 0] = PREFIX_SUM + LAST + 1
    depth = torch.cat([torch.zeros(1, dtype=torch.long), ancestors(parents).sum(-1)])
    flags = torch.zeros(n, N, dtype=torch.bool)
    i, level = 0, [-1]
    for depth_m, m in enumerate(shape):
        without = kind == "without" or (kind == "mixed" and depth_m == 0)
        below = []
        for parent in level:
            rows = DRAFT[ctx[:, parent + 1] % S, (LAST_POS + depth[parent + 1]) % 2]
            if kind == "top":
                drawn = rows.topk(m, -1).indices
            else:
                drawn = torch.multinomial(rows, m, replacement=not without, generator=gen)
            tokens[:, i:i + m], flags[:, i:i + m] = drawn, without
            q[:, i:i + m] = rows.unsqueeze(1)
            ctx[:, i + 1:i + m + 1] = ctx[:, parent + 1].unsqueeze(1) + weight(drawn)
            below += range(i, i + m)
            i += m
        level = below
    return tokens, parents, (None if kind == "top" else q), flags


def score(tokens, parents):
    """The toy target's p at [last, nodes], read through the tree's own mask and positions."""
    tree = TreeProposal(tokens[0], parents)
    mask, positions = tree.attention_mask(), tree.positions(LAST_POS)
    block = torch.cat([torch.full((tokens.shape[0], 1), LAST), tokens], dim=1)
    seen = PREFIX_SUM + weight(block).double() @ mask.double().T  # [n, N+1] weight sum each row sees
    return TABLE[seen.long() % S, positions % 2]


def continue_plainly(emitted, num_emitted, gen, m=M):
    """The first m tokens of (step output, then plain sampling from the target): one code per row."""
    n = emitted.shape[0]
    s = torch.full((n,), PREFIX_SUM + LAST + 1)
    code = torch.zeros(n, dtype=torch.long)
    for t in range(m):
        fresh = torch.multinomial(TABLE[s % S, (LAST_POS + t) % 2], 1, generator=gen).squeeze(1)
        y = torch.where(t < num_emitted, emitted[:, min(t, emitted.shape[1] - 1)], fresh)
        code = code * V + y
        s = s + y + 1
    return code


def pvalue(shape, kind, n=N_SAMPLES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens, parents, q, flags = draft_trees(shape, n, kind, gen)
    out = verify_tree_batch(score(tokens, parents), tokens, parents.expand(n, -1), q, flags, generator=gen)
    codes = continue_plainly(out.tokens, out.num_emitted, gen)
    counts = dict(zip(*(c.tolist() for c in torch.unique(codes, return_counts=True))))
    expected = {sum(y * V ** (M - 1 - t) for t, y in enumerate(ys)): prob for ys, prob in exact_target().items()}
    return chi_square_pvalue(counts, expected)


# --- exactness --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["independent", "without", "top"])
def test_tree_output_follows_the_target_for_every_way_of_drawing_siblings(shape, kind):
    assert pvalue(SHAPES[shape], kind) > EXACTNESS_ALPHA


@pytest.fixture
def truncated_target(monkeypatch):
    """p as after top-k = 3 (zeros where the draft still has mass), q as after top-k = 4."""
    def top(table, k):
        kept = table * (table >= table.topk(k, -1).values[..., -1:])
        return kept / kept.sum(-1, keepdim=True)
    monkeypatch.setattr(sys.modules[__name__], "TABLE", top(TABLE, 3))
    monkeypatch.setattr(sys.modules[__name__], "DRAFT", top(DRAFT, 4))


@pytest.mark.parametrize("kind", ["independent", "without", "mixed", "top"])
def test_tree_output_follows_a_truncated_target(kind, truncated_target):
    assert pvalue(SHAPES["3x2"], kind) > EXACTNESS_ALPHA


def test_tree_with_mixed_sibling_sets_follows_the_target():
    assert pvalue(SHAPES["2x2x2"], "mixed") > EXACTNESS_ALPHA


def test_chain_as_a_tree_gives_the_chain_rule_verdict():
    g = torch.Generator().manual_seed(4)
    for k in range(5):
        p = torch.softmax(torch.randn(k + 1, V, generator=g), -1)
        q = torch.softmax(torch.randn(k, V, generator=g), -1)
        drafts = torch.multinomial(q, 1, generator=g).reshape(-1) if k else torch.empty(0, dtype=torch.long)
        for proposal in (Proposal(drafts, q), Proposal.point_mass(drafts)):
            for _ in range(20):
                u = torch.rand(k + 1, generator=g)
                chain = verify(p, proposal, uniforms=u)
                tree = verify_tree(p, TreeProposal.chain(proposal), uniforms=u)
                want = (chain.accepted, chain.tokens, list(range(chain.accepted)))
                assert (tree.accepted, tree.tokens, tree.path) == want


def test_rejected_point_mass_siblings_are_never_the_residual_sample():
    p = torch.tensor([[0.3, 0.3, 0.2, 0.1, 0.1], [0.2] * 5, [0.2] * 5])
    tree = TreeProposal(torch.tensor([0, 1]), torch.tensor([-1, -1]))
    seen = set()
    for u in torch.linspace(0, 0.999, 40):
        verdict = verify_tree(p, tree, uniforms=torch.tensor([0.999, 0.999, float(u)]))
        assert verdict.accepted == 0
        seen.add(verdict.tokens[0])
    assert seen == {2, 3, 4}  # p without the two rejected tokens


def test_second_sibling_is_measured_against_the_residual_of_the_first():
    p = torch.tensor([[0.4, 0.4, 0.2, 0.0, 0.0], [0.2] * 5, [0.2] * 5])
    q = torch.tensor([[0.8, 0.2, 0.0, 0.0, 0.0]] * 2)  # drawn independently: token 0 twice
    tree = TreeProposal(torch.tensor([0, 0]), torch.tensor([-1, -1]), q)
    for u in torch.linspace(0, 0.999, 40):
        # x1 = 0 rejected (0.9 >= 0.4/0.8): r = norm(max(0, p - q)) = [0, .5, .5] has no mass at 0, so x2 = 0 fails
        # even with a tiny uniform (against p it would pass); the final sample is from norm(max(0, r - q))
        verdict = verify_tree(p, tree, uniforms=torch.tensor([0.9, 0.001, float(u)]))
        assert verdict.accepted == 0 and verdict.tokens[0] in (1, 2)


def test_batched_trees_equal_one_by_one():
    g = torch.Generator().manual_seed(8)
    trees, ps = [], []
    for n in (0, 1, 3, 6):
        parents = torch.tensor([int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)], dtype=torch.long)
        q = torch.softmax(torch.randn(n, V, generator=g), -1)
        tokens = torch.multinomial(q, 1, generator=g).reshape(-1) if n else torch.empty(0, dtype=torch.long)
        trees.append(TreeProposal(tokens, parents, q))
        ps.append(torch.softmax(torch.randn(n + 1, V, generator=g), -1))
    N = max(t.n for t in trees)
    p = torch.zeros(len(trees), N + 1, V)
    u = torch.rand(len(trees), N + 1, generator=g)
    for b, t in enumerate(trees):
        p[b, : t.n + 1] = ps[b]
    batch = verify_tree_batch(p, **stack_trees(trees, V), uniforms=u)
    for b, t in enumerate(trees):
        alone = verify_tree(ps[b], t, uniforms=torch.cat([u[b, : t.n], u[b, N:]]))
        assert batch.row(b) == alone.tokens and batch.path_row(b) == alone.path


# --- greedy ------------------------------------------------------------------------------------------------


def test_greedy_keeps_the_longest_path_of_argmax_tokens():
    # root children: 3 (a leaf), 3 again (with child 1), 0; argmax after the root is 3, after the second 3 it is 1
    tree = TreeProposal(torch.tensor([3, 3, 0, 1]), torch.tensor([-1, -1, -1, 1]))
    verdict = verify_tree_greedy([3, 4, 1, 2, 4], tree)
    assert verdict.path == [1, 3] and verdict.tokens == [3, 1, 4] and verdict.bonus


def test_greedy_stops_where_no_child_is_the_argmax():
    tree = TreeProposal(torch.tensor([2, 3, 4]), torch.tensor([-1, 0, 0]))
    verdict = verify_tree_greedy([2, 1, 0, 0], tree)
    assert verdict.path == [0] and verdict.tokens == [2, 1] and not verdict.bonus


def test_greedy_tree_gives_the_general_rule_verdict_on_one_hot_p():
    g = torch.Generator().manual_seed(11)
    for _ in range(100):
        n = int(torch.randint(0, 8, (1,), generator=g))
        parents = torch.tensor([int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)], dtype=torch.long)
        best = torch.randint(0, V, (n + 1,), generator=g)
        tokens = torch.zeros(n, dtype=torch.long)
        for i in range(n):  # distinct siblings, the argmax often among them
            used = set(tokens[:i][parents[:i] == parents[i]].tolist())
            options = [t for t in range(V) if t not in used]
            want = int(best[parents[i] + 1])
            tokens[i] = want if want in options and torch.rand(1, generator=g) < 0.6 else options[-1]
        tree = TreeProposal(tokens, parents, without_replacement=True)
        p = torch.nn.functional.one_hot(best, V).float()
        general = verify_tree(p, tree, torch.Generator().manual_seed(1))
        greedy = verify_tree_greedy(best, tree)
        assert (greedy.tokens, greedy.path, greedy.bonus) == (general.tokens, general.path, general.bonus)


# --- mask, positions, path --------------------------------------------------------------------------------


def sees_only_ancestors(tree):
    """Independent statement of the mask: row i+1 sees column j+1 iff j is on the walk from i up to the root."""
    mask, parents = tree.attention_mask(), tree.parents.tolist()
    if not bool(mask[:, 0].all()) or bool(mask[0, 1:].any()):
        return False
    for i in range(tree.n):
        line, node = set(), i
        while node >= 0:
            line.add(node)
            node = parents[node]
        if set(mask[i + 1, 1:].nonzero().flatten().tolist()) != line:
            return False
    return True


def random_trees(count=30, seed=3):
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        n = int(torch.randint(1, 12, (1,), generator=g))
        parents = [int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)]
        yield TreeProposal(torch.zeros(n, dtype=torch.long), torch.tensor(parents))


def test_tree_mask_shows_each_node_its_ancestors_and_itself_only():
    assert all(sees_only_ancestors(t) for t in random_trees())


@pytest.fixture
def sibling_visible_mask(monkeypatch):
    """Mutant: the classic level-causal bug, a node also sees the siblings drafted before it."""
    original = TreeProposal.attention_mask

    def mutant(self):
        mask = original(self)
        same = self.parents.unsqueeze(0) == self.parents.unsqueeze(1)
        mask[1:, 1:] |= same & torch.ones_like(same).tril(-1)
        return mask
    monkeypatch.setattr(TreeProposal, "attention_mask", mutant)


def test_mask_check_rejects_a_mask_that_shows_a_sibling(sibling_visible_mask):
    assert not all(sees_only_ancestors(t) for t in random_trees())


def test_harness_rejects_a_mask_that_shows_a_sibling(sibling_visible_mask):
    assert pvalue(SHAPES["3x2"], "independent") < EXACTNESS_ALPHA


def test_harness_rejects_positions_not_by_depth(monkeypatch):
    monkeypatch.setattr(TreeProposal, "positions", lambda self, last=0: last + torch.arange(self.n + 1))
    assert pvalue(SHAPES["3x2"], "independent") < EXACTNESS_ALPHA


def test_depths_positions_and_kept_cache_rows():
    tree = TreeProposal(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, -1, 0, 2, 1]))
    assert tree.depths().tolist() == [1, 1, 2, 3, 2]
    assert tree.positions(10).tolist() == [10, 11, 11, 12, 13, 12]
    assert tree.path_to(3) == [0, 2, 3] and tree.path_to(-1) == []
    assert tree.kept_block_indices([0, 2, 3]) == [0, 1, 3, 4]


# --- mutants of the rule ----------------------------------------------------------------------------------


def test_harness_rejects_residual_not_updated_after_a_rejected_sibling(monkeypatch):
    monkeypatch.setattr(tree_rule, "next_residual", lambda residual, q_sibling: residual)
    assert pvalue(SHAPES["3x2"], "independent") < EXACTNESS_ALPHA


def test_harness_rejects_siblings_drawn_with_replacement_verified_as_without(monkeypatch):
    original = tree_rule.sibling_draft_distribution
    monkeypatch.setattr(tree_rule, "sibling_draft_distribution",
                        lambda q, taken, without: original(q, taken, torch.ones_like(without)))
    assert pvalue(SHAPES["3x2"], "independent") < EXACTNESS_ALPHA


def test_harness_rejects_siblings_drawn_without_replacement_verified_as_with(monkeypatch):
    monkeypatch.setattr(tree_rule, "sibling_draft_distribution", lambda q, taken, without: q)
    assert pvalue(SHAPES["3x2"], "without") < EXACTNESS_ALPHA


def test_harness_rejects_swapped_p_and_q(monkeypatch):
    residual = tree_rule.residual_distribution
    monkeypatch.setattr(tree_rule, "acceptance_probability", lambda p_x, q_x: torch.clamp(q_x / p_x, max=1.0))
    monkeypatch.setattr(tree_rule, "residual_distribution", lambda p, q: residual(q, p))
    assert pvalue(SHAPES["3x2"], "independent") < EXACTNESS_ALPHA


# --- bad trees ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tree, message", [
    (TreeProposal([1, 2], [-1, 1]), "earlier node"),
    (TreeProposal([1, 2], [-1, -2]), "earlier node"),
    (TreeProposal([1, 9], [-1, 0]), "outside the target vocabulary"),
    (TreeProposal([1, 1], [-1, -1], without_replacement=True), "repeats token 1 of its earlier sibling 0"),
    (TreeProposal([1, 2], [-1, 0], torch.tensor([[0.0, 1.0, 0, 0, 0], [0.5, 0.5, 0.5, 0, 0]])),
     "node 1 is not a distribution"),
    (TreeProposal([1, 2], [-1, 0], torch.tensor([[0.0, 1.0, 0, 0, 0], [1.0, 0, 0, 0, 0]])), "node 1 has q = 0"),
    (TreeProposal([1, 2], [-1, 0], torch.full((3, V), 0.2)), r"\[n, V\]"),
])
def test_bad_trees_are_clear_errors(tree, message):
    with pytest.raises(ProposalError, match=message):
        verify_tree(torch.full((tree.n + 1, V), 0.2), tree)


def test_repeated_tokens_are_fine_for_independent_siblings():
    verify_tree(torch.full((3, V), 0.2), TreeProposal([1, 1], [-1, -1], torch.full((2, V), 0.2)))


def test_p_with_wrong_number_of_rows_is_an_error():
    with pytest.raises(ProposalError, match=r"\[n\+1, V\]"):
        verify_tree(torch.full((2, V), 0.2), TreeProposal([1, 2], [-1, 0]))
