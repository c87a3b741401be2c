"""specplug.verifier — the exact rejection rule. Tensors in, tokens out; knows no model and no plugin."""
from .proposal import Proposal, ProposalError, Verdict
from .rule import (VERIFICATIONS, BatchVerdict, acceptance_probability, residual_distribution, validate_proposal,
                   verify, verify_batch, verify_greedy)
from .tree import TreeProposal, TreeVerdict, ancestors, earlier_siblings, validate_tree
from .tree_rule import TreeBatchVerdict, stack_trees, verify_tree, verify_tree_batch, verify_tree_greedy

__all__ = ["Proposal", "ProposalError", "Verdict", "BatchVerdict", "validate_proposal", "verify", "verify_batch",
           "verify_greedy", "acceptance_probability", "residual_distribution", "VERIFICATIONS",
           "TreeProposal", "TreeVerdict", "TreeBatchVerdict", "ancestors", "earlier_siblings", "validate_tree",
           "stack_trees", "verify_tree", "verify_tree_batch", "verify_tree_greedy"]
