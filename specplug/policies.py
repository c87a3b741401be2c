"""γ policies: how many tokens to draft at each step. Plugins too (hook ``register_policies``).

A policy sees one request at a time (its state lives in ``seq.scratch``), chooses k before each step and is
told afterwards what happened. ``fixed`` always drafts γ; ``heuristic`` is HF's schedule (+2 after a fully
accepted step, −1 otherwise); ``cost-model`` picks the k that maximises expected emitted tokens per second
from online estimates of α and of the drafting and verification costs, and may pick 0 (no speculation).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specplug.plugins.hookspecs import hookimpl

from .types import SequenceState


class GammaPolicy:
    """Base class: ``choose`` before each step, ``update`` after it."""

    name = "policy"

    def begin(self, seq: SequenceState) -> None:
        """A new request starts."""

    def choose(self, seq: SequenceState, max_k: int) -> int:
        """How many tokens to draft now (0..max_k)."""
        raise NotImplementedError

    def update(self, seq: SequenceState, proposed: int, accepted: int, draft_time: float, verify_time: float,
               batch_size: int = 1) -> None:
        """The step's outcome: tokens drafted and accepted, seconds spent drafting and scoring (proposed + 1 tokens)."""


class FixedPolicy(GammaPolicy):
    name = "fixed"

    def __init__(self, gamma: int = 4):
        if gamma < 0:
            raise ValueError(f"fixed policy: gamma must be >= 0, got {gamma}")
        self.gamma = gamma

    def choose(self, seq, max_k):
        return min(self.gamma, max_k)


class HeuristicPolicy(GammaPolicy):
    """HF transformers' schedule: +2 after a step whose drafts were all accepted, −1 (not below 1) otherwise."""

    name = "heuristic"

    def __init__(self, gamma: int = 4, max_gamma: int = 16):
        self.initial, self.max_gamma = gamma, max_gamma

    def begin(self, seq):
        seq.scratch[self.name] = self.initial

    def choose(self, seq, max_k):
        return min(seq.scratch.setdefault(self.name, self.initial), max_k)

    def update(self, seq, proposed, accepted, draft_time, verify_time, batch_size=1):
        if proposed == 0:
            return
        k = seq.scratch.get(self.name, self.initial)
        seq.scratch[self.name] = min(k + 2, self.max_gamma) if accepted == proposed else max(1, k - 1)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits on average when each of k drafts is accepted with probability α (bonus included)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class MeasuredCosts:
    """Online cost estimates: drafting time per drafted token (one row's), and scoring time as a function of
    tokens scored per row n and batch size B: an exponentially weighted mean per measured (n, B); elsewhere a
    line in n at that B, or a bilinear fit a + b·n + c·B + d·n·B over every measured point. ``None`` when
    nothing supports an estimate yet (the policy then measures instead of guessing)."""

    decay: float = 0.8
    draft_per_token: float | None = None
    best_draft_per_token: float | None = None
    verify: dict[tuple[int, int], float] = field(default_factory=dict)

    def observe(self, proposed: int, draft_time: float, verify_time: float, batch_size: int,
                scored: int | None = None) -> None:
        """``proposed`` tokens took ``draft_time`` to draft; scoring ``scored`` (default proposed + 1) tokens per
        row for ``batch_size`` rows took ``verify_time``."""
        if proposed:
            per = draft_time / proposed
            # a step that also caught up on a backlog (the prompt, tokens emitted while speculation was off)
            # is not what drafting costs: clip at twice the best per-token time seen
            self.best_draft_per_token = min(per, self.best_draft_per_token or per)
            per = min(per, 2 * self.best_draft_per_token)
            self.draft_per_token = per if self.draft_per_token is None else _ewma(self.draft_per_token, per, self.decay)
            self.draft_per_token = min(self.draft_per_token, 2 * self.best_draft_per_token)
        key = (scored or proposed + 1, batch_size)
        self.verify[key] = verify_time if key not in self.verify else _ewma(self.verify[key], verify_time, self.decay)

    def draft_time(self, k: int) -> float:
        return k * (self.draft_per_token or 0.0)

    def verify_time(self, n: int, batch_size: int) -> float | None:
        if (n, batch_size) in self.verify:
            return self.verify[(n, batch_size)]
        here = [(m, t) for (m, b), t in self.verify.items() if b == batch_size]
        if len({m for m, _ in here}) >= 2:
            slope, intercept = _line(here)
            return max(intercept + slope * n, 1e-9)
        points = [(m, b, t) for (m, b), t in self.verify.items()]
        if len(points) >= 4 and len({m for m, _, _ in points}) >= 2 and len({b for _, b, _ in points}) >= 2:
            design = np.array([[1.0, m, b, m * b] for m, b, _ in points])
            coef, *_ = np.linalg.lstsq(design, np.array([t for *_, t in points]), rcond=None)
            return max(float(coef @ np.array([1.0, n, batch_size, n * batch_size])), 1e-9)
        return None


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope and intercept, in closed form (np.polyfit costs ~0.1 ms: too much per step)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return slope, my - slope * mx


def _ewma(old: float, new: float, decay: float) -> float:
    return decay * old + (1 - decay) * new


