"""Batched speculative decoding: B requests, ONE target pass per step over their ragged drafts.

The same engine as single-sequence decoding (:mod:`specplug.engine`), driving many requests: each row keeps its
own cache and positions in the target (:mod:`specplug.rows`), its own generator and its own γ policy, so a row
emits the tokens it would emit decoded alone (bit for bit where the target's passes are row-invariant:
``target.verify_bit_identical``), and rows join as others finish (continuous batching).
"""
from __future__ import annotations

import numbers
from typing import Callable, Sequence

from .engine import Engine, GenerationResult, check_callback
from .rows import BatchCacheView, BatchedCache
from .sampling import SamplingParams
from .target import Target
from .types import Proposer

__all__ = ["generate_batch", "BatchedCache", "BatchCacheView"]


def generate_batch(target: Target, proposer: Proposer | None, prompts: Sequence[str | Sequence[int]], *,
                   max_new_tokens: int | Sequence[int] = 64,
                   sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                   num_speculative_tokens=4, stop: str | Sequence[str] = (), strict: bool = False,
                   max_batch_size: int | None = None,
                   callback: Callable[[int, list[int]], None] | None = None,
                   verification: str = "token") -> list[GenerationResult]:
    """Decode every prompt with ``target`` at once, drafting with ``proposer`` (None: target-only).

    ``sampling`` and ``max_new_tokens`` may be one value or one per prompt (give per-row seeds for per-row
    reproducibility). ``num_speculative_tokens`` is one value or a list of them, one per row, each an int γ, a
    policy object (``choose(seq, max_k) -> k``, optional ``begin(seq)`` and ``update(seq, proposed, accepted,
    draft_time, verify_time, batch_size)``) or a callable ``seq -> k`` (the rule of :func:`specplug.engine.as_policy`).
    One policy object shared by every row may instead have ``choose_batch(seqs, max_ks) -> list[int]`` to pick all
    rows' k together (a step costs the longest draft); see :class:`specplug.types.BatchStep` for what ``update``
    then finds in ``seq.scratch["batch_step"]``. ``max_batch_size`` caps the rows decoded together; the others
    wait and join as rows finish. ``callback(row, tokens)`` receives each row's emitted tokens.

    Proposers are called per row (``propose(seq, k)``) unless the proposer has ``propose_batch(seqs, ks)`` and
    more than one row drafts: then those rows go in one call (a raise makes all of them fall back).
    Returns one :class:`GenerationResult` per prompt, in order. Per-row stats: ``draft_time`` is the row's own
    drafting, ``target_time``/``verify_time`` and ``step_times`` are the shared step's (what the row waited).
    ``verification``: "token" or "block" for sampled chain rows (see :func:`specplug.decode.generate`). Rows may
    mix chains and trees (a proposer returning a :class:`~specplug.verifier.TreeProposal`).
    """
    if isinstance(prompts, str) or (len(prompts) and all(isinstance(p, numbers.Integral) for p in prompts)):
        one = "a string" if isinstance(prompts, str) else "a list of token ids"
        raise TypeError(f"prompts must be a list of prompts, got {one}: for one prompt pass [prompt] "
                        "(or use specplug.generate)")
    check_callback(callback)
    if not prompts:
        return []
    engine = Engine(target, proposer, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                    num_speculative_tokens=num_speculative_tokens, stop=stop, strict=strict,
                    max_batch_size=max_batch_size, verification=verification)
    for request, tokens in engine.run():
        if callback is not None:
            callback(request.index, tokens)
    return engine.results
