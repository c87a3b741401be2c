"""The proposer contract: what a proposer sees of a sequence, and the methods it implements."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specplug.verifier import Proposal, ProposalError, Verdict

from .sampling import SamplingParams

if TYPE_CHECKING:
    from .target import Target

__all__ = ["Proposal", "ProposalError", "Verdict", "SequenceState", "Proposer"]


@dataclass
class SequenceState:
    """One request as a proposer sees it. ``ids`` is prompt + everything emitted so far (accepted only)."""

    ids: list[int]
    num_prompt: int
    sampling: SamplingParams
    rng: torch.Generator
    target: "Target"
    request_id: int = 0
    # The target's cache, for diagnostics only: proposers must not modify it.
    target_cache: object | None = None
    # A proposer's private per-sequence state (its draft cache, its index), keyed by whatever it likes.
    scratch: dict = field(default_factory=dict)
    # The target's features (``needs_features``) of the prompt's prefilled positions (all but its last token),
    # where the loop's prefill computed them; a proposer may take them in ``begin`` instead of a second pass.
    prompt_features: dict | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self.num_prompt:]


class Proposer:
    """Base class of every draft proposer, built-in or plugin.

    Contract: ``propose`` returns at most k tokens **and the distribution q each was drawn from**
    (drawn with ``seq.rng``); the verifier does the rest, so the output is exact for any honest q.
    ``needs_features`` names the target features ``observe`` should receive (e.g. ``("last",)``).
    """

    name: str = "proposer"
    needs_features: tuple[str, ...] = ()

    def begin(self, seq: SequenceState) -> None:
        """A new sequence starts: prompt ids, sampling params, rng and target are in ``seq``."""

    def propose(self, seq: SequenceState, k: int) -> Proposal:
        """At most ``k`` draft tokens continuing ``seq.ids``, each drawn from the q it reports."""
        raise NotImplementedError

    def observe(self, seq: SequenceState, verdict: Verdict) -> None:
        """The step's outcome; ``seq.ids`` already holds the emitted tokens. Roll back private state here."""

    def end(self, seq: SequenceState) -> None:
        """The sequence finished; release per-sequence state."""

    def memory_bytes(self) -> int:
        """Extra memory this proposer holds (weights, caches), for the bench."""
        return 0
