"""The decode loop: prefill, then { propose -> score -> verify -> observe -> rollback } until done.

It knows the verifier, the Target and the proposer *interface*, never a concrete proposer.
"""
from __future__ import annotations

import itertools
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from specplug.verifier import Proposal, ProposalError, Verdict, validate_proposal, verify, verify_greedy

from .metrics import GenerationStats
from .policies import FixedPolicy, GammaPolicy
from .sampling import SamplingParams
from .target import KVState, Target
from .types import Proposer, SequenceState

_request_ids = itertools.count()


class SpeculationError(RuntimeError):
    """A proposer (or policy) misbehaved. Names it; ``partial`` holds what was generated before."""

    def __init__(self, message: str, culprit: str, partial: "GenerationResult | None" = None):
        super().__init__(message)
        self.culprit = culprit
        self.partial = partial

    @property
    def proposer(self) -> str:
        return self.culprit


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    stats: GenerationStats
    prompt_ids: list[int] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason


@dataclass
class StreamChunk:
    """The tokens one step emitted and the text they completed (may lag a partial UTF-8 character)."""

    tokens: list[int]
    text: str


def _prompt_ids(target: Target, prompt: str | Sequence[int]) -> list[int]:
    ids = target.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise ValueError("empty prompt: give at least one token (a string that encodes to nothing is empty too)")
    bad = [t for t in ids if not 0 <= t < target.vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the target vocabulary [0, {target.vocab_size})")
    limit = target.max_positions
    if limit is not None and len(ids) >= limit:
        raise ValueError(f"prompt has {len(ids)} tokens but target {target.name!r} has only {limit} positions")
    return ids


def _proposer_name(proposer: Proposer) -> str:
    return getattr(proposer, "name", None) or type(proposer).__name__


def decode_steps(target: Target, proposer: Proposer | None, prompt: str | Sequence[int], *,
                 max_new_tokens: int = 64, sampling: SamplingParams | None = None,
                 num_speculative_tokens: int | GammaPolicy = 4, stop: Sequence[str] = (), strict: bool = False,
                 ) -> Iterator[list[int]]:
    """Yield the tokens emitted by each step; the generator's return value is the GenerationResult.

    ``num_speculative_tokens`` is a fixed γ or a :class:`~specplug.policies.GammaPolicy` choosing k per step.
    """
    sampling = sampling or SamplingParams()
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    policy = num_speculative_tokens
    if not isinstance(policy, GammaPolicy):
        if int(policy) < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {policy}")
        policy = FixedPolicy(int(policy))
    policy_name = getattr(policy, "name", None) or type(policy).__name__
    ids = _prompt_ids(target, prompt)
    stats = GenerationStats(prompt_tokens=len(ids))
    seq = SequenceState(ids=list(ids), num_prompt=len(ids), sampling=sampling,
                        rng=sampling.generator(target.device), target=target, request_id=next(_request_ids))
    name = _proposer_name(proposer) if proposer is not None else "target-only"
    features = tuple(getattr(proposer, "needs_features", ())) if proposer is not None else ()
    eos = target.eos_token_ids
    limit = target.max_positions or 1 << 62
    max_stop = max((len(s) for s in stop), default=0)
    warned = False

    def result() -> GenerationResult:
        out = seq.output_ids
        return GenerationResult(tokens=out, text=target.decode(out), stats=stats, prompt_ids=list(ids))

    def fail(message: str, kind: str = "proposer", culprit: str = name) -> SpeculationError:
        stats.wall_time = time.perf_counter() - t_start
        stats.finish_reason = "error"
        return SpeculationError(f"{kind} {culprit!r}: {message}", culprit, result())

    def ask_policy(method: str, *args):
        try:
            return getattr(policy, method)(seq, *args)
        except Exception as exc:  # a policy crash is always an error: there is no sensible fallback γ
            raise fail(f"{method}() raised {exc!r}", "policy", policy_name) from exc

    t_start = time.perf_counter()
    state = KVState()
    if features and len(ids) > 1:  # the prefill computes the prompt's features too: no second pass for them
        seq.prompt_features = target.forward(state, ids[:-1], features, logits_to_keep=1).features
    else:
        target.prefill(ids, state)
    seq.target_cache = state
    stats.prefill_time = time.perf_counter() - t_start
    seq.scratch["proposer"] = name
    ask_policy("begin")
    active = proposer
    if active is not None:
        try:
            active.begin(seq)
        except Exception as exc:
            if strict:
                raise fail(f"begin() raised {exc!r}") from exc
            warnings.warn(f"proposer {name!r} failed in begin() ({exc!r}); decoding target-only", stacklevel=2)
            active, warned = None, True

    try:
        while True:
            remaining = max_new_tokens - len(seq.output_ids)
            # never draft past the token budget or the model's positions: k + 1 tokens may be emitted
            k_max = max(0, min(remaining - 1, limit - len(seq.ids) - 1)) if active else 0
            k = k_max and max(0, min(int(ask_policy("choose", k_max)), k_max))
            t0 = time.perf_counter()
            proposal, fell_back = None, False
            if active is not None and k > 0:
                try:
                    proposal = active.propose(seq, k)
                except Exception as exc:
                    if strict:
                        raise fail(f"propose() raised {exc!r}") from exc
                    fell_back = True
                    if not warned:
                        warnings.warn(f"proposer {name!r} raised {exc!r}; falling back to target-only steps "
                                      "(counted in stats.fallback_steps; strict=True makes this an error)", stacklevel=2)
                        warned = True
                if proposal is not None and proposal.k > k:
                    raise fail(f"proposed {proposal.k} tokens when asked for at most {k}")
            if proposal is None:
                proposal = Proposal.empty(target.device)
            else:
                try:  # before scoring: a bad id must never reach the model
                    validate_proposal(proposal, target.vocab_size)
                except ProposalError as exc:
                    raise fail(str(exc)) from exc
            t1 = time.perf_counter()
            last = seq.ids[-1]
            fed = [last, *proposal.tokens.tolist()]
            if sampling.greedy:  # p_target is one-hot: the rule needs only its argmax (see verify_greedy)
                scores = target.forward(state, fed, features)
            else:
                p_target, scores = target.score(state, fed, sampling, features)
            t2 = time.perf_counter()
            verdict: Verdict = (verify_greedy(scores.logits.float().argmax(-1), proposal) if sampling.greedy
                                else verify(p_target, proposal, seq.rng, validate=False))
            t3 = time.perf_counter()
            # keep [last, accepted drafts] in the cache; the emitted token is fed by the next step
            target.rollback(state, len(seq.ids) + verdict.accepted)
            if active is not None:
                ask_policy("update", proposal.k, verdict.accepted, t1 - t0, t2 - t1)
            if features:
                verdict.features = {n: f[: verdict.accepted + 1] for n, f in scores.features.items()}

            emitted, reason = _emit(target, seq, verdict.tokens, remaining, eos, stop, max_stop)
            if active is not None and not fell_back:
                try:
                    active.observe(seq, verdict)
                except Exception as exc:
                    if strict:
                        raise fail(f"observe() raised {exc!r}") from exc
                    warnings.warn(f"proposer {name!r} failed in observe() ({exc!r}); decoding target-only", stacklevel=2)
                    active, warned = None, True
            stats.fallback_steps += fell_back
            stats.draft_time += t1 - t0
            stats.target_time += t2 - t1
            stats.verify_time += t3 - t2
            stats.record_step(k, proposal.k, verdict.accepted, len(emitted), time.perf_counter() - t0)
            if emitted:
                yield emitted
            if not reason and len(seq.ids) >= limit:
                reason = "max_positions"
            if reason:
                stats.finish_reason = reason
                break

    except BaseException:
        # an error, or a consumer that abandoned the stream (GeneratorExit): the proposer still hears end(),
        # so per-request state it keeps outside seq (e.g. suffix's live set) does not leak
        if active is not None:
            try:
                active.end(seq)
            except Exception as exc:  # never mask the original exception
                warnings.warn(f"proposer {name!r} failed in end() after an interrupted decode ({exc!r})",
                              stacklevel=2)
        raise
    if active is not None:
        active.end(seq)
    stats.wall_time = time.perf_counter() - t_start
    return result()


def _emit(target: Target, seq: SequenceState, tokens: list[int], remaining: int, eos: set[int],
          stop: Sequence[str], max_stop: int) -> tuple[list[int], str]:
    """Append a step's tokens to ``seq``, cut at EOS, the token budget or a stop string; return what stayed
    and why the request ends ("" if it goes on)."""
    emitted, reason = _cut(tokens, remaining, eos)
    seq.ids.extend(emitted)
    if stop and not reason:
        reason, cut = _stop_hit(target, seq, len(emitted), stop, max_stop)
        if cut:
            del seq.ids[len(seq.ids) - cut:]
            emitted = emitted[: len(emitted) - cut]
    return emitted, reason


def _cut(tokens: list[int], remaining: int, eos: set[int]) -> tuple[list[int], str]:
    """Truncate a step's tokens at the first EOS (kept) or at the token budget."""
    for i, t in enumerate(tokens[:remaining]):
        if t in eos:
            return tokens[: i + 1], "eos"
    if len(tokens) >= remaining:
        return tokens[:remaining], "length"
    return tokens, ""


def _stop_hit(target: Target, seq: SequenceState, n_new: int, stop: Sequence[str], max_stop: int) -> tuple[str, int]:
    """Look for a stop string in the text ending with this step's tokens; return how many tokens to drop
    after it. Only a short tail is decoded (each token decodes to at least one character)."""
    out = seq.output_ids
    window = out[max(0, len(out) - n_new - max_stop):]
    text = target.decode(window)
    hits = [text.find(s) for s in stop if s in text]
    if not hits:
        return "", 0
    at = min(hits) + next(len(s) for s in stop if text.find(s) == min(hits))
    # keep the fewest tokens whose text still contains the stop string
    for keep in range(1, len(window) + 1):
        if len(target.decode(window[:keep])) >= at:
            return "stop", len(window) - keep
    return "stop", 0


def generate(target: Target, proposer: Proposer | None, prompt: str | Sequence[int], *,
             max_new_tokens: int = 64, sampling: SamplingParams | None = None,
             num_speculative_tokens: int | GammaPolicy = 4, stop: Sequence[str] = (), strict: bool = False,
             callback: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Decode ``prompt`` with ``target``, drafting with ``proposer`` (None: target-only, same loop).

    The output is distributed exactly as sampling from the target with ``sampling``; greedy output equals
    target-only greedy output. ``callback`` receives each step's emitted tokens as they come.
    """
    steps = decode_steps(target, proposer, prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                         num_speculative_tokens=num_speculative_tokens, stop=stop, strict=strict)
    while True:
        try:
            tokens = next(steps)
        except StopIteration as done:
            return done.value
        if callback is not None:
            callback(tokens)


def stream(target: Target, proposer: Proposer | None, prompt: str | Sequence[int], **options) -> Iterator[StreamChunk]:
    """Like :func:`generate`, but yields each step's tokens and the text they complete."""
    steps = decode_steps(target, proposer, prompt, **options)
    out: list[int] = []
    shown = ""
    for tokens in steps:
        out.extend(tokens)
        text = target.decode(out)
        # hold back a trailing partial UTF-8 character until its last byte arrives
        ready = text[:-1] if text.endswith("\ufffd") else text
        yield StreamChunk(tokens=tokens, text=ready[len(shown):])
        shown = ready
