"""The decode engine: one driver for every request, decoded alone (``generate``, ``stream``, ``decode_steps``)
or with others (``generate_batch``).

Each step, for the live requests together: choose k (the γ policy) -> propose (the proposer, per row or
``propose_batch``) -> validate -> score (ONE target pass over every row's ``[last, x1..xk]``) -> verify (each
row with its own rng) -> roll the target's cache back to what was accepted -> observe -> emit / stop. A request
that finishes hears ``end()``; a waiting one joins in its place (continuous batching).

Error and fallback rules (the README's "bad input" table): a proposer that raises in ``propose`` makes that
row fall back to a plain target step (counted in ``stats.fallback_steps``, warned once; ``strict=True`` makes
it an error); one that fails in ``begin`` or ``observe`` is dropped for that request, which decodes
target-only; a proposal with too many tokens, a bad id or a bad q, and any policy crash, are errors naming the
culprit (:class:`SpeculationError`, keeping what was generated). ``end()`` is called exactly once for every
request whose ``begin()`` was called, also when decoding fails or a stream is abandoned; a failing ``end()``
is warned about (an error under ``strict``).

Exactness and reproducibility: a greedy row is verified on the target's argmax and draws nothing; a sampled
row draws its verifier uniforms from its own generator, ``rand(1, k + 1)`` right after its proposal, so a row
emits the same tokens in any batch as decoded alone (up to the rounding of the target's pass: see ``Target``).

A proposal may be a tree (:class:`~specplug.verifier.TreeProposal`, no deeper than the k asked): it is scored in
the same pass, verified by the tree rule (``rand(1, n + 1)`` for a sampled row) and the cache keeps its accepted
path (:mod:`specplug.tree_steps`). ``verification="block"`` verifies sampled chains jointly (Sun et al.).
"""
from __future__ import annotations

import functools
import itertools
import operator
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from specplug.verifier import (VERIFICATIONS, Proposal, ProposalError, TreeProposal, Verdict, validate_proposal,
                               verify_batch, verify_greedy, verify_tree_greedy)

from . import argmax_kernel
from .metrics import GenerationStats
from .policies import FixedPolicy
from .rows import RowScores
from .sampling import SamplingParams, argmax_ids, processed_probs
from .stopping import Stopper
from .target import Target
from .tree_steps import checked_tree, drafted, is_tree, kept_rows, tree_shape, verify_sampled_trees
from .types import Proposer, SequenceState

__all__ = ["GenerationResult", "SpeculationError", "Engine", "Request", "as_policy", "prompt_ids", "per_row"]

_request_ids = itertools.count()


class SpeculationError(RuntimeError):
    """A proposer (or policy) misbehaved. Names it; ``partial`` holds what was generated before (in a batch,
    for the failing row; ``partials`` has every row's, ``row`` the failing row's index)."""

    def __init__(self, message: str, culprit: str, partial: "GenerationResult | None" = None):
        super().__init__(message)
        self.culprit = culprit
        self.partial = partial
        self.row = 0
        self.partials: list[GenerationResult] = [partial] if partial is not None else []

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


def prompt_ids(target: Target, prompt: str | Sequence[int]) -> list[int]:
    """The prompt's token ids, checked against the target's vocabulary and positions."""
    if not isinstance(prompt, str) and not hasattr(prompt, "__iter__"):
        raise TypeError(f"a prompt is a string or a sequence of token ids, got {type(prompt).__name__} {prompt!r}")
    ids = target.encode(prompt) if isinstance(prompt, str) else [_whole(t, "prompt token id") for t in prompt]
    if not ids:
        raise ValueError("empty prompt: give at least one token (a string that encodes to nothing is empty too)")
    vocab_size = target.vocab_size  # a property that walks the model: once, not per token
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the target vocabulary [0, {vocab_size})")
    limit = target.max_positions
    if limit is not None and len(ids) >= limit:
        raise ValueError(f"prompt has {len(ids)} tokens but target {target.name!r} has only {limit} positions")
    return ids


