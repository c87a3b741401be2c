"""``ngram``: prompt lookup. The longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min) that
occurred earlier in prompt + output proposes what followed its most recent occurrence.

Deterministic, so q is a point mass at each drafted token: accepted with probability p(x); on rejection the
verifier samples from p with x removed. Only accepted tokens are ever indexed.
"""
from __future__ import annotations

from specplug.plugins.hookspecs import hookimpl
from specplug.types import Proposal, Proposer, SequenceState, Verdict


class _Index:
    """n-gram -> position right after its most recent occurrence, for each n; grows one token at a time."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.indexed = 0

    def extend(self, ids: list[int]) -> None:
        for j in range(max(self.indexed, 1), len(ids)):
            for n in range(self.n_min, min(self.n_max, j) + 1):
                self.tables[n][tuple(ids[j - n:j])] = j
        self.indexed = len(ids)

    def lookup(self, ids: list[int], k: int) -> list[int]:
        for n in range(min(self.n_max, len(ids)), self.n_min - 1, -1):
            start = self.tables[n].get(tuple(ids[-n:]))
            if start is not None:
                return ids[start:start + k]
        return []


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, target=None, prompt_lookup_min: int = 1, prompt_lookup_max: int = 3):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"ngram: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min} and {prompt_lookup_max}")
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def _index(self, seq: SequenceState) -> _Index:
        index = seq.scratch.setdefault(self.name, _Index(self.n_min, self.n_max))
        index.extend(seq.ids)
        return index

    def begin(self, seq: SequenceState) -> None:
        seq.scratch[self.name] = _Index(self.n_min, self.n_max)

    def propose(self, seq: SequenceState, k: int) -> Proposal:
        return Proposal.point_mass(self._index(seq).lookup(seq.ids, k)).to(seq.target.device)

    def observe(self, seq: SequenceState, verdict: Verdict) -> None:
        self._index(seq)  # index the accepted tokens now, so propose stays cheap

    def end(self, seq: SequenceState) -> None:
        seq.scratch.pop(self.name, None)


@hookimpl
def register_proposers(register):
    register("ngram", NgramProposer,
             "Prompt lookup: continue the longest earlier match of the last n tokens; q = point mass.")