class CostModelPolicy(GammaPolicy):
    """Choose k in 0..max_gamma maximising expected_tokens(α, k) / (draft_time(k) + verify_time(k + 1)).

    α is estimated per request (decayed), starting from the proposer's running mean over earlier requests.
    Costs are measured, never assumed: at a batch size with no estimate it first runs a plain step (k = 0),
    then one drafted token (in one row of a batch), then decides. After ``probe_every`` steps at k = 0 it drafts one token once, so a
    proposer that starts paying again is noticed; each probe that changes nothing doubles the wait (up to
    16×), so probing costs little where speculation never pays. In a batch (``choose_batch``) it picks one k for the step,
    maximising the tokens all rows emit per second of the step, since every row waits for the longest draft
    and all drafting. ``costs`` may be replaced (tests use a controlled one).
    """

    name = "cost-model"

    def __init__(self, max_gamma: int = 8, decay: float = 0.8, prior_alpha: float = 0.6, probe_every: int = 16,
                 costs: MeasuredCosts | None = None):
        self.max_gamma, self.decay, self.prior_alpha, self.probe_every = max_gamma, decay, prior_alpha, probe_every
        self.costs = costs or MeasuredCosts(decay)
        self.alpha_by_proposer: dict[str, float] = {}
        self._batch_idle, self._batch_wait = 0, probe_every
        self._last_step: dict | None = None

    def _state(self, seq) -> dict:
        key = f"policy:{self.name}"
        if key not in seq.scratch:
            prior = self.alpha_by_proposer.get(seq.scratch.get("proposer", ""), self.prior_alpha)
            # α as decayed successes / trials; a step tries positions until its first rejection
            seq.scratch[key] = {"successes": prior, "trials": 1.0, "idle": 0, "wait": self.probe_every}
        return seq.scratch[key]

    def _alpha(self, seq) -> float:
        state = self._state(seq)
        return state["successes"] / state["trials"]

    def begin(self, seq):
        self._state(seq)

    def best_k(self, alpha: float, max_k: int, batch_size: int = 1) -> int:
        k = self._best([alpha], [max_k], batch_size)
        return 1 if k < 0 else k

    def _best(self, alphas: list[float], max_ks: list[int], batch_size: int) -> int:
        """The k (capped per row by max_ks) maximising the rows' expected tokens per second of one step."""
        cap = min(self.max_gamma, max(max_ks))
        if cap <= 0:
            return 0
        if self.costs.verify_time(1, batch_size) is None:
            return 0  # measure a plain step at this load first
        if self.costs.verify_time(cap + 1, batch_size) is None:
            return -1  # then the cheapest draft that measures a longer scoring pass (see _one_row)
        rates = []
        for k in range(cap + 1):
            ks = [min(k, m) for m in max_ks]
            tokens = sum(expected_tokens(a, kr) for a, kr in zip(alphas, ks))
            rates.append(tokens / (self.costs.draft_time(sum(ks)) + self.costs.verify_time(max(ks) + 1, batch_size)))
        # the smallest k within 1% of the best: measured costs are noisy, and drafting that buys nothing
        # should not win a tie
        best = max(rates)
        return next(k for k, r in enumerate(rates) if r >= 0.99 * best)

    def _probe(self, idle: int, wait: int, k: int, can_draft: bool) -> tuple[int, int, int]:
        """(k, idle, wait) after this choice: count idle steps, probe with k = 1 when the wait is over and
        double the wait for the next probe; any chosen k > 0 resets the wait."""
        if k > 0:
            return k, 0, self.probe_every
        if not can_draft:
            return 0, idle, wait
        idle += 1
        if idle >= wait:
            return 1, 0, min(2 * wait, 16 * self.probe_every)
        return 0, idle, wait

    def choose(self, seq, max_k):
        state = self._state(seq)
        k = self.best_k(self._alpha(seq), max_k, seq.scratch.get("batch_size", 1))
        k, state["idle"], state["wait"] = self._probe(state["idle"], state["wait"], k, max_k > 0)
        return k

    def choose_batch(self, seqs, max_ks):
        """One k for the whole step (each row capped by its own max_k); a measurement or a probe drafts one
        token in one row only (the likeliest to be accepted), which is all it needs to learn."""
        alphas = [self._alpha(s) for s in seqs]
        k = self._best(alphas, list(max_ks), len(seqs))
        if k < 0:
            return self._one_row(alphas, max_ks)
        idle = k == 0
        k, self._batch_idle, self._batch_wait = self._probe(self._batch_idle, self._batch_wait, k, max(max_ks) > 0)
        if idle and k > 0:  # a probe
            return self._one_row(alphas, max_ks)
        return [min(k, m) for m in max_ks]

    @staticmethod
    def _one_row(alphas: list[float], max_ks: list[int]) -> list[int]:
        ready = [j for j, m in enumerate(max_ks) if m > 0]
        ks = [0] * len(max_ks)
        if ready:
            ks[max(ready, key=lambda j: alphas[j])] = 1
        return ks

    def update(self, seq, proposed, accepted, draft_time, verify_time, batch_size=1):
        step = seq.scratch.get("batch_step")
        if step:  # in a batch: the step's costs once (every row reports the same step)
            if step is not self._last_step:
                self._last_step = step
                self.costs.observe(step["drafted"], step["draft_time"], step["verify_time"], step["batch_size"],
                                   step["scored"])
        else:
            self.costs.observe(proposed, draft_time, verify_time, batch_size)
        if proposed == 0:
            return
        state = self._state(seq)
        trials = accepted + (accepted < proposed)
        state["successes"] = self.decay * state["successes"] + accepted
        state["trials"] = self.decay * state["trials"] + trials
        observed = accepted / trials
        proposer = seq.scratch.get("proposer", "")
        self.alpha_by_proposer[proposer] = _ewma(self.alpha_by_proposer.get(proposer, self.prior_alpha),
                                                 observed, 0.95)


@hookimpl
def register_policies(register):
    register("fixed", FixedPolicy, "Always draft γ tokens (num_speculative_tokens).")
    register("heuristic", HeuristicPolicy, "HF's schedule: +2 after a fully accepted step, −1 otherwise.")
    register("cost-model", CostModelPolicy,
             "Maximise expected tokens/s from online α and measured draft/verify costs; may choose 0.")