def _whole(value, what: str) -> int:
    """``value`` as an int (a Python, numpy or 0-d integer tensor one); a float or bool is refused, not truncated."""
    try:
        if not isinstance(value, bool):
            return operator.index(value)
    except TypeError:
        pass
    raise TypeError(f"{what} must be an integer, got {value!r}")


def check_callback(callback) -> None:
    """``callback`` is None or callable: refused before decoding, not after the first step."""
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable (or None), got {type(callback).__name__} {callback!r}")


def per_row(value, n: int, what: str) -> list:
    """One value per request: a list or tuple must have n entries; anything else is shared by all."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{what}: {len(value)} values for {n} prompts")
        return list(value)
    return [value] * n


class CallablePolicy:
    """A bare function ``seq -> k`` as a policy (it learns nothing: no ``update``)."""

    def __init__(self, fn: Callable[[SequenceState], int]):
        self.fn = fn
        self.name = getattr(fn, "__name__", "callable")

    def choose(self, seq: SequenceState, max_k: int) -> int:
        return self.fn(seq)


def as_policy(spec, what: str = "num_speculative_tokens"):
    """The one rule for ``num_speculative_tokens``: an object with ``choose(seq, max_k)`` (a GammaPolicy or
    any duck-typed one) is used as it is, a callable ``seq -> k`` is wrapped, an int γ >= 0 is a FixedPolicy."""
    if hasattr(spec, "choose"):
        return spec
    if callable(spec):
        return CallablePolicy(spec)
    try:
        k = operator.index(spec)
    except TypeError:
        raise TypeError(f"{what}: expected an int γ, a policy (choose(seq, max_k)) or a callable seq -> k, "
                        f"got {spec!r}") from None
    if k < 0:
        raise ValueError(f"{what} must be >= 0, got {spec}")
    return FixedPolicy(k)


def _name(obj) -> str:
    return getattr(obj, "name", None) or type(obj).__name__


@dataclass
class Request:
    """One request in the engine: its sequence, budget, policy, stats and where its proposer stands."""

    index: int
    seq: SequenceState
    budget: int
    policy: object
    stats: GenerationStats
    drafting: bool = False  # its proposer is in use (False: target-only, or dropped after begin/observe failed)
    owes_end: bool = False  # begin() was called and end() not yet
    drafted_last: bool = False  # its drafter ran last step (if not, it catches up when it next does)
    result: GenerationResult | None = None
    # this step's
    asked: int = 0
    proposal: Proposal | TreeProposal | None = None
    fell_back: bool = False
    draft_time: float = 0.0

    @property
    def remaining(self) -> int:
        return self.budget - len(self.seq.output_ids)


class Engine:
    """Decodes a list of requests, at most ``max_batch_size`` at once, one target pass per step.

    ``run()`` is a generator of ``(request, emitted tokens)`` per step and row; afterwards ``results`` holds one
    :class:`GenerationResult` per prompt, in order. With more than one prompt the requests form a *batch*: a
    policy shared by every row may choose all rows' k together (``choose_batch``), ``update`` then finds the
    step's shared costs in ``seq.scratch["batch_step"]``, and errors name the row."""

    def __init__(self, target: Target, proposer: Proposer | None, prompts: Sequence[str | Sequence[int]], *,
                 max_new_tokens: int | Sequence[int] = 64,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 num_speculative_tokens=4, stop: str | Sequence[str] = (), strict: bool = False,
                 max_batch_size: int | None = None, verification: str = "token"):
        if verification not in VERIFICATIONS:
            raise ValueError(f"verification must be one of {VERIFICATIONS}, got {verification!r}")
        self.verification = verification
        if proposer is not None and not callable(getattr(proposer, "propose", None)):
            hint = f"; build a registered one with specplug.get_proposer({proposer!r})" if isinstance(proposer, str) else ""
            raise TypeError(f"proposer must be a Proposer (an object with propose(seq, k)) or None, "
                            f"got {type(proposer).__name__} {proposer!r}"[:200] + hint)
        n = len(prompts)
        samplings = per_row(sampling or SamplingParams(), n, "sampling")
        wrong = next((s for s in samplings if not isinstance(s, SamplingParams)), None)
        if wrong is not None:
            raise TypeError(f"sampling must be a SamplingParams (or one per prompt), got {type(wrong).__name__}")
        budgets = [_whole(b, "max_new_tokens") for b in per_row(max_new_tokens, n, "max_new_tokens")]
        if any(b < 1 for b in budgets):
            raise ValueError(f"max_new_tokens must be >= 1, got {min(budgets)}")
        if not isinstance(strict, bool):  # "no" is truthy: it would have made every fallback an error
            raise TypeError(f"strict must be True or False, got {strict!r}")
        policies = [as_policy(g) for g in per_row(num_speculative_tokens, n, "num_speculative_tokens")]
        ids = [prompt_ids(target, p) for p in prompts]
        # None means all at once; 0 is refused, not read as None (it once decoded every row together)
        self.cap = n if max_batch_size is None else _whole(max_batch_size, "max_batch_size")
        if self.cap < 1:
            raise ValueError(f"max_batch_size must be >= 1 (or None: all at once), got {max_batch_size!r}")
        self.target, self.proposer, self.strict = target, proposer, strict
        # read once per run (the target's properties walk its modules; a run does not move the model)
        self.device, self.vocab_size = target.device, target.vocab_size
        self.name = _name(proposer) if proposer is not None else "target-only"
        self.features = tuple(getattr(proposer, "needs_features", ())) if proposer is not None else ()
        tree = getattr(proposer, "tree", 0)  # a tree-drafting proposer's node budget option (policies may lower it)
        self.max_node_budget = tree if isinstance(tree, int) and not isinstance(tree, bool) and tree > 0 else 0
        self.batched = n > 1
        self.stopper = Stopper(target, stop)
        self.limit = target.max_positions or 1 << 62
        self.requests = [Request(i, SequenceState(ids=list(p), num_prompt=len(p), sampling=s,
                                                  rng=s.generator(target.device), target=target,
                                                  request_id=next(_request_ids)),
                                 budgets[i], policies[i], GenerationStats(prompt_tokens=len(p)))
                         for i, (p, s) in enumerate(zip(ids, samplings))]
        self.waiting = list(self.requests)
        self.live: list[Request] = []
        self.rows = target.new_rows()
        self.no_draft = Proposal.empty(self.device)  # shared by every row that drafts nothing (never written)
        form = getattr(target, "greedy_form", None)  # the form chosen for this target on this machine
        self.greedy_ids = (functools.partial(argmax_kernel.cpu_greedy_ids, form=form)
                           if form is not None and self.device.type == "cpu" else argmax_ids)
        self.warned = False
        self.t_start = time.perf_counter()

    @property
    def results(self) -> list[GenerationResult]:
        return [r.result for r in self.requests]

    # --- the driver ------------------------------------------------------------------------------------
    def run(self) -> Iterator[tuple[Request, list[int]]]:
        """Decode every request; yield each step's emitted tokens per row (after the step is settled)."""
        try:
            self._admit()
            while self.live:
                yield from self._step()
        except BaseException:
            # an error, or a consumer that abandoned the stream (GeneratorExit): every live request's proposer
            # still hears end(), so per-request state it keeps outside seq does not leak
            for req in self.live:
                self._end(req, after_error=True)
            raise

    def _step(self) -> list[tuple[Request, list[int]]]:
        t0 = time.perf_counter()
        self._choose()
        self._propose()
        t1 = time.perf_counter()
        trees = ([r.proposal if is_tree(r.proposal) else None for r in self.live]
                 if any(is_tree(r.proposal) for r in self.live) else None)
        scores = self.rows.score([[r.seq.ids[-1], *r.proposal.ids] for r in self.live], self.features, trees=trees)
        t2 = time.perf_counter()
        verdicts = self._verify(scores)
        # keep [last, accepted drafts] in the cache (a tree: its accepted path); the next step feeds the emitted token
        self.rows.keep([len(r.seq.ids) + v.accepted for r, v in zip(self.live, verdicts)],
                       None if trees is None else [None if t is None else kept_rows(t, v)
                                                   for t, v in zip(trees, verdicts)])
        t3 = time.perf_counter()
        return self._settle(verdicts, scores, t0, (t1 - t0, t2 - t1, t3 - t2))

    def _admit(self) -> None:
        """Prefill waiting requests (all but each prompt's last token) into free rows; begin them."""
        joining = self.waiting[: self.cap - len(self.live)]
        if not joining:
            return
        del self.waiting[: len(joining)]
        t0 = time.perf_counter()
        found = self.rows.add([r.seq.ids for r in joining], self.features)
        prefill = time.perf_counter() - t0
        self.live.extend(joining)  # live before begin(): a failure from here on still ends them
        self._views()
        for req, features in zip(joining, found):
            req.stats.prefill_time = prefill
            req.seq.prompt_features = features
            req.seq.scratch["proposer"] = self.name
            req.seq.scratch["max_node_budget"] = self.max_node_budget
            self._ask(req, "begin")
            if self.proposer is not None:
                req.drafting = req.owes_end = True
                try:
                    self.proposer.begin(req.seq)
                except Exception as exc:
                    self._drop(req, "begin", exc)

    def _views(self) -> None:
        for j, req in enumerate(self.live):
            req.seq.target_cache = self.rows.view(j)

    # --- choose k --------------------------------------------------------------------------------------
    def _choose(self) -> None:
        B = len(self.live)
        k_maxes = []
        for req in self.live:
            req.seq.scratch["batch_size"] = B  # what a policy may read in choose(); update() gets it too
            # never draft past the token budget or the model's positions: k + 1 tokens may be emitted
            k_maxes.append(max(0, min(req.remaining - 1, self.limit - len(req.seq.ids) - 1)) if req.drafting else 0)
        shared = self.live[0].policy
        if self.batched and hasattr(shared, "choose_batch") and all(r.policy is shared for r in self.live):
            # one policy for the whole batch may choose every row's k at once (the step costs the longest draft)
            chosen = self._ask(self.live[0], "choose_batch", [r.seq for r in self.live], list(k_maxes),
                               with_seq=False)
            try:
                chosen = [int(k) for k in chosen]
                if len(chosen) != B:
                    raise ValueError(f"returned {len(chosen)} values for {B} sequences")
            except (TypeError, ValueError) as exc:
                raise self._fail(self.live[0], f"choose_batch() {exc}", "policy", _name(shared)) from exc
            for req, k, m in zip(self.live, chosen, k_maxes):
                req.asked = max(0, min(k, m)) if m else 0
        else:
            for req, m in zip(self.live, k_maxes):
                req.asked = m and max(0, min(int(self._ask(req, "choose", m)), m))

    # --- propose and validate --------------------------------------------------------------------------
    def _propose(self) -> None:
        for req in self.live:
            req.proposal, req.fell_back, req.draft_time = None, False, 0.0
        drafting = [r for r in self.live if r.drafting and r.asked > 0]
        batched = getattr(self.proposer, "propose_batch", None)
        if batched is not None and len(drafting) > 1:
            t0 = time.perf_counter()
            try:
                got = list(batched([r.seq for r in drafting], [r.asked for r in drafting]))
            except Exception as exc:
                for req in drafting:
                    self._fell_back(req, "propose_batch", exc)
            else:
                if len(got) != len(drafting):
                    raise self._fail(drafting[0], f"propose_batch() returned {len(got)} proposals for "
                                                  f"{len(drafting)} sequences")
                for req, proposal in zip(drafting, got):
                    req.proposal = proposal
            share = (time.perf_counter() - t0) / len(drafting)
            for req in drafting:
                req.draft_time = share
        else:
            for req in drafting:
                t0 = time.perf_counter()
                try:
                    req.proposal = self.proposer.propose(req.seq, req.asked)
                except Exception as exc:
                    self._fell_back(req, "propose", exc)
                req.draft_time = time.perf_counter() - t0
        for req in self.live:
            req.proposal = self._checked(req) if req.proposal is not None else self.no_draft

    def _checked(self, req: Request) -> Proposal | TreeProposal:
        """The proposal on the target's device, once it is known to be verifiable: before scoring, so a bad id
        never reaches the model."""
        proposal = req.proposal
        if is_tree(proposal):
            if self.verification == "block" and not req.seq.sampling.greedy:
                raise self._fail(req, "drafted a tree, but verification='block' verifies chains only "
                                      "(use verification='token', or a chain: tree=0)")
            try:
                return checked_tree(proposal, req.asked, self.vocab_size, self.device)
            except ProposalError as exc:
                raise self._fail(req, str(exc)) from exc
        if not isinstance(proposal, Proposal):
            raise self._fail(req, f"propose() returned {type(proposal).__name__}, not a Proposal or TreeProposal")
        if proposal.k > req.asked:
            raise self._fail(req, f"proposed {proposal.k} tokens when asked for at most {req.asked}")
        try:
            validate_proposal(proposal, self.vocab_size)
        except ProposalError as exc:
            raise self._fail(req, str(exc)) from exc
        return proposal.to(self.device)

    # --- verify ----------------------------------------------------------------------------------------
    def _verify(self, scores: RowScores) -> list[Verdict]:
        """Each row's verdict: greedy rows from the argmax (p is one-hot: no uniforms), sampled rows by the rule
        in one vectorised call, each with uniforms from its own generator."""
        verdicts: list[Verdict | None] = [None] * len(self.live)
        greedy = [j for j, r in enumerate(self.live) if r.seq.sampling.greedy]
        if greedy:
            best = self.greedy_ids(scores.logits)
            for j in greedy:
                rule = verify_tree_greedy if is_tree(self.live[j].proposal) else verify_greedy
                verdicts[j] = rule(best[scores.span(j)], self.live[j].proposal)
        sampled = [j for j, r in enumerate(self.live) if not r.seq.sampling.greedy]
        chains = [j for j in sampled if not is_tree(self.live[j].proposal)]
        trees = [j for j in sampled if is_tree(self.live[j].proposal)]
        for rows, rule in ((chains, self._verify_sampled), (trees, self._verify_trees)):
            if rows:
                for j, verdict in zip(rows, rule(scores, rows)):
                    verdicts[j] = verdict
        return verdicts

    def _verify_trees(self, scores: RowScores, rows: list[int]) -> list[Verdict]:
        reqs = [self.live[j] for j in rows]
        return verify_sampled_trees(_processed_rows(scores, rows, [r.seq.sampling for r in reqs]),
                                    [r.proposal for r in reqs], [r.seq.rng for r in reqs])

    def _verify_sampled(self, scores: RowScores, rows: list[int]) -> list[Verdict]:
        reqs = [self.live[j] for j in rows]
        proposals = [r.proposal for r in reqs]
        K = max(p.k for p in proposals)
        V, device = scores.logits.shape[-1], scores.logits.device
        p_target = _processed_rows(scores, rows, [r.seq.sampling for r in reqs])
        draft = torch.zeros(len(rows), K, dtype=torch.long, device=device)
        uniforms = torch.zeros(len(rows), K + 1, dtype=torch.float32, device=device)
        for i, (req, p) in enumerate(zip(reqs, proposals)):
            draft[i, : p.k] = p.tokens
            # same draw, same shape, same point in the row's stream as verify() on the row alone
            u = torch.rand(1, p.k + 1, generator=req.seq.rng, device=device, dtype=torch.float32)[0]
            uniforms[i, : p.k], uniforms[i, K] = u[: p.k], u[p.k]
        lengths = torch.tensor([p.k for p in proposals], dtype=torch.long, device=device)
        out = verify_batch(p_target, draft, _dense_q(proposals, K, V, device), lengths, uniforms=uniforms,
                           validate=False, verification=self.verification)
        accepted, tokens = out.accepted.tolist(), out.tokens.tolist()
        return [Verdict(accepted=a, proposed=p.k, tokens=t[: a + 1]) for a, p, t in zip(accepted, proposals, tokens)]

    # --- after the pass ----------------------------------------------------------------------------------
    def _settle(self, verdicts: list[Verdict], scores: RowScores, t0: float,
                times: tuple[float, float, float]) -> list[tuple[Request, list[int]]]:
        """Policy update, emission, observe, stats and finishing, per row; then rows leave and others join."""
        draft_all, target_time, verify_time = times
        B = len(self.live)
        ks = [drafted(r.proposal) for r in self.live]
        shapes = [tree_shape(r.proposal) for r in self.live]
        step = self._step_costs(ks, shapes, draft_all, target_time + verify_time) if self.batched else None
        events, done = [], []
        for j, (req, verdict) in enumerate(zip(self.live, verdicts)):
            seq, stats = req.seq, req.stats
            req.drafted_last = req.drafting and req.asked > 0
            if self.features:
                span = scores.span(j)
                kept = kept_rows(req.proposal, verdict)  # [last, accepted]: a tree's path, a chain's prefix
                verdict.features = {n: f[span][kept] for n, f in scores.features.items()}
            if req.drafting:
                if step is not None:
                    seq.scratch["batch_step"] = step
                seq.scratch["drafted_tree"] = shapes[j]
                self._ask(req, "update", ks[j], verdict.accepted, req.draft_time, target_time, B)
            emitted, reason = self.stopper.emit(seq, verdict.tokens, req.remaining)
            if req.drafting and not req.fell_back:
                try:
                    self.proposer.observe(seq, verdict)
                except Exception as exc:
                    self._drop(req, "observe", exc)
            stats.fallback_steps += req.fell_back
            stats.draft_time += req.draft_time
            stats.target_time += target_time
            stats.verify_time += verify_time
            stats.record_step(req.asked, ks[j], verdict.accepted, len(emitted), time.perf_counter() - t0,
                              scores.counts[j])
            if emitted:
                events.append((req, emitted))
            if reason:
                done.append(j)
                self._finish(req, reason)
        if done:
            keep = [j for j in range(B) if j not in set(done)]
            self.live = [self.live[j] for j in keep]
            self.rows.select(keep)
            self._admit()
            self._views()
        return events

    def _step_costs(self, ks: list[int], shapes: list, draft_time: float, verify_time: float) -> dict:
        """What the whole step cost, for batch-aware policies: every row waits for all the drafting (K passes),
        and the pass scored each row's own tokens (ragged rows), or K + 1 in every row (padded rows)."""
        B = len(ks)
        tokens = B * (max(ks) + 1) if self.rows.padded else sum(k + 1 for k in ks)
        asked = [r for r in self.live if r.drafting and r.asked > 0]
        return {"scored": max(ks) + 1, "tokens": tokens, "drafted": sum(ks), "draft_rows": sum(1 for k in ks if k),
                "asked_rows": len(asked), "backlog_rows": sum(1 for r in asked if not r.drafted_last),
                "draft_time": draft_time, "verify_time": verify_time, "batch_size": B,
                "tree_rows": sum(1 for s in shapes if s is not None), "padded": self.rows.padded}

    def _finish(self, req: Request, reason: str) -> None:
        req.stats.finish_reason = reason
        self._end(req)
        req.stats.wall_time = time.perf_counter() - self.t_start
        req.result = self._result(req)

    def _end(self, req: Request, after_error: bool = False) -> None:
        """The proposer's end() for this request, once; a failure is warned about (an error under strict, unless
        it happens while another error is on its way: never mask that one)."""
        if not req.owes_end:
            return
        req.owes_end = False
        try:
            self.proposer.end(req.seq)
        except Exception as exc:
            if self.strict and not after_error:
                raise self._fail(req, f"end() raised {exc!r}") from exc
            when = " after an interrupted decode" if after_error else ""
            warnings.warn(f"proposer {self.name!r} failed in end(){when} ({exc!r}){self._where(req)}", stacklevel=3)

    # --- failures ------------------------------------------------------------------------------------------
    def _where(self, req: Request) -> str:
        return f" (batch row {req.index})" if self.batched else ""

    def _result(self, req: Request) -> GenerationResult:
        out = req.seq.output_ids
        return GenerationResult(tokens=out, text=self.target.decode(out), stats=req.stats,
                                prompt_ids=req.seq.ids[: req.seq.num_prompt])

    def _fail(self, req: Request, message: str, kind: str = "proposer", culprit: str | None = None) -> SpeculationError:
        culprit = culprit or self.name
        now = time.perf_counter()
        for r in self.live:
            if r.result is None:
                r.stats.wall_time = now - self.t_start
                r.stats.finish_reason = "error"
        where = f"{self._where(req)}: " if self.batched else ": "
        err = SpeculationError(f"{kind} {culprit!r}{where}{message}", culprit, self._result(req))
        err.row = req.index
        err.partials = [r.result or self._result(r) for r in self.requests]
        return err

    def _ask(self, req: Request, method: str, *args, with_seq: bool = True):
        """Call the request's policy; a crash is always an error (there is no sensible fallback γ). A method the
        policy lacks (``begin``, ``update`` on a duck-typed one) is skipped."""
        policy = req.policy
        fn = getattr(policy, method, None)
        if fn is None:
            return None
        try:
            return fn(req.seq, *args) if with_seq else fn(*args)
        except Exception as exc:
            raise self._fail(req, f"{method}() raised {exc!r}", "policy", _name(policy)) from exc

    def _fell_back(self, req: Request, where: str, exc: Exception) -> None:
        """propose() failed: this step of the row is a plain target step."""
        if self.strict:
            raise self._fail(req, f"{where}() raised {exc!r}") from exc
        req.fell_back = True
        if not self.warned:
            warnings.warn(f"proposer {self.name!r} raised {exc!r} in {where}(){self._where(req)}; falling back to "
                          "target-only steps (counted in stats.fallback_steps; strict=True makes this an error)",
                          stacklevel=4)
            self.warned = True

    def _drop(self, req: Request, where: str, exc: Exception) -> None:
        """begin() or observe() failed: the proposer's state for the request is unknown, so it decodes
        target-only (end() is still called when it finishes)."""
        if self.strict:
            raise self._fail(req, f"{where}() raised {exc!r}") from exc
        warnings.warn(f"proposer {self.name!r} failed in {where}() ({exc!r}){self._where(req)}; decoding "
                      "target-only", stacklevel=4)
        req.drafting, self.warned = False, True


