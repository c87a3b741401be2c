"""``fallback``: one proposer drafts, and another wherever the first has nothing to offer.

Why: a lookup drafter (``ngram``, ``suffix``) costs next to nothing and is often right where the text repeats,
but drafts nothing elsewhere; a model drafter (``draft-model``, ``eagle``) drafts everywhere at a forward per
token. Decoded together, the rows a lookup cannot serve emit one token a step, and a batch's wave lasts as
long as its slowest row. Here the model drafts only the steps the lookup leaves empty.

Exactness: a step's tokens all come from one proposer, drawn from the q it reports; which one drafts is settled
before the second is asked (the first returned no token), so the rule stays exact for any pair.

Both proposers hear every ``begin``, ``observe`` and ``end`` of the request, whichever drafted: each keeps its
own state in ``seq.scratch`` under its own name and rolls it forward or back as it does alone (a model drafter
that sat out some steps catches up on the accepted tokens when it next drafts).
"""
from __future__ import annotations

from typing import Sequence

from specplug.plugins.hookspecs import hookimpl
from specplug.types import Proposal, Proposer, SequenceState, Verdict

__all__ = ["FallbackProposer"]


class FallbackProposer(Proposer):
    """``first`` drafts; where its proposal is empty, ``then`` drafts. Both are registered proposer names,
    built with ``target`` and their own options (``first_options``, ``then_options``)."""

    name = "fallback"
    conformance_options = {"then_options": {"model": "@kit-draft"}}

    def __init__(self, target=None, first: str = "ngram", then: str = "draft-model",
                 first_options: dict | None = None, then_options: dict | None = None):
        from specplug.plugins import get_proposer  # the registry loads this module: import it when building

        if first == then:
            raise ValueError(f"fallback: first and then are both {first!r}; two instances of one proposer would "
                             "share its per-request state (seq.scratch keys its name)")
        self.first = _build(get_proposer, "first", first, target, first_options)
        self.then = _build(get_proposer, "then", then, target, then_options)
        self.needs_features = tuple(dict.fromkeys((*self.first.needs_features, *self.then.needs_features)))

    def begin(self, seq: SequenceState) -> None:
        self.first.begin(seq)
        self.then.begin(seq)

    def propose(self, seq: SequenceState, k: int) -> Proposal:
        proposal = self.first.propose(seq, k)
        return proposal if _drafted(proposal) else self.then.propose(seq, k)

    def propose_batch(self, seqs: Sequence[SequenceState], ks: Sequence[int]) -> list[Proposal]:
        """Each proposer's rows in one call where it drafts a batch at once (``then`` gets the rows ``first``
        left empty)."""
        out = _batch(self.first, seqs, ks)
        empty = [j for j, p in enumerate(out) if not _drafted(p) and ks[j] > 0]
        if empty:
            for j, proposal in zip(empty, _batch(self.then, [seqs[j] for j in empty], [ks[j] for j in empty])):
                out[j] = proposal
        return out

    def observe(self, seq: SequenceState, verdict: Verdict) -> None:
        self.first.observe(seq, verdict)
        self.then.observe(seq, verdict)

    def end(self, seq: SequenceState) -> None:
        try:
            self.first.end(seq)
        finally:
            self.then.end(seq)

    def memory_bytes(self) -> int:
        return self.first.memory_bytes() + self.then.memory_bytes()


def _build(get_proposer, role: str, name: str, target, options: dict | None) -> Proposer:
    try:
        return get_proposer(name, target=target, **(options or {}))
    except (TypeError, ValueError, LookupError) as exc:  # bad names and options: say which of the two
        try:
            named = type(exc)(f"fallback: {role}={name!r}: {exc}")
        except Exception:  # an error type built from other arguments stays as it was
            raise exc from None
        raise named from exc


def _batch(proposer: Proposer, seqs: Sequence[SequenceState], ks: Sequence[int]) -> list[Proposal]:
    if len(seqs) > 1 and callable(getattr(proposer, "propose_batch", None)):
        return list(proposer.propose_batch(list(seqs), list(ks)))
    return [proposer.propose(seq, k) for seq, k in zip(seqs, ks)]


def _drafted(proposal: Proposal) -> bool:
    return proposal.tokens.numel() > 0


@hookimpl
def register_proposers(register):
    register("fallback", FallbackProposer,
             "first drafts (default ngram); where it has nothing, then drafts (default draft-model); "
             "q = the drafting proposer's.")
