"""Ending a draft early once the drafter doubts the token it just drew (``stop_below``), shared by drafters.

Drafting past a token the drafter itself gives little probability mostly buys rejected tokens: the verifier
stops at the first rejection, so every later draft is wasted work. The doubted token is still proposed; only
the drafting after it is skipped. The draft's length then depends only on the drafter's own draws, never on
the target, so the verifier stays exact (the distribution tests run with it on).
"""
from __future__ import annotations

import torch


def threshold(value, recommended, who: str) -> float:
    """The stop threshold: ``value`` if given, else ``recommended`` (a file's or head's advice), else off (0)."""
    if value is None:
        value = recommended
    if value is None:
        return 0.0
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{who}: stop_below must be a probability in [0, 1), got {value!r}") from None
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{who}: stop_below must be a probability in [0, 1), got {value}")
    return value


def confidence(logits: torch.Tensor, token: int, q: torch.Tensor | None) -> float:
    """The drafter's probability of the token it drew: q(token) when sampling; under greedy decoding (q a point
    mass) the unprocessed softmax's probability of that token (``token`` indexes ``logits``)."""
    if q is not None:
        return float(q[token])
    return float(torch.softmax(logits.float(), -1)[token])