def _processed_rows(scores: RowScores, rows: list[int], samplings: list[SamplingParams]) -> torch.Tensor:
    """[B, W, V] float32: the processed target distributions over each of ``rows``' scored positions (its span),
    zero past a row's own count; rows sharing SamplingParams are processed in one call."""
    V, device = scores.logits.shape[-1], scores.logits.device
    counts = [scores.counts[j] for j in rows]
    p_target = torch.zeros(len(rows), max(counts), V, dtype=torch.float32, device=device)
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(samplings):
        groups.setdefault((s.temperature, s.top_k, s.top_p), []).append(i)
    for members in groups.values():
        at = torch.tensor([(i, n) for i in members for n in range(counts[i])], device=device)
        flat = torch.cat([torch.arange(scores.span(rows[i]).start, scores.span(rows[i]).stop) for i in members])
        p_target[at[:, 0], at[:, 1]] = processed_probs(scores.logits[flat.to(device)], samplings[members[0]])
    return p_target


def _dense_q(proposals: list[Proposal], K: int, V: int, device) -> torch.Tensor | None:
    """None when every row is a point mass (the verifier's cheap path); else [B, K, V] with one-hot rows for
    point-mass proposals and zeros in padding."""
    if K == 0 or all(p.q is None for p in proposals):
        return None
    q = torch.zeros(len(proposals), K, V, dtype=torch.float32, device=device)
    for j, p in enumerate(proposals):
        if not p.k:
            continue
        if p.q is None:
            q[j, torch.arange(p.k, device=device), p.tokens] = 1.0
        else:
            q[j, : p.k] = p.q.to(device=device, dtype=torch.float32)
    return q
