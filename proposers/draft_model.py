"""``draft-model``: a small HF causal LM with the target's vocabulary drafts autoregressively.

q at each position is the processed softmax of the draft's logits (same SamplingParams as the target),
and the drafted token is sampled from exactly that q with the sequence's rng.
"""
from __future__ import annotations

import os

import torch

from specplug import zoo
from specplug.plugins.hookspecs import hookimpl
from specplug.sampling import processed_probs
from specplug.target import KVState, Target, load_causal_lm, load_tokenizer
from specplug.types import Proposal, Proposer, SequenceState, Verdict


class DraftModelProposer(Proposer):
    name = "draft-model"
    conformance_options = {"model": "@kit-draft"}  # the conformance kit supplies a draft for its tiny target

    def __init__(self, target: Target | None = None, model: str | os.PathLike | torch.nn.Module | None = None,
                 device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
                 trust_remote_code: bool = False):
        if target is None:
            raise TypeError("draft-model needs target= (the Target it drafts for)")
        if model is None:
            model = _default_draft(target)
        device = device or target.device
        if isinstance(model, torch.nn.Module):
            lm, tokenizer = model.to(device).eval(), None
        else:
            if isinstance(model, str) and zoo.is_zoo_name(model):
                model = zoo.resolve(model)
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype)
            lm = load_causal_lm(model, device=device, dtype=dtype or target.dtype, trust_remote_code=trust_remote_code)
            tokenizer = load_tokenizer(model, trust_remote_code=trust_remote_code)
        self.draft = Target(lm, tokenizer, name=str(getattr(lm.config, "_name_or_path", "")) or "draft")
        _check_vocabulary(target, self.draft)

    def _state(self, seq: SequenceState) -> KVState:
        return seq.scratch.setdefault(self.name, KVState())

    def begin(self, seq: SequenceState) -> None:
        seq.scratch[self.name] = KVState()

    def propose(self, seq: SequenceState, k: int) -> Proposal:
        limit = self.draft.max_positions
        if limit is not None:
            k = min(k, limit - len(seq.ids))
        if k <= 0:
            return Proposal.empty(seq.target.device)
        state = self._state(seq)
        # the cache covers a prefix of seq.ids; feed what it lacks (the prompt at first, then 1-2 tokens)
        logits = self.draft.forward(state, seq.ids[state.length:], logits_to_keep=1).logits[-1]
        tokens, q_rows = [], []
        for i in range(k):
            q = processed_probs(logits, seq.sampling)
            token = self._sample(q, seq.rng)
            tokens.append(token)
            q_rows.append(q)
            if i + 1 < k:
                logits = self.draft.forward(state, [token], logits_to_keep=1).logits[-1]
        device = seq.target.device
        return Proposal(torch.tensor(tokens, device=device), torch.stack(q_rows).to(device))

    @staticmethod
    def _sample(q: torch.Tensor, rng: torch.Generator) -> int:
        return int(torch.multinomial(q, 1, generator=rng))

    def observe(self, seq: SequenceState, verdict: Verdict) -> None:
        # keep only what matches the accepted sequence: everything but its newest token at most
        state = self._state(seq)
        keep = min(state.length, len(seq.ids) - 1)
        if keep < state.length:
            self.draft.rollback(state, keep)

    def end(self, seq: SequenceState) -> None:
        seq.scratch.pop(self.name, None)

    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.draft.model.parameters())


def _default_draft(target: Target):
    short = target.name[len(zoo.PREFIX):] if zoo.is_zoo_name(target.name) else None
    if short in zoo.DEFAULT_DRAFT:
        return zoo.resolve(zoo.PREFIX + zoo.DEFAULT_DRAFT[short])
    raise TypeError(f"draft-model needs model= (a directory, hub id or zoo: name) for target {target.name!r}; "
                    "only bundled zoo targets have a default draft")


def _check_vocabulary(target: Target, draft: Target) -> None:
    """Draft and target must index the same tokens, or q and p would talk about different things."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft-model: vocabulary mismatch: the draft {draft.name!r} has {draft.vocab_size} "
                         f"logits, the target {target.name!r} has {target.vocab_size}")
    if draft.tokenizer is not None and target.tokenizer is not None:
        if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ValueError(f"draft-model: the tokenizers of draft {draft.name!r} and target {target.name!r} "
                             "map tokens to different ids (equal sizes are not enough)")


@hookimpl
def register_proposers(register):
    register("draft-model", DraftModelProposer,
             "A small causal LM with the target's vocabulary drafts; q = its processed softmax.")
