"""What a proposer hands to the verifier, what the verifier hands back, and how bad input is reported."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class ProposalError(ValueError):
    """A proposal the rule cannot verify (a proposer bug). The decode loop adds the proposer's name."""


@dataclass
class DraftIds:
    """What every proposal offers the loop: ``ids``, its ``tokens`` as Python ints, read once per tensor."""

    _ids: tuple | None = field(default=None, init=False, repr=False, compare=False)  # (tokens, their list)

    @property
    def ids(self) -> list[int]:
        """``tokens`` as Python ints (the loop reads them to score, verify and count; do not modify the list)."""
        cached = self._ids
        if cached is None or cached[0] is not self.tokens:
            cached = self._ids = (self.tokens, self.tokens.tolist())
        return cached[1]


@dataclass
class Proposal(DraftIds):
    """k draft tokens and the distribution q each one was actually drawn from.

    ``q`` is a dense ``[k, V]`` tensor of probabilities over the target vocabulary, or ``None`` for a
    point mass: a deterministic drafter whose q puts all mass on its token (no V-sized allocation).
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1)

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> "Proposal":
        return cls(torch.empty(0, dtype=torch.long, device=device))

    @classmethod
    def point_mass(cls, tokens) -> "Proposal":
        return cls(torch.as_tensor(tokens, dtype=torch.long), None)

    def to(self, device: torch.device | str) -> "Proposal":
        """This proposal on ``device``: itself where it is there already (as ``Tensor.to``)."""
        device = torch.device(device)
        if self.tokens.device == device and (self.q is None or self.q.device == device):
            return self
        return Proposal(self.tokens.to(device), None if self.q is None else self.q.to(device))

    @property
    def k(self) -> int:
        cached = self._ids
        return len(cached[1]) if cached is not None and cached[0] is self.tokens else int(self.tokens.numel())

    @property
    def is_point_mass(self) -> bool:
        return self.q is None


@dataclass
class Verdict:
    """Outcome of one verification step: ``accepted`` draft tokens kept, then one more token emitted.

    ``tokens`` is the accepted prefix followed by the residual sample (after a rejection) or the bonus
    sample (all accepted): 1..k+1 tokens, never zero.
    """

    accepted: int
    proposed: int
    tokens: list[int]
    features: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def all_accepted(self) -> bool:
        return self.accepted == self.proposed
