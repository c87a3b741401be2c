"""A third-party proposer: drafts from the bigram statistics of the sequence so far.

q(x | previous token) = (count(previous, x) + smoothing) / (count(previous) + smoothing * V), so q is a dense
distribution over the target vocabulary, and each draft token is sampled from exactly that q (greedy: its
argmax, with q reported as the matching one-hot), which is all specplug's verifier needs to stay exact.
"""
import torch

import specplug
from specplug.types import Proposal, Proposer


class BigramProposer(Proposer):
    name = "bigram"

    def __init__(self, target=None, smoothing: float = 0.1):
        if smoothing <= 0:
            raise ValueError("bigram: smoothing must be > 0 so that q covers every token")
        self.smoothing = smoothing

    def _counts(self, seq) -> torch.Tensor:
        V = seq.target.vocab_size
        state = seq.scratch.get(self.name)
        if state is None:
            state = seq.scratch[self.name] = {"counts": torch.zeros(V, V), "seen": 0}
        ids = torch.tensor(seq.ids[max(state["seen"] - 1, 0):])
        if ids.numel() > 1:
            state["counts"].index_put_((ids[:-1], ids[1:]), torch.ones(ids.numel() - 1), accumulate=True)
        state["seen"] = len(seq.ids)
        return state["counts"]

    def propose(self, seq, k):
        counts = self._counts(seq)
        previous, tokens, rows = seq.ids[-1], [], []
        for _ in range(k):
            q = counts[previous] + self.smoothing
            q = q / q.sum()
            if seq.sampling.greedy:
                token = int(q.argmax())
                q = torch.nn.functional.one_hot(torch.tensor(token), q.numel()).float()
            else:
                token = int(torch.multinomial(q, 1, generator=seq.rng))
            tokens.append(token)
            rows.append(q)
            previous = token
        if not tokens:
            return Proposal.empty()
        return Proposal(torch.tensor(tokens), torch.stack(rows))

    def end(self, seq):
        seq.scratch.pop(self.name, None)


@specplug.hookimpl
def register_proposers(register):
    register("bigram", BigramProposer, "Bigram statistics of the context; dense smoothed q (example plugin).")
    register("bigram-dishonest", DishonestBigram,
             "DELIBERATELY BROKEN example: argmax drafts with a soft q; `specplug check` rejects it.")


class DishonestBigram(BigramProposer):
    """DELIBERATELY BROKEN, for `specplug check` to catch: drafts the argmax but reports the soft q.

    This is the bug class HF transformers and vLLM both shipped once; the verifier cannot see it, so the
    output is no longer distributed as the target's. Never use it for decoding.
    """

    name = "bigram-dishonest"

    def propose(self, seq, k):
        counts = self._counts(seq)
        previous, tokens, rows = seq.ids[-1], [], []
        for _ in range(k):
            q = counts[previous] + self.smoothing
            q = q / q.sum()
            tokens.append(int(q.argmax()))  # the bug: not a sample from q
            rows.append(q)
            previous = tokens[-1]
        return Proposal(torch.tensor(tokens), torch.stack(rows)) if tokens else Proposal.empty()
