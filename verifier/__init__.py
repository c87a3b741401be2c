"""specplug.verifier — the exact rejection rule. Tensors in, tokens out; knows no model and no plugin."""
from .proposal import Proposal, ProposalError, Verdict
from .rule import (BatchVerdict, acceptance_probability, residual_distribution, validate_proposal, verify,
                   verify_batch, verify_greedy)

__all__ = ["Proposal", "ProposalError", "Verdict", "BatchVerdict", "validate_proposal", "verify", "verify_batch", "verify_greedy",
           "acceptance_probability", "residual_distribution"]
