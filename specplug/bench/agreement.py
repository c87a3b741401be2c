"""Whether another engine's greedy output for the same target agrees with ours: token for token, or parting
only where the target's two candidates lie within rounding of each other.

Why: two exact engines may sum a product in different orders (on some CPUs oneDNN's order even changes with the
number of rows, so HF's prompt pass rounds unlike its own steps). Where the top two logits are within a few
rounding units either engine may pick either, and past that point their outputs are no longer comparable. A
parting anywhere else is a real difference and is reported as one.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from ..target import KVState, Target

EQUAL, TIES, DIFFER = "equal", "parted at rounding ties", "differ"
ROUNDING_UNITS = 2  # how close two logits must be, in units of the product dtype's rounding at the larger


def first_parting(ours: Sequence[int], theirs: Sequence[int]) -> int | None:
    """The first position at which the two outputs differ (one ending before the other counts), or None."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def within_rounding(logits: torch.Tensor, a: int, b: int, dtype: torch.dtype) -> bool:
    """Tokens a and b's logits within ``ROUNDING_UNITS`` of ``dtype``'s rounding at the larger: a last-bit
    change in any product may order them either way."""
    la, lb = float(logits[a]), float(logits[b])
    return abs(la - lb) <= ROUNDING_UNITS * torch.finfo(dtype).eps * max(abs(la), abs(lb))


def logits_after(target: Target, ids: Sequence[int]) -> torch.Tensor:
    """The target's logits for the token after ``ids``: one prompt pass, which on a bit-identical target gives
    the very logits a decode step there gives."""
    return target.forward(KVState(), list(ids), logits_to_keep=1).logits[-1].float()


def report_fields(found: str | None) -> dict:
    """A report row's greedy fields from an agreement (None where sampled): ``greedy_equal_to_ours`` (token for
    token) and ``greedy_agreement`` (EQUAL, TIES or DIFFER)."""
    return {"greedy_equal_to_ours": None if found is None else found == EQUAL, "greedy_agreement": found}


def agreement(target: Target, runs: Iterable[tuple[Sequence[int], Sequence[int], Sequence[int]]]) -> str:
    """EQUAL where every ``(prompt ids, ours, theirs)`` matches token for token, TIES where each that does not
    parts first at a position where our target rates both engines' tokens within rounding, DIFFER otherwise."""
    dtype = target.matmul_dtype or target.dtype
    verdict = EQUAL
    for prompt, ours, theirs in runs:
        i = first_parting(ours, theirs)
        if i is None:
            continue
        if i >= min(len(ours), len(theirs)):  # one stopped where the other went on: not a tie between tokens
            return DIFFER
        if not within_rounding(logits_after(target, [*prompt, *ours[:i]]), ours[i], theirs[i], dtype):
            return DIFFER
        verdict = TIES
    return verdict
