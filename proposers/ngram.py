"""``ngram``: prompt lookup. The longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min) that
occurred earlier in prompt + output proposes what followed it. Only accepted tokens are ever indexed.

Two ways to report q (option ``q``):

``q="point"`` (default): continue the **most recent** occurrence verbatim. Deterministic, so q is a point
mass at each drafted token: accepted with probability p(x); on rejection the verifier samples from p with x
removed. No V-sized tensor is ever built.

``q="counts"``: q = the **empirical distribution** of the tokens that followed every earlier occurrence of
the longest matching n-gram; the draft token is drawn from it with ``seq.rng`` (under greedy decoding: its
argmax, ties to the most recent, reported as a one-hot q), and drafting continues from the drawn token by
matching again on the context extended with it.

When each wins:

* A draft drawn from q is accepted with probability sum_x min(p(x), q(x)) = 1 - TV(p, q); a point mass at x
  only with p(x). So at temperature > 0, ``counts`` wins where a context has been followed by several
  tokens in roughly the proportions the target would choose: repeated sampling of one prompt (pass@k),
  templated or tabular output, loops that vary one field. Its re-matching after every drafted token also
  lets it chain across occurrences.
* ``point`` wins where the most recent occurrence is the best guess and older ones mislead: greedy or
  near-deterministic targets copying long spans (edits, quoting the prompt, code refactoring), where
  ``counts`` would put mass on stale continuations (and, at T = 0, pick the most frequent continuation
  instead of the latest). It is also cheaper: one lookup per step, no counts kept, no dense q.
"""
from __future__ import annotations

import torch

from specplug.plugins.hookspecs import hookimpl
from specplug.sampling import q_from_counts
from specplug.types import Proposal, Proposer, SequenceState, Verdict

Q_MODES = ("point", "counts")


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


class _CountIndex:
    """n-gram -> {next token: how often it followed}, for each n; each dict is ordered by the recency of
    the token's latest occurrence (the last item followed most recently)."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.tables: dict[int, dict[tuple[int, ...], dict[int, int]]] = {n: {} for n in range(n_min, n_max + 1)}
        self.indexed = 0

    def extend(self, ids: list[int]) -> None:
        for j in range(max(self.indexed, 1), len(ids)):
            nxt = ids[j]
            for n in range(self.n_min, min(self.n_max, j) + 1):
                table = self.tables[n]
                key = tuple(ids[j - n:j])
                follow = table.get(key)
                if follow is None:
                    table[key] = {nxt: 1}
                else:
                    follow[nxt] = follow.pop(nxt, 0) + 1  # re-insert: most recent last
        self.indexed = len(ids)

    def lookup(self, context: list[int]) -> dict[int, int] | None:
        """Continuation counts of the longest suffix n-gram of ``context`` seen before, or None."""
        for n in range(min(self.n_max, len(context)), self.n_min - 1, -1):
            follow = self.tables[n].get(tuple(context[-n:]))
            if follow is not None:
                return follow
        return None


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, target=None, prompt_lookup_min: int = 1, prompt_lookup_max: int = 3, q: str = "point"):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"ngram: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min} and {prompt_lookup_max}")
        if q not in Q_MODES:
            raise ValueError(f"ngram: q must be one of {', '.join(map(repr, Q_MODES))}, got {q!r}")
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self.q = q

    def _new_index(self):
        return (_CountIndex if self.q == "counts" else _Index)(self.n_min, self.n_max)

    def _index(self, seq: SequenceState):
        index = seq.scratch.get(self.name)
        if index is None or index.indexed > len(seq.ids):  # no begin(), or tokens were taken back
            index = seq.scratch[self.name] = self._new_index()
        index.extend(seq.ids)
        return index

    def begin(self, seq: SequenceState) -> None:
        seq.scratch[self.name] = self._new_index()

    def propose(self, seq: SequenceState, k: int) -> Proposal:
        if self.q == "counts":
            return self._propose_counts(seq, k)
        return Proposal.point_mass(self._index(seq).lookup(seq.ids, k)).to(seq.target.device)

    def _propose_counts(self, seq: SequenceState, k: int) -> Proposal:
        index: _CountIndex = self._index(seq)
        device = seq.target.device
        greedy = seq.sampling.greedy
        context = seq.ids[-self.n_max:]
        tokens: list[int] = []
        rows: list = []  # None: a single continuation (q is a point mass); else (ids, counts, total)
        uniforms = None
        for i in range(k):
            follow = index.lookup(context)
            if follow is None:
                break
            if len(follow) == 1:
                tok = next(iter(follow))
                rows.append(None)
            else:
                total = sum(follow.values())
                if greedy:
                    tok = _argmax_latest(follow)
                else:
                    if uniforms is None:
                        uniforms = torch.rand(k, generator=seq.rng, device=seq.rng.device,
                                              dtype=torch.float64).tolist()
                    tok = self._draw(follow, total, uniforms[i])
                rows.append((list(follow), list(follow.values()), total))
            tokens.append(tok)
            context = context[1:] + [tok] if len(context) >= self.n_max else context + [tok]
        if greedy or all(r is None for r in rows):
            return Proposal.point_mass(tokens).to(device)  # argmax, or certain continuations: one-hot q
        return Proposal(torch.tensor(tokens, device=device), q_from_counts(rows, tokens, seq.target.vocab_size, device))

    @staticmethod
    def _draw(follow: dict[int, int], total: int, u: float) -> int:
        """Inverse-CDF draw with q(t) = follow[t] / total."""
        threshold = u * total
        acc = 0
        tok = None
        for tok, c in follow.items():
            acc += c
            if threshold < acc:
                return tok
        return tok

    def observe(self, seq: SequenceState, verdict: Verdict) -> None:
        self._index(seq)  # index the accepted tokens now, so propose stays cheap

    def end(self, seq: SequenceState) -> None:
        seq.scratch.pop(self.name, None)


def _argmax_latest(follow: dict[int, int]) -> int:
    best, best_c = None, -1
    for tok, c in follow.items():  # later items followed more recently: >= lets them win ties
        if c >= best_c:
            best, best_c = tok, c
    return best


@hookimpl
def register_proposers(register):
    register("ngram", NgramProposer,
             "Prompt lookup: continue the longest earlier match of the last n tokens; "
             "q = point mass, or q='counts': the empirical continuation distribution.")
