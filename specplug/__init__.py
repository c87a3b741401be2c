"""specplug — exact speculative decoding: one verifier, many pluggable draft proposers.

    import specplug
    target = specplug.Target.from_pretrained("zoo:pycode")
    proposer = specplug.get_proposer("draft-model", target=target)
    result = specplug.generate(target, proposer, "def fib(n):", max_new_tokens=64,
                               sampling=specplug.SamplingParams(temperature=1.0, seed=0))
"""
from specplug.plugins import UnknownProposerError, get_proposer, hookimpl, list_proposers
from specplug.verifier import Proposal, ProposalError, Verdict, verify, verify_batch

from .batch import generate_batch
from .decode import GenerationResult, SpeculationError, StreamChunk, decode_steps, generate, stream
from .metrics import GenerationStats, aggregate, predicted_speedup
from .sampling import GREEDY, SamplingParams, processed_probs
from .target import Target
from .types import Proposer, SequenceState

__version__ = "0.1.0"
__all__ = [
    "Target", "SamplingParams", "GREEDY", "processed_probs", "generate", "generate_batch", "stream", "decode_steps",
    "GenerationResult", "GenerationStats", "StreamChunk", "SpeculationError", "aggregate", "predicted_speedup",
    "Proposer", "Proposal", "ProposalError", "SequenceState", "Verdict", "verify", "verify_batch",
    "get_proposer", "list_proposers", "hookimpl", "UnknownProposerError",
]
