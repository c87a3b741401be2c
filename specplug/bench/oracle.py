"""An oracle drafter: target-only's own greedy output as drafts, at no drafting cost.

Why: a proposer's speed-up at a batch size is bounded by what a verify pass costs against a plain step there and by
the work speculation does not shorten (prefill, a wave's tail). An oracle run measures that bound end to end for
any proposer on this machine, model and workload (``specplug compare --batch-sizes ... --ceiling``,
``benchmarks/oracle_ceiling.py``); with ``alpha`` below 1 it drafts as a drafter of i.i.d. acceptance alpha would.
"""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from specplug.batch import generate_batch
from specplug.engine import prompt_ids
from specplug.sampling import GREEDY
from specplug.types import Proposal, Proposer, SequenceState

__all__ = ["OracleProposer", "greedy_outputs"]


class OracleProposer(Proposer):
    """Drafts the next tokens of each prompt's known output as a point mass; with ``alpha`` < 1 each drafted token
    is replaced by another with probability 1 − alpha (rejected under greedy verification: drafts are then kept as
    with i.i.d. acceptance alpha)."""

    name = "oracle"

    def __init__(self, outputs: Mapping[tuple[int, ...], Sequence[int]], vocab_size: int, alpha: float = 1.0,
                 seed: int = 0):
        if not 0 <= alpha <= 1:
            raise ValueError(f"oracle: alpha must lie in [0, 1], got {alpha}")
        self.outputs, self.vocab_size, self.alpha = outputs, vocab_size, alpha
        self.rng = random.Random(seed)

    def propose(self, seq: SequenceState, k: int) -> Proposal:
        known = self.outputs.get(tuple(seq.ids[:seq.num_prompt]))
        if known is None:
            raise KeyError("oracle: no known output for this prompt (greedy_outputs was given other prompts)")
        done = len(seq.ids) - seq.num_prompt
        draft = [self._maybe_wrong(t) for t in known[done:done + k]]
        return Proposal.point_mass(draft) if draft else Proposal.empty()

    def _maybe_wrong(self, token: int) -> int:
        if self.alpha >= 1 or self.rng.random() < self.alpha:
            return token
        return (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size


def greedy_outputs(target, prompts: Sequence[str], max_new_tokens: int) -> dict[tuple[int, ...], list[int]]:
    """Target-only greedy output of each distinct prompt, keyed by its prompt ids as the engine reads them (what the
    oracle finds in ``seq.ids``)."""
    distinct = list(dict.fromkeys(prompts))
    results = generate_batch(target, None, distinct, max_new_tokens=max_new_tokens, sampling=GREEDY)
    return {tuple(prompt_ids(target, p)): r.tokens for p, r in zip(distinct, results)}
