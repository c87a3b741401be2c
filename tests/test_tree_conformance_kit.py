"""The conformance kit covers trees and block verification: an honest tree drafter passes q-honesty per branch
and end-to-end exactness through the engine, and each mutant of issue 20 makes the kit fail — the residual
not updated after a rejected sibling, siblings drawn with replacement declared without, a mask that shows a
node its sibling, block verification accepting by the token-wise ratio."""
import pytest
import torch

import specplug
import specplug.verifier.block as block
import specplug.verifier.tree_rule as tree_rule
from specplug.conformance import ConformanceKit
from specplug.sampling import SamplingParams
from specplug.verifier import TreeProposal
from test_tree_engine import RandomTreeProposer, _leaky_mask
from tiny import private_machine_cache  # noqa: F401 (autouse: a private speed-choice cache)

T1 = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    return ConformanceKit(tmp_path_factory.mktemp("kit"), samples=1200)  # the residual mutant: p near 1e-9 at 1000


def tree_drafter(kit, **options):
    return RandomTreeProposer(kit.target.vocab_size, width=3, target=kit.target, **options)


def test_an_honest_tree_drafter_passes_q_honesty_per_branch_and_exactness(kit):
    honesty = kit.q_honesty(tree_drafter(kit, without_replacement=True), T1, "q-honesty[T=1]")
    assert honesty.status == "pass" and "per branch" in honesty.evidence, honesty.evidence
    assert kit.exactness(tree_drafter(kit), "temperature-1", T1).status == "pass"


def test_kit_fails_the_residual_not_updated_after_a_rejected_sibling(kit, monkeypatch):
    monkeypatch.setattr(tree_rule, "next_residual", lambda residual, q_sibling: residual)
    assert kit.exactness(tree_drafter(kit), "temperature-1", T1).status == "fail"


def test_kit_fails_a_mask_that_lets_a_node_see_its_sibling(kit, monkeypatch):
    monkeypatch.setattr(TreeProposal, "attention_mask", _leaky_mask)
    assert kit.exactness(tree_drafter(kit), "temperature-1", T1).status == "fail"


class WithReplacementDeclaredWithout(RandomTreeProposer):
    """Draws each sibling set independently (repeats possible) but declares it drawn without replacement."""

    def propose(self, seq, k):
        self.without = False
        tree = super().propose(seq, k)
        return TreeProposal(tree.tokens, tree.parents, tree.q, without_replacement=True)


def test_kit_fails_siblings_drawn_with_replacement_but_declared_without(kit):
    proposer = WithReplacementDeclaredWithout(kit.target.vocab_size, width=3, target=kit.target)
    honesty = kit.q_honesty(proposer, T1, "q-honesty[T=1]")
    assert honesty.status == "fail" and "without replacement" in honesty.evidence, honesty.evidence
    assert kit.exactness(proposer, "temperature-1", T1).status == "fail"


def test_kit_under_block_verification_passes_a_chain_proposer_and_fails_the_token_wise_ratio(kit, monkeypatch):
    blocked = ConformanceKit(kit.draft_dir.parent, samples=1200, verification="block")
    draft = lambda: specplug.get_proposer("draft-model", target=blocked.target, model=blocked.draft_dir)  # noqa: E731
    assert blocked.exactness(draft(), "temperature-1", T1).status == "pass"
    monkeypatch.setattr(block, "block_ratio", lambda p_prev, p_x, q_x: torch.clamp(p_x / q_x, max=1.0))
    result = blocked.exactness(draft(), "temperature-1", T1)
    assert result.status == "fail" and "block verification" in result.evidence, result.evidence
