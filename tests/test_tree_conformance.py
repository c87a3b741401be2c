"""q-honesty per branch for tree-drafting proposers: honest drafters pass, each classic dishonesty fails."""
import pytest
import torch

from specplug.tree_conformance import check_tree_q_honesty
from specplug.verifier import ProposalError, TreeProposal

V = 6
_g = torch.Generator().manual_seed(12)
Q = torch.softmax(1.5 * torch.randn(V + 1, V, generator=_g), -1)  # draft law after token t (row V: after the root)
SHAPE = (3, 2)  # 3 children of the root, 2 under each


class ToyTreeDrafter:
    """Draws SHAPE-shaped trees from Q; ``how`` says how it really draws, ``declares`` what it reports."""

    def __init__(self, how, declares=None, seed=0):
        self.how, self.declares, self.gen = how, declares or how, torch.Generator().manual_seed(seed)

    def children(self, row, m):
        if self.how in ("top", "argmax-soft"):  # argmax-soft: the greedy-draft bug, top tokens with q reported soft
            return row.topk(m).indices
        if self.how == "dedupe":  # independent draws, repeats thrown away: the first m distinct
            drawn = torch.multinomial(row, 64, replacement=True, generator=self.gen).tolist()
            return torch.tensor(list(dict.fromkeys(drawn))[:m])
        return torch.multinomial(row, m, replacement=(self.how == "independent"), generator=self.gen)

    def __call__(self):
        tokens, parents, q = [], [], []
        level = [(-1, V)]  # (node index, token the next row is conditioned on)
        for m in SHAPE:
            below = []
            for node, prev in level:
                for x in self.children(Q[prev], m).tolist():
                    below.append((len(tokens), x))
                    tokens.append(x)
                    parents.append(node)
                    q.append(Q[prev])
            level = below
        point = self.declares == "top"
        return TreeProposal(torch.tensor(tokens), torch.tensor(parents), None if point else torch.stack(q),
                            without_replacement=self.declares in ("without", "argmax-soft", "dedupe"))


@pytest.mark.parametrize("how", ["independent", "without", "top"])
def test_honest_tree_drafters_pass(how):
    report = check_tree_q_honesty(ToyTreeDrafter(how), V, samples=300)
    assert report.passed, report.evidence


def test_redrawing_repeats_is_drawing_without_replacement():
    assert check_tree_q_honesty(ToyTreeDrafter("dedupe", "without"), V, samples=300).passed


@pytest.mark.parametrize("how, declares", [
    ("argmax-soft", None),  # top tokens, soft q
    ("without", "independent"),  # drawn without replacement, declared independent
    ("dedupe", "independent"),  # repeats dropped, declared independent
])
def test_dishonest_tree_drafters_fail(how, declares):
    report = check_tree_q_honesty(ToyTreeDrafter(how, declares), V, samples=300)
    assert not report.passed, report.evidence


def test_independent_draws_declared_without_replacement_are_a_clear_error():
    with pytest.raises(ProposalError, match="without replacement"):
        check_tree_q_honesty(ToyTreeDrafter("independent", "without"), V, samples=300)
