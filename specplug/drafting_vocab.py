"""Drafting over part of the vocabulary (the idea of FR-Spec, Zhao et al. 2025), shared by the proposers that
project onto the target's vocabulary.

For a small drafter the projection onto all V tokens is much of a step, and rare tokens are rarely accepted
anyway. A proposer that drafts over a subset computes logits for the subset's rows only; q is the processed
softmax over those logits and zero elsewhere — exactly what the token is drawn from — so the verifier stays
exact, and only acceptance can change (a token outside the subset is never drafted).

The subset is a list of token ids, or the N most frequent tokens of a ranking file, ``frequent_tokens.json``
(``specplug train token-ranks`` writes one: ``{"tokens": [ids by frequency], "default_vocab": N, ...}``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import torch

from .lean_llama import Product

FREQUENT_TOKENS = "frequent_tokens.json"


def read_ranks(*dirs) -> tuple[dict | None, Path | None]:
    """The first ``frequent_tokens.json`` among ``dirs`` (None entries skipped) and its path; (None, the first
    place looked or None) where there is none."""
    first = None
    for d in dirs:
        if d is None:
            continue
        path = Path(d) / FREQUENT_TOKENS
        first = first or path
        if path.is_file():
            return json.loads(path.read_text()), path
    return None, first


def vocab_subset(vocab: int | Sequence[int] | str | None, ranks: dict | None, ranks_file: Path | None,
                 vocab_size: int, who: str) -> torch.Tensor | None:
    """The drafting vocabulary as sorted token ids, or None for all of it. ``vocab``: a list of ids, the
    ``vocab`` most frequent tokens (needs ``ranks``), ``"all"``, or None for the ranking's ``default_vocab``
    (all where there is none). ``who`` names the proposer in errors."""
    if vocab is None:  # what the ranking recommends (measured when it was written), if anything
        vocab = (ranks or {}).get("default_vocab")
    if vocab is None or vocab == "all":
        return None
    if isinstance(vocab, bool) or not isinstance(vocab, (int, list, tuple)):
        raise TypeError(f"{who}: vocab must be a token count, a list of token ids or 'all', got {vocab!r}")
    if isinstance(vocab, int):
        if ranks is None:
            where = ranks_file.parent if ranks_file else "a module passed in"
            raise ValueError(f"{who}: vocab={vocab} needs {FREQUENT_TOKENS} (token ids by frequency), and {where} "
                             "has none; write one with `specplug train token-ranks` or pass vocab as a list of ids")
        ranked = ranks["tokens"]
        if not 0 < vocab <= len(ranked):
            raise ValueError(f"{who}: vocab={vocab} is outside 1..{len(ranked)} (the tokens {ranks_file} ranks)")
        vocab = ranked[:vocab]
    ids = sorted({int(i) for i in vocab})
    if not ids or ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"{who}: vocab ids must be a non-empty set within [0, {vocab_size})")
    return torch.tensor(ids, dtype=torch.long)


def full_q(q: torch.Tensor | None, subset: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """q [..., S] over the subset's positions -> q [..., V] over the whole vocabulary (zero outside the subset)."""
    if q is None or subset is None:
        return q
    return q.new_zeros(*q.shape[:-1], vocab_size).index_copy_(q.dim() - 1, subset, q)


def sampled_or_greedy(sampled_vocab, recommended, vocab):
    """The vocabulary for sequences that sample: ``sampled_vocab`` if given, else a recommendation, else the
    greedy one (``vocab``). Why two: under greedy decoding only the target's argmax can be accepted, and it is
    nearly always a frequent token, while a sampled draft is accepted with probability 1 - TV(p, q), so p's
    mass outside the subset is lost at every position."""
    if sampled_vocab is not None:
        return sampled_vocab
    return recommended if recommended is not None else vocab


def drafting_subsets(vocab, sampled_vocab, recommended: dict, head_dir, target, who: str
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A head's drafting vocabularies for greedy and for sampling sequences: ``vocab`` / ``sampled_vocab`` as
    given, else the head's ``recommended`` ones (its config's ``drafting``), else all; counts of the most
    frequent tokens ranked by ``frequent_tokens.json`` in ``head_dir`` or the target's directory."""
    ranks, ranks_file = read_ranks(head_dir, getattr(target, "path", None))
    vocab = vocab if vocab is not None else recommended.get("vocab", "all")
    sampled_vocab = sampled_or_greedy(sampled_vocab, recommended.get("sampled_vocab"), vocab)
    return (vocab_subset(vocab, ranks, ranks_file, target.vocab_size, who),
            vocab_subset(sampled_vocab, ranks, ranks_file, target.vocab_size, who))


def same_subset(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two drafting vocabularies (None: all) are the same, so one projection can serve both."""
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


class Projection:
    """How a drafter turns its last hidden state into drafting logits: ``product`` maps h [.., H] to logits
    over ``subset`` (sorted token ids, logits in their order) or over the whole vocabulary (``subset`` None);
    :meth:`token_and_q` maps a draw back to a token id and a q over the whole vocabulary. ``copied_bytes``:
    memory the product holds beyond the model's own weights (a subset's rows, an int8 copy)."""

    def __init__(self, subset: torch.Tensor | None, product, copied_bytes: int = 0):
        self.subset, self.product, self.copied_bytes = subset, product, copied_bytes
        self.ids = None if subset is None else subset.tolist()  # index -> id without a tensor op per token

    def token_and_q(self, index: int, q: torch.Tensor | None, vocab_size: int) -> tuple[int, torch.Tensor | None]:
        if self.subset is None:
            return index, q
        return self.ids[index], full_q(q, self.subset, vocab_size)  # q zero outside the subset


def projection_onto(weight: torch.Tensor, subset: torch.Tensor | None, int8: bool,
                    whole: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Projection:
    """A projection through ``weight`` (an LM head's [V, H]): its rows for ``subset`` (a copy), or all of it —
    through ``whole`` (e.g. the target's :attr:`~specplug.target.Target.head_product`, shared by reference)
    where given, else ``weight`` itself; ``int8`` multiplies by an int8 copy (see :mod:`specplug.int8_products`)."""
    weight = weight.detach()
    if subset is None and not int8 and whole is not None:
        return Projection(None, whole)
    if subset is not None:
        subset = subset.to(weight.device)
        weight = weight[subset].contiguous()
    product = Product(weight, int8=int8)
    copied = product.nbytes() if int8 else (weight.numel() * weight.element_size() if subset is not None else 0)
    return Projection(subset, product, copied)
