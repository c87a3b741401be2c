"""Single-sequence decoding: ``generate``, ``stream`` and ``decode_steps``, each the decode engine
(:mod:`specplug.engine`) driving one request.

It knows the verifier, the Target and the proposer *interface*, never a concrete proposer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from .detokenize import IncrementalDetokenizer
from .engine import Engine, GenerationResult, SpeculationError, check_callback
from .policies import GammaPolicy
from .sampling import SamplingParams
from .target import Target
from .types import Proposer

__all__ = ["GenerationResult", "SpeculationError", "StreamChunk", "decode_steps", "generate", "stream"]


@dataclass
class StreamChunk:
    """The tokens one step emitted and the text they completed (a partial UTF-8 character waits for the step
    that completes it; a last chunk with no tokens may carry what was still held back)."""

    tokens: list[int]
    text: str


def decode_steps(target: Target, proposer: Proposer | None, prompt: str | Sequence[int], *,
                 max_new_tokens: int = 64, sampling: SamplingParams | None = None,
                 num_speculative_tokens: int | GammaPolicy = 4, stop: str | Sequence[str] = (), strict: bool = False,
                 verification: str = "token") -> Iterator[list[int]]:
    """Yield the tokens emitted by each step; the generator's return value is the GenerationResult.

    ``num_speculative_tokens`` is a fixed γ, a policy choosing k per step (a
    :class:`~specplug.policies.GammaPolicy` or any object with ``choose(seq, max_k)``) or a callable ``seq -> k``.
    """
    engine = Engine(target, proposer, [prompt], max_new_tokens=max_new_tokens, sampling=sampling,
                    num_speculative_tokens=num_speculative_tokens, stop=stop, strict=strict, verification=verification)
    events = engine.run()
    try:
        for _, tokens in events:
            yield tokens
    finally:
        events.close()  # an abandoned stream: the engine still ends the proposer's request
    return engine.results[0]


def generate(target: Target, proposer: Proposer | None, prompt: str | Sequence[int], *,
             max_new_tokens: int = 64, sampling: SamplingParams | None = None,
             num_speculative_tokens: int | GammaPolicy = 4, stop: str | Sequence[str] = (), strict: bool = False,
             callback: Callable[[list[int]], None] | None = None, verification: str = "token") -> GenerationResult:
    """Decode ``prompt`` with ``target``, drafting with ``proposer`` (None: target-only, same engine).

    The output is distributed exactly as sampling from the target with ``sampling``; greedy output equals
    target-only greedy output where the target's verify passes are bit-identical to its one-token steps
    (``target.verify_bit_identical``). ``callback`` receives each step's emitted tokens as they come.
    ``verification``: "token" (token-wise, the default) or "block" (Sun et al.'s block verification of a
    sampled chain: exact too, never fewer tokens in expectation; not for trees). ``proposer.propose`` may
    return a :class:`~specplug.verifier.TreeProposal` no deeper than the k asked.
    """
    check_callback(callback)
    steps = decode_steps(target, proposer, prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                         num_speculative_tokens=num_speculative_tokens, stop=stop, strict=strict,
                         verification=verification)
    while True:
        try:
            tokens = next(steps)
        except StopIteration as done:
            return done.value
        if callback is not None:
            callback(tokens)


def stream(target: Target, proposer: Proposer | None, prompt: str | Sequence[int], **options) -> Iterator[StreamChunk]:
    """Like :func:`generate`, but yields each step's tokens and the text they complete; the chunks' texts add
    up to the result's text."""
    text = IncrementalDetokenizer(target.decode)
    for tokens in decode_steps(target, proposer, prompt, **options):
        yield StreamChunk(tokens=tokens, text=text.push(tokens))
    rest = text.flush()
    if rest:
        yield StreamChunk(tokens=[], text=rest)
