"""γ policies: how many tokens to draft at each step. Plugins too (hook ``register_policies``).

A policy sees one request at a time (its state lives in ``seq.scratch``), chooses k before each step and is
told afterwards what happened. ``fixed`` always drafts γ; ``heuristic`` is HF's schedule (+2 after a fully
accepted step, −1 otherwise); ``cost-model`` picks the k that maximises expected emitted tokens per second
from online estimates of α and of the drafting and verification costs, and may pick 0 (no speculation).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from specplug.plugins.hookspecs import hookimpl

from .node_budgets import NodeBudgets
from .types import NODE_BUDGET, SequenceState


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
        _require(self.name, gamma=(gamma, 0), max_gamma=(max_gamma, 1))
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


def _require(policy: str, **ints: tuple[int, int]) -> None:
    """Each option an int at least its minimum: ``name=(value, minimum)``."""
    for name, (value, least) in ints.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{policy}: {name} must be an int >= {least}, got {value!r}")


def _require_share(policy: str, **shares: tuple[float, bool]) -> None:
    """Each option a number in (0, 1), or [0, 1] where ``name=(value, True)``."""
    for name, (value, closed) in shares.items():
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if not number or not (0 <= value <= 1 if closed else 0 < value < 1):
            raise ValueError(f"{policy}: {name} must lie in {'[0, 1]' if closed else '(0, 1)'}, got {value!r}")


REMEASURE_AFTER = 32  # steps at a batch size after which a measured scoring cost counts as stale
# a stale cost measured again at no less than this share of its estimate waits twice as long before it counts as
# stale again, up to PATIENCE_MAX times (MeasuredCosts.patience)
CONFIRMED, PATIENCE_MAX = 0.9, 16
# drafted tokens a row in the two measuring steps: 2, not 1, so the drafting line's first point already
# carries part of its slope (docs/policies.md, "Why it is built this way")
MEASURE_K = 2
# a choice that drafts is priced afresh at least every this many steps; in between the same rows keep their k.
# Pricing costs 0.25-0.6 ms a step (2-4% of a run, docs/policies.md), and in the replay a choice kept one step
# chose as well as one priced every step
REPRICE_EVERY = 2
# predicted gains within this share count as a tie (no drafting): measured costs are noisy
TIE = 0.01
# a pass longer than any measured lately is hoped to rise per token at this share of the flattest rise measured
# lately: exploring where it would need to be twice as cheap a token as any measured (some shapes hit faster
# kernels), not where it would need to cost nothing more (at B = 16 on a CPU every token costs arithmetic)
HOPE_RISE = 0.5
# a probe may draft in every row, its drafters catching up on what they missed, where that costs no more than
# this share of the plain steps since every row last drafted: so at most ~3% of the time speculation is off
CATCH_UP_SHARE = 1 / 32
PROPOSER_DECAY = 0.95  # weight of older steps in a proposer's running rates (across its requests)
REACH_RELAX = 0.99  # per step, a depth the policy did not ask for moves its reach this much less from 1
THEN_RELAX = 0.9  # per one-token draft, a later-token rate below the first-token rate keeps this much of the gap
# per step with speculation off, a row's first-token rate keeps this much of its gap to its proposer's running rate
OFF_RELAX = 0.95
LINE_DECAY = 0.95  # weight of older drafting steps in the fixed + per-pass fit (slower than α's: k must vary)


@dataclass
class _Line:
    """Decayed least squares of seconds = fixed + per_pass × passes over drafting steps."""

    w: float = 0.0
    n: float = 0.0
    nn: float = 0.0
    t: float = 0.0
    nt: float = 0.0

    def add(self, passes: int, seconds: float, decay: float = LINE_DECAY) -> None:
        self.w, self.n, self.nn = decay * self.w + 1, decay * self.n + passes, decay * self.nn + passes * passes
        self.t, self.nt = decay * self.t + seconds, decay * self.nt + passes * seconds

    def solve(self) -> tuple[float, float] | None:
        """(fixed, per_pass) by least squares with neither part negative, or None until the passes drafted vary
        enough to tell the parts apart. A drafter whose passes cost next to nothing (``ngram``: a lookup per
        row) fits a slope at or below 0 on noise: that is a flat cost, not one proportional to the passes."""
        mean_n, mean_t = self.n / self.w, self.t / self.w
        spread = self.nn / self.w - mean_n * mean_n
        if spread < 0.25:
            return None
        # for any slope the best fixed part puts the line through the mean, and the squares are convex in
        # the slope: the best slope with both parts >= 0 is the free one clamped to [0, mean_t / mean_n]
        per = min(max((self.nt / self.w - mean_n * mean_t) / spread, 0.0), mean_t / mean_n)
        return mean_t - per * mean_n, per

    def fit(self, shape: tuple[float, float] | None = None) -> tuple[float, float]:
        """(fixed, per_pass): solved where it can be; else the fixed share ``shape`` (another line's
        (fixed, per_pass)) has at this line's mean passes, at this line's level; else proportional."""
        solved = self.solve()
        if solved is not None:
            return solved
        mean_n, mean_t = self.n / self.w, self.t / self.w
        if shape is not None:
            share = shape[0] / (shape[0] + shape[1] * mean_n)
            return share * mean_t, (1 - share) * mean_t / mean_n
        return 0.0, mean_t / mean_n


def _memoised(method):
    """Within :meth:`MeasuredCosts.frozen`, each estimate is computed once per arguments (one choice asks for
    the same ones dozens of times)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        memo = self._memo
        if memo is None or kwargs:
            return method(self, *args, **kwargs)
        key = (method.__name__, *args)
        if key not in memo:
            memo[key] = method(self, *args)
        return memo[key]
    return wrapper


@dataclass
class MeasuredCosts:
    """Online cost estimates, measured, never assumed (``None`` until something supports an estimate; the
    policy then measures instead of guessing):

    - drafting: seconds of a step's drafting as a fixed part plus one per pass (one token in each of
      ``rows`` rows), by rows asked to draft; a per-row drafter costs ~rows passes, a batched one
      (``propose_batch``) much less. The fixed part is real: a step's first pass also feeds what the target
      accepted and finds the drafter's weights evicted by the target's pass, so a per-token average taken
      at one k overprices longer drafts and underprices shorter ones. Unseen row counts are interpolated
      (see :meth:`draft_time`).
    - scoring: seconds of the target's pass over n tokens per row at batch size B: a decayed mean per
      measured (n, B), made non-decreasing in n; between measured n interpolated, beyond them a line through
      the two nearest, at another B from the batch sizes around it, above them all a bilinear fit.
    """

    decay: float = 0.8
    draft_pass: dict[int, float] = field(default_factory=dict)  # seconds per pass, by rows
    draft_fixed: dict[int, float] = field(default_factory=dict)  # seconds a step takes on top, by rows
    _draft_lines: dict[int, _Line] = field(default_factory=dict)
    verify: dict[tuple[int, int], float] = field(default_factory=dict)
    # steps at batch size B since scoring n tokens a row was last measured there, by (n, B)
    age: dict[tuple[int, int], int] = field(default_factory=dict)
    # by (n, B): how many REMEASURE_AFTER windows that cost stays fresh; doubled each time a stale estimate is
    # measured again and confirmed (a kept policy re-explored dear passes every 32 steps, ~5% of a run at B = 16)
    patience: dict[tuple[int, int], int] = field(default_factory=dict)
    _memo: dict | None = field(default=None, repr=False, compare=False)

    @contextlib.contextmanager
    def frozen(self):
        """Memoise the estimates for the duration (nothing may be observed meanwhile): for one choice."""
        outer = self._memo is None
        if outer:
            self._memo = {}
        try:
            yield self
        finally:
            if outer:
                self._memo = None

    def observe(self, proposed: int, draft_time: float, verify_time: float, batch_size: int,
                scored: int | None = None, draft_clean: bool = True, draft_rows: int = 1,
                tokens: int | None = None) -> bool:
        """``draft_rows`` rows asked to draft (some may have found nothing to draft) drafted ``proposed`` tokens
        in ``scored - 1`` passes (default: one row, ``proposed`` passes) taking ``draft_time``; scoring
        ``scored`` tokens per row for ``batch_size`` rows took ``verify_time``, or, with ``tokens``, scoring
        that many over all rows (ragged rows: a probe's pass, one row drafting, costs about a plain step, not a
        pass of ``scored`` tokens in every row), counted as the even pass nearest it. ``draft_clean=False``: the
        drafting also paid for a backlog (the drafter's first step after steps without drafting: the prompt,
        tokens emitted meanwhile), so it is not a drafting cost. Returns whether the pass was news: not
        measured lately at this batch size (never, or stale)."""
        scored = scored or proposed + 1
        if proposed and draft_clean and scored > 1:
            passes = scored - 1
            line = self._draft_lines.setdefault(draft_rows, _Line())
            if line.w:  # clip outliers (a pause, a backlog the bookkeeping missed) at twice the estimate
                fixed, per = self.draft_fixed[draft_rows], self.draft_pass[draft_rows]
                draft_time = min(draft_time, 2 * (fixed + per * passes))
            line.add(passes, draft_time)
            self._fit_drafting()
        even = max(1, round(tokens / batch_size)) if tokens else scored
        key = (even, batch_size)
        expected = self._along_n(even, batch_size)
        if expected is not None:
            # a pause (the machine is shared) clipped at twice the estimate, as for drafting: one outlier
            # must not set k for the rest of a batch. Only an estimate from this batch size's own measurements
            # may clip: one carried over from other batch sizes is what this measurement corrects.
            verify_time = min(verify_time, 2 * expected)
        news = not self.is_fresh(*key)
        if key in self.verify and news:
            confirmed = verify_time >= CONFIRMED * self.verify[key]
            self.patience[key] = min(2 * self.patience.get(key, 1), PATIENCE_MAX) if confirmed else 1
        # an old estimate weighs less against a new measurement (one per 8 steps it sat unmeasured)
        keep = self.decay ** max(1.0, self.age.get(key, 0) / 8)
        self.verify[key] = verify_time if key not in self.verify else _ewma(self.verify[key], verify_time, keep)
        for other in self.verify:
            if other[1] == batch_size:
                self.age[other] = 0 if other == key else self.age.get(other, 0) + 1
        return news

    def _fit_drafting(self) -> None:
        """Each row count's line; one whose passes have not varied enough to solve takes its fixed share from
        the nearest row count's solved line (priced proportionally from one k, it could lock k where it is:
        docs/policies.md)."""
        solved = {r: fit for r, line in self._draft_lines.items() if (fit := line.solve()) is not None}
        for rows, line in self._draft_lines.items():
            if rows in solved:
                self.draft_fixed[rows], self.draft_pass[rows] = solved[rows]
                continue
            nearest = min(solved, key=lambda r: (abs(r - rows), r), default=None)
            fixed, per = line.fit(solved[nearest] if nearest is not None else None)
            self.draft_fixed[rows], self.draft_pass[rows] = fixed, per

    @_memoised
    def draft_time(self, k: int, rows: int = 1) -> float | None:
        """Seconds for ``rows`` rows to draft k tokens each; None before a clean measurement supports it.

        A pass over more rows costs no less (measured passes are made non-decreasing in rows) and at most
        proportionally more: unmeasured row counts are interpolated between the nearest measured ones, below
        them take the fewest rows' cost, above them scale it by rows (a line through two noisy neighbours
        can price a nearby pass at several times its cost)."""
        if k <= 0:
            return 0.0
        if not self.draft_pass:
            return None
        return _draft_at(self._draft_lines_by_rows(), k, rows)

    @_memoised
    def _draft_lines_by_rows(self) -> list[tuple[int, float, float]]:
        """Each measured row count's (rows, fixed, per pass), by rows."""
        return sorted((r, self.draft_fixed.get(r, 0.0), per) for r, per in self.draft_pass.items())

    def drafting_measured(self, rows: int) -> bool:
        """Whether drafting in this many rows is priced from measurements around it; above every measured row
        count :meth:`draft_time` scales the largest by rows, a bound that a batched drafter (``propose_batch``)
        stays far below, so a choice made on it alone must measure instead."""
        return bool(self.draft_pass) and rows <= max(self.draft_pass)

    @_memoised
    def _measured_at(self, batch_size: int) -> list[tuple[int, float]]:
        """Measured (n, seconds) at this batch size by n, made non-decreasing: scoring more tokens does not
        cost less, so a pass measured dearer than a longer one is estimated at the longer one's cost."""
        return non_decreasing([(m, t) for (m, b), t in self.verify.items() if b == batch_size])

    def _along_n(self, n: int, batch_size: int) -> float | None:
        """Scoring n tokens a row at this batch size from what was measured there alone: measured, between
        measured lengths interpolated, beyond the longest on the line through the two longest, no flatter than
        the line from the shortest to the longest (two noisy neighbours can lie on a nearly flat line that
        prices a pass twice as long at hardly more); None below the shortest (a line extrapolated down can
        reach 0 s) or with too little measured."""
        return _along(self._measured_at(batch_size), n)

    def _across(self, n: int, batch_size: int) -> float | None:
        """Scoring n tokens a row at this batch size from the nearest batch sizes measured: between two
        interpolated, below the smallest bounded by it (fewer rows never cost more); None above them all."""
        sizes = {b for _, b in self.verify}
        above = [(b, t) for b in sorted(b for b in sizes if b > batch_size)
                 if (t := self._along_n(n, b)) is not None][:1]
        if not above:
            return None
        below = [(b, t) for b in sorted((b for b in sizes if b < batch_size), reverse=True)
                 if (t := self._along_n(n, b)) is not None][:1]
        if not below:
            return above[0][1]
        (b0, t0), (b1, t1) = below[0], above[0]
        return t0 + (t1 - t0) * (batch_size - b0) / (b1 - b0)

    @_memoised
    def verify_time(self, n: int, batch_size: int) -> float | None:
        """Seconds to score n tokens per row at this batch size: measured; between measured lengths
        interpolated; beyond them on the line through the two nearest. Where too little was measured at this
        batch size: from the batch sizes around it (:meth:`_across`), scaled to the one length measured here if
        any; above every measured batch size from a bilinear fit a + b·n + c·B + d·n·B. None where nothing
        supports an estimate."""
        here = self._along_n(n, batch_size)
        if here is not None:
            return here
        # Rows finished (the tail of a wave) or joined: estimate from the batch sizes measured around this one
        # rather than measure every size a wave shrinks through; where one length was measured here, their
        # shape at its level.
        around = self._across(n, batch_size)
        mine = self._measured_at(batch_size)
        if around is not None:
            if mine:
                m, t = mine[0]
                ref = self._across(m, batch_size)
                if ref:
                    return around * t / ref
            return around
        if mine and n < mine[0][0]:
            return mine[0][1]  # fewer tokens never cost more than the fewest measured
        return self._fitted(n, batch_size)

    def _fitted(self, n: int, batch_size: int) -> float | None:
        """Scoring n tokens a row above every measured batch size: a bilinear fit a + b·n + c·B + d·n·B through
        everything measured, never below a measured pass with no more tokens and rows (scoring more never costs
        less); None where the points do not determine the fit (one length at one of two batch sizes leaves
        d free, and a free d can price a pass at nothing)."""
        points = [(m, b, t) for (m, b), t in self.verify.items()]
        if len(points) < 4:
            return None
        design = np.array([[1.0, m, b, m * b] for m, b, _ in points])
        coef, _, rank, _ = np.linalg.lstsq(design, np.array([t for *_, t in points]), rcond=None)
        if rank < 4:
            return None
        floor = max((t for m, b, t in points if m <= n and b <= batch_size), default=0.0)
        return max(float(coef @ np.array([1.0, n, batch_size, n * batch_size])), floor, 1e-9)

    def carried_over(self, batch_size: int) -> bool:
        """Whether drafted passes at this batch size are priced only from other batch sizes' measurements: passes
        were measured elsewhere, none longer than one token here."""
        return (any(b != batch_size for _, b in self.verify)
                and not any(n > 1 and b == batch_size for n, b in self.verify))

    def is_fresh(self, n: int, batch_size: int, stale_after: int = REMEASURE_AFTER) -> bool:
        """Whether scoring n tokens a row at this batch size was measured within the last ``stale_after``
        steps there."""
        key = (n, batch_size)
        return key in self.verify and self.age.get(key, 0) < stale_after * self.patience.get(key, 1)

    @_memoised
    def hopeful_verify_time(self, n: int, batch_size: int, stale_after: int = REMEASURE_AFTER) -> float | None:
        """The cheapest cost consistent with what was measured lately, for a pass not measured lately (never,
        or ``stale_after`` steps ago): between two passes that were, interpolated; beyond the longest, and at
        most twice as long as it, that one's cost rising at HOPE_RISE of the flattest rate per token measured
        lately between them (scoring more never costs less, and may cost hardly more: on a CPU with bf16
        products at B = 1, 9 tokens cost ~1.3 one-token steps; where every token was measured dear, as at B = 16
        on a CPU, a longer pass is no cheaper per token). Elsewhere :meth:`verify_time`. (One point of
        :meth:`verify_curve`, which prices choices.)"""
        return self.verify_curve(n, batch_size, stale_after)[n]

    @_memoised
    def _fresh_at(self, batch_size: int, stale_after: int) -> list[tuple[int, float]]:
        """:meth:`_measured_at` less the passes not measured within ``stale_after`` steps."""
        return [(m, t) for m, t in self._measured_at(batch_size) if self.is_fresh(m, batch_size, stale_after)]

    @_memoised
    def verify_curve(self, upto: int, batch_size: int, stale_after: int | None = None) -> tuple[float | None, ...]:
        """:meth:`verify_time` at this batch size for n = 0..upto, index n (0: None); with ``stale_after``,
        :meth:`hopeful_verify_time`. One choice prices every k from such a curve."""
        if stale_after is None:
            # where measured here, verify_time is _along_n: skip the detour
            along = _along_upto(self._measured_at(batch_size), upto)
            return (None, *(t if t is not None else self.verify_time(n, batch_size) for n, t in enumerate(along, 1)))
        curve, fresh = self.verify_curve(upto, batch_size), self._fresh_at(batch_size, stale_after)
        hopes = [None if self.is_fresh(n, batch_size, stale_after) else _hope(fresh, n) for n in range(1, upto + 1)]
        return (None, *(curve[n] if hope is None else hope for n, hope in enumerate(hopes, 1)))

    @_memoised
    def draft_curve(self, upto: int, rows: int) -> tuple[float | None, ...]:
        """:meth:`draft_time` for ``rows`` rows drafting k = 0..upto each, index k."""
        return tuple(self.draft_time(k, rows) for k in range(upto + 1))


def _draft_at(lines: list[tuple[int, float, float]], k: int, rows: int) -> float:
    """:meth:`MeasuredCosts.draft_time` of k >= 1 tokens in ``rows`` rows from each measured row count's
    (rows, fixed, per pass), sorted by rows."""
    measured = non_decreasing([(r, fixed + k * per) for r, fixed, per in lines])
    if rows <= measured[0][0]:
        return measured[0][1]
    inside = interpolated(measured, rows)
    if inside is not None:
        return inside
    top_rows, top = measured[-1]
    return top * rows / top_rows


def non_decreasing(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Points sorted by x, each y lowered to the smallest y at or beyond its x (a cost that cannot fall as
    x grows: a point above a later one is noise, or an odd kernel for that shape)."""
    points = sorted(points)
    for i in range(len(points) - 2, -1, -1):
        points[i] = (points[i][0], min(points[i][1], points[i + 1][1]))
    return points


def _along(here: list[tuple[int, float]], n: int) -> float | None:
    """:meth:`MeasuredCosts._along_n` on the (n, seconds) measured at one batch size, sorted and made
    non-decreasing (for a whole curve, the points are looked up once)."""
    if not here or n < here[0][0]:
        return None
    if n == here[0][0]:
        return here[0][1]
    inside = interpolated(here, n)
    return inside if inside is not None else _beyond(here, n)


def _beyond(here: list[tuple[int, float]], n: int) -> float | None:
    """:func:`_along` beyond the longest measured length: on the line through the two longest, no flatter than the
    line from the shortest to the longest; None with one point."""
    if len(here) < 2:
        return None
    (m0, t0), (m1, t1), (first, t_first) = *here[-2:], here[0]
    slope = max((t1 - t0) / (m1 - m0), (t1 - t_first) / (m1 - first))
    return t1 + slope * (n - m1)


def _along_upto(here: list[tuple[int, float]], upto: int) -> list[float | None]:
    """:func:`_along` for n = 1..upto, walking the points once: each n falls in the first segment (x0, x1) with
    x0 <= n <= x1, as :func:`interpolated` finds it, priced by the same arithmetic."""
    if not here:
        return [None] * upto
    (first, t_first), last = here[0], len(here) - 1
    out: list[float | None] = []
    seg = 0
    for n in range(1, upto + 1):
        if n <= first:
            out.append(t_first if n == first else None)
            continue
        while seg < last and here[seg + 1][0] < n:
            seg += 1
        if seg < last:
            (x0, y0), (x1, y1) = here[seg], here[seg + 1]
            out.append(y0 + (y1 - y0) * (n - x0) / (x1 - x0))
        else:
            out.append(_beyond(here, n))
    return out


def _hope(fresh: list[tuple[int, float]], n: int) -> float | None:
    """The cheapest plausible cost of scoring n tokens a row, from the passes measured lately (``fresh``,
    sorted): between two interpolated; beyond the longest shorter one, and at most twice its length, its
    cost rising at HOPE_RISE of the flattest rate measured lately (flat with one point); else None (see
    :meth:`MeasuredCosts.hopeful_verify_time`)."""
    shorter = [(m, t) for m, t in fresh if m < n]
    if shorter and any(m > n for m, _ in fresh):
        return interpolated(fresh, n)  # between two passes measured lately: no need to explore it
    if shorter and n <= 2 * shorter[-1][0]:
        m, t = shorter[-1]
        return t + HOPE_RISE * _flattest_rise(fresh) * (n - m)
    return None


def _flattest_rise(points: list[tuple[int, float]]) -> float:
    """The smallest rise in seconds per token between neighbouring points (sorted, non-decreasing); 0 for one."""
    return min(((t1 - t0) / (m1 - m0) for (m0, t0), (m1, t1) in zip(points, points[1:])), default=0.0)


def interpolated(points: list[tuple[int, float]], x: float) -> float | None:
    """Linear interpolation in sorted points, None outside them."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


@dataclass(frozen=True)
class Acceptance:
    """A request's acceptance as two rates: its first drafted token is accepted with probability ``first``,
    each later one, once the token before it was, with ``then``.

    Why two: drafts are accepted in streaks (a copied span matches from its first token or not at all; on
    the zoo, ngram's first token is kept 0.74 of the time and each later one 0.92), and one i.i.d. α priced
    long drafts too low after a few first-token rejections, switching drafting off where γ = 4 paid."""

    first: float
    then: float
    # reach[d - 1]: how often the proposer drafts at least d tokens when asked for d or more (ngram drafts
    # nothing without a match, and no further than its match); beyond the tuple, always
    reach: tuple[float, ...] = ()

    @classmethod
    def of(cls, value: "Acceptance | float") -> "Acceptance":
        """``value`` itself, or an i.i.d. α as the two equal rates."""
        return value if isinstance(value, Acceptance) else cls(float(value), float(value))

    def expected_upto(self, cap: int) -> list[float]:
        """Tokens a step asking for k drafts emits on average (the target's own token included), k = 0..cap."""
        return list(_expected_upto(self.first, self.then, self.reach, cap))

    def expected(self, k: int) -> float:
        """Tokens a step asking for k drafts emits on average."""
        return self.expected_upto(k)[k]

    def reach_upto(self, cap: int) -> list[float]:
        """How often a step asking for ``cap`` or more drafts d + 1 tokens or more, d = 0..cap - 1."""
        return list(_reach_upto(self.reach, cap))


# Cached: a batch prices every row's acceptance several times a step, and a row's rates stay put while it
# drafts nothing (speculation off), so most calls repeat one (first, then, reach, cap).
@functools.lru_cache(maxsize=4096)
def _expected_upto(first: float, then: float, reach: tuple[float, ...], cap: int) -> tuple[float, ...]:
    out, reached, survive = [1.0], 0.0, 1.0
    for d in range(cap):
        reached += (reach[d] if d < len(reach) else 1.0) * survive
        survive *= then
        out.append(1.0 + first * reached)
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _reach_upto(reach: tuple[float, ...], cap: int) -> tuple[float, ...]:
    return tuple(reach[d] if d < len(reach) else 1.0 for d in range(cap))


def _step_tokens(acceptances: list["Acceptance | float"], max_ks: list[int], cap: int) -> list[float]:
    """Expected tokens all rows emit in a step drafting k = 0..cap (each row capped by its max_k), computed
    once for a choice's two passes over k."""
    rows = []
    for acceptance, m in zip(acceptances, max_ks):
        row = Acceptance.of(acceptance).expected_upto(min(cap, m))
        row += [row[-1]] * (cap + 1 - len(row))  # asked beyond its max_k, a row drafts its max_k
        rows.append(row)
    # summed row by row in row order (as a running total would), k by k
    return [sum(column) for column in zip(*rows)] if rows else [0.0] * (cap + 1)


def _step_positions(acceptances: list["Acceptance | float"], max_ks: list[int], cap: int,
                    padded: bool = False) -> list[float]:
    """Positions per row the target's pass is expected to score in a step asking k = 0..cap (each row capped
    by its max_k): a proposer may draft fewer than asked (``ngram`` no further than its match), and the pass
    scores what was drafted. Ragged rows: the rows' mean (a pass is priced by its positions over all rows);
    ``padded`` rows: 1 + the expected longest draft, which every row is scored over."""
    # each row's reach by depth, 0 beyond its max_k (it drafts no deeper: adds nothing, exactly)
    reaches = [[*Acceptance.of(a).reach_upto(min(cap, m)), *[0.0] * (cap - min(cap, m))]
               for a, m in zip(acceptances, max_ks)]
    # per depth d + 1: the positions per row it adds to the pass when asked for
    if padded:  # scored in every row if any row drafts it
        at_depth = [1 - math.prod(1 - r for r in column) for column in zip(*reaches)]
    else:
        at_depth = [sum(column) / max(len(reaches), 1) for column in zip(*reaches)]
    at_depth += [0.0] * (cap - len(at_depth))  # no rows
    return [1.0, *(1.0 + added for added in itertools.accumulate(at_depth))]


def _between_passes(scoring: tuple[float | None, ...], positions: float) -> float | None:
    """The cost at a mean of ``positions`` per row on a curve ``scoring`` (index n: n positions per row), between
    the whole passes around it (a fraction of the steps score the longer one); None where either has none."""
    shorter = int(positions)
    low = scoring[shorter]
    if positions == shorter or low is None:
        return low
    high = scoring[shorter + 1]
    return None if high is None else low + (high - low) * (positions - shorter)


def _count(sums: list[float], successes: float, trials: float, decay: float) -> None:
    """Decay the [successes, trials] pair ``sums`` and add a step's counts."""
    sums[0], sums[1] = decay * sums[0] + successes, decay * sums[1] + trials


def _count_rates(first: list[float], then: list[float], accepted: int, proposed: int, decay: float) -> None:
    """Count a chain step into the first-token and later-token [successes, trials] pairs: later positions are
    tried only after an accepted first one, up to the first rejection."""
    _count(first, accepted > 0, 1.0, decay)
    if accepted and proposed > 1:
        _count(then, accepted - 1, accepted - 1 + (accepted < proposed), decay)


def _age(sums: list[float], steps: int, decay: float) -> None:
    """Decay the [successes, trials] pair ``sums`` for ``steps`` steps that measured nothing, down to one
    trial's weight at most: acceptance drifts along the text, so what was measured ages with the steps
    since, and a probe after a pause counts for more (though never a whole rate)."""
    if steps and sums[1] > 1.0:
        keep = max(decay ** steps, 1.0 / sums[1])
        sums[0], sums[1] = keep * sums[0], keep * sums[1]


def _relax(sums: list[float], toward: float, keep: float) -> None:
    """Move the rate of the [successes, trials] pair ``sums`` to ``toward`` by 1 − ``keep`` of the way, its weight
    unchanged."""
    sums[0] = keep * sums[0] + (1 - keep) * toward * sums[1]


def _ewma(old: float, new: float, decay: float) -> float:
    return decay * old + (1 - decay) * new


# what CostModelPolicy measures of one proposer (kept apart per proposer: CostModelPolicy._serve)
PER_PROPOSER = ("costs", "_batch_idle", "_batch_wait", "_batch_k", "_last_step", "_last_rows", "_probe_row",
                "_probing", "_empty_row", "_padded", "_catch_up", "_probe_all", "_probe_step", "_probe_accepted",
                "budgets", "_reuse_left", "_reuse_rows", "_off_steps")


class CostModelPolicy(GammaPolicy):
    """Choose k in 0..max_gamma maximising the expected tokens of a k-token draft over draft_time(k) + the
    scoring of the positions it is expected to draft (k + 1 for a proposer that always drafts what is asked).

    The expected tokens come from an :class:`Acceptance` estimated per request (decayed): how often its first
    drafted token is accepted, and how often each later one is once the one before it was; each starts from
    the proposer's running rates over earlier requests. (The single α, accepted over tried positions, is kept
    too: node budgets and reports read it.)
    Costs are measured, never assumed: at a batch size with no estimate (nothing measured there or at a
    larger batch size, which bounds it: see :meth:`MeasuredCosts.verify_time`), or drafting in more rows than
    ever measured, it first runs a plain step (k = 0) where the plain step is unmeasured, then MEASURE_K
    drafted tokens in every row, twice (the first pays the drafter's backlog), then decides; a k
    chosen on an extrapolated scoring cost is measured by that step and the choice revisited. Scoring cost
    is not linear in the tokens scored (bf16 products are nearly flat in the rows, some shapes hit slower
    kernels than longer ones), so where a draft would clearly win if its scoring pass, unmeasured or not
    measured for REMEASURE_AFTER steps while drafting, cost no more than a shorter pass measured lately plus
    HOPE_RISE of the flattest rise per token measured lately, it drafts that long to measure it — at most twice
    that shorter length, so a pass that proves dear costs a bounded step. It explores only while drafting: from
    off (a choice of k = 0, or a probe) such a step would make every row's drafter catch up on what it missed.
    Nor does it switch off at a batch size whose drafted passes are priced only from other batch sizes' (rows
    left the batch, :meth:`MeasuredCosts.carried_over`): off, it would never measure one there; it drafts.

    After ``probe_every`` steps at k = 0 it drafts one token once, so a proposer that starts paying again is
    noticed, and it switches back on only for a predicted gain above ``switch_on_margin`` (every drafter then
    catches up on what it missed); each probe that changes nothing doubles the wait (up to 16×). A probe whose
    proposer drafted nothing (``ngram`` without a match) tested nothing: the next step probes again, in a
    batch in another row, at no cost beyond a plain step. In a batch a probe drafts in one row, or, where
    every row's drafter catching up was measured to cost no more than a plain step, in every row
    (:meth:`_measure_from_off`) the length that would pay best on hope (:meth:`_probe_k`). Where the
    scoring cost alone rules drafting out even if every draft were accepted, it neither measures drafting
    nor probes: no α could change the choice (where a probe would measure every row, passes not measured
    lately count at their cheapest plausible cost: such a probe measures them again).

    In a batch (``choose_batch``) it picks one k for the step, maximising the tokens all rows emit per second
    of the step, since every row waits for the longest draft and all drafting; over ragged rows a row whose
    deeper drafts would not repay the positions they add drafts fewer, one at least (:meth:`_trimmed`), and
    each k is priced with its rows so trimmed.

    Everything it measures is the proposer's (by name): one policy kept across proposers (a server with several
    drafters, the load bench's warm cells) keeps each one's costs and on/off state apart.
    ``costs`` may be replaced (tests use a controlled one; it serves the first proposer seen).
    """

    name = "cost-model"

    def __init__(self, max_gamma: int = 8, decay: float = 0.8, prior_alpha: float = 0.6, probe_every: int = 16,
                 costs: MeasuredCosts | None = None, switch_on_margin: float = 0.1, rate_decay: float = 0.95):
        _require(self.name, max_gamma=(max_gamma, 0), probe_every=(probe_every, 1))
        _require_share(self.name, decay=(decay, False), rate_decay=(rate_decay, False), prior_alpha=(prior_alpha, True))
        if not switch_on_margin >= 0:
            raise ValueError(f"{self.name}: switch_on_margin must be >= 0, got {switch_on_margin!r}")
        self.max_gamma, self.decay, self.prior_alpha, self.probe_every = max_gamma, decay, prior_alpha, probe_every
        self.rate_decay = rate_decay
        self.switch_on_margin = switch_on_margin
        self._start_measuring(costs or MeasuredCosts(decay))
        self._serving: str | None = None  # the proposer the measurements below belong to
        self._set_aside: dict[str, dict] = {}  # other proposers' measurements, by name
        self.alpha_by_proposer: dict[str, float] = {}
        self.acceptance_by_proposer: dict[str, Acceptance] = {}
        self._reach: dict[str, list[list[float]]] = {}  # per proposer and depth: decayed [drafted, asked]
        self._reach_rates: dict[str, tuple[float, ...]] = {}  # their ratios, until the next count
        # decayed [accepted, tried] per proposer: all positions, first positions, later positions
        self._proposer_sums: dict[str, dict[str, list[float]]] = {}
        self._choices = 0  # choices priced so far: each row's state names the one its k came from

    def _start_measuring(self, costs: MeasuredCosts) -> None:
        """This proposer's measurements (:data:`PER_PROPOSER`), from nothing."""
        self.costs = costs
        self._batch_idle, self._batch_wait = 0, self.probe_every
        self._batch_k = 1  # the last batch choice, a probe counting as none (0: speculation is off)
        self._last_step: dict | None = None
        self._last_rows = 0  # rows that drafted in the previous batch step (rows beyond it had a backlog)
        self._probe_row = None  # the sequence the last one-row step drafted in (measured again, if it can)
        self._probing = False  # the last batch choice was a probe
        self._empty_row = None  # the row whose probe drafted nothing (the next probe tries another)
        self._padded = False  # the last batch step scored every row over its longest draft (HF's padded rows)
        self._catch_up: float | None = None  # drafting seconds per row with a backlog, in the last step with any
        self._probe_all = False  # the last batch choice was a probe drafting in every row
        self._off_steps = 0  # batch steps since every row last drafted (speculation on, or a probe in every row)
        self._probe_step: dict | None = None  # that probe's step, until the next choice weighs it
        self._probe_accepted = 0  # drafts that probe's rows had accepted
        self.budgets = NodeBudgets()  # tree-drafting proposers: the node budget (node_budgets)
        self._reuse_left, self._reuse_rows = 0, 0  # steps the last choice may still be kept, for how many rows

    def _serve(self, seq) -> None:
        """Measure for ``seq``'s proposer. Drafting costs, scoring costs and whether speculation is off belong to
        the proposer that was measured: a policy kept across proposers (one server, several drafters) keeps each
        one's measurements apart, as the acceptance rates already are."""
        proposer = seq.scratch.get("proposer", "")
        if proposer == self._serving:
            return
        if self._serving is not None:
            self._set_aside[self._serving] = {name: getattr(self, name) for name in PER_PROPOSER}
            kept = self._set_aside.pop(proposer, None)
            if kept is None:
                self._start_measuring(MeasuredCosts(self.decay))
            else:
                for name, value in kept.items():
                    setattr(self, name, value)
        self._serving = proposer

    def _state(self, seq) -> dict:
        key = f"policy:{self.name}"
        if key not in seq.scratch:
            proposer = seq.scratch.get("proposer", "")
            prior = self.alpha_by_proposer.get(proposer, self.prior_alpha)
            rates = self.acceptance_by_proposer.get(proposer, Acceptance(self.prior_alpha, self.prior_alpha))
            # rates as decayed successes / trials, each seeded with one trial at the proposer's rate; a step
            # tries positions until its first rejection
            seq.scratch[key] = {"successes": prior, "trials": 1.0, "first": [rates.first, 1.0],
                                "then": [rates.then, 1.0], "idle": 0, "wait": self.probe_every}
        return seq.scratch[key]

    def _alpha(self, seq) -> float:
        state = self._state(seq)
        return state["successes"] / state["trials"]

    def _acceptance(self, seq) -> Acceptance:
        state = self._state(seq)
        (first, tried), (then, later) = state["first"], state["then"]
        proposer = seq.scratch.get("proposer", "")
        reach = self._reach_rates.get(proposer)
        if reach is None:  # every row of a batch shares it: computed once a step, not once a row
            reach = self._reach_rates[proposer] = tuple(got / asked for got, asked in self._reach.get(proposer, []))
        return Acceptance(first / tried, then / later, reach)

    def _count_reach(self, seq, asked: int, proposed: int) -> None:
        """How far the proposer drafted against how far it was asked, per depth (decayed); a depth not asked
        for relaxes back towards always reaching (its seed), so a few short drafts cannot keep k below it
        for good: only asking that deep again would count it (docs/policies.md)."""
        proposer = seq.scratch.get("proposer", "")
        self._reach_rates.pop(proposer, None)
        reach = self._reach.setdefault(proposer, [])
        reach += [[1.0, 1.0] for _ in range(asked - len(reach))]  # seeded as always reaching
        for d, sums in enumerate(reach):  # as _count for the depths asked, every row of a batch: inlined
            if d < asked:
                sums[0], sums[1] = PROPOSER_DECAY * sums[0] + (proposed > d), PROPOSER_DECAY * sums[1] + 1.0
            else:
                sums[0] = REACH_RELAX * sums[0] + (1 - REACH_RELAX) * sums[1]

    def begin(self, seq):
        self._serve(seq)
        self._state(seq)

    def best_k(self, acceptance: Acceptance | float, max_k: int, batch_size: int = 1, off: bool = False) -> int:
        """The k one request with this acceptance (an i.i.d. α, or two rates) drafts now; ``off``: speculation
        is off (the last choice was no drafting, or a probe)."""
        return self._one_request(acceptance, max_k, batch_size, off)[0]

    def _one_request(self, acceptance: Acceptance | float, max_k: int, batch_size: int,
                     off: bool) -> tuple[int, bool]:
        """(k, whether that k measures costs rather than being chosen on them) for one request."""
        k, _ = self._best([acceptance], [max_k], batch_size, off)
        return (min(MEASURE_K, max_k), True) if k < 0 else (k, False)

    def _best(self, acceptances: list[Acceptance | float], max_ks: list[int], batch_size: int,
              off: bool = False, trim: bool = False) -> tuple[int, list[int] | None]:
        """The k (capped per row by max_ks) maximising the rows' expected tokens per second of one step (-1:
        measure), and each row's k for it where it priced the step (else None); with ``trim`` each step is
        priced with its rows trimmed (:meth:`_trimmed`), as it would be drafted."""
        cap = min(self.max_gamma, max(max_ks))
        if cap <= 0:
            return 0, None
        scoring = self.costs.verify_curve(cap + 1, batch_size, None)  # as _rates asks for it: one memo entry
        if scoring[1] is None:
            return 0, None  # measure a plain step at this load first
        rows = sum(1 for m in max_ks if m > 0)
        if scoring[cap + 1] is None or not self.costs.drafting_measured(rows):
            if not self._could_pay(max_ks, batch_size, hopeful=True):
                return 0, None  # the scoring cost alone rules drafting out: no need to measure drafting
            # then drafting that measures a longer scoring pass and what drafting in these rows costs:
            # MEASURE_K tokens in each, twice in a row, since the first also pays the drafter's backlog
            return -1, None
        tokens = _step_tokens(acceptances, max_ks, cap)
        positions = _step_positions(acceptances, max_ks, cap, self._padded)
        rates = [r or 0.0 for r in self._rates(tokens, max_ks, batch_size, cap, positions=positions)]
        ks = [[min(k, m) for m in max_ks] for k in range(cap + 1)]
        if trim:
            # a step's rows trimmed at its untrimmed rate, then the step priced as trimmed: one k for the
            # step where only the rows that repay it draft deep (ragged rows)
            rows = [(a.expected_upto(cap), a.reach_upto(cap)) for a in map(Acceptance.of, acceptances)]
            for k in range(2, cap + 1):
                depths = self._trimmed(rows, ks[k], rates[k], batch_size, scoring)
                if depths != ks[k]:
                    # _step_tokens / _step_positions (ragged) at these depths, from the rows in hand: calling
                    # them per k cost ~15% more choosing time for the same numbers
                    ks[k], tokens[k] = depths, sum(at[d] for (at, _), d in zip(rows, depths))
                    positions[k] = 1.0 + sum(sum(reach[:d]) for (_, reach), d in zip(rows, depths)) / len(rows)
            rates = [r or 0.0 for r in self._rates(tokens, max_ks, batch_size, cap, positions=positions)]
        k = self._chosen(rates, tokens, positions, max_ks, batch_size, cap, off)
        return k, ks[k]

    def _chosen(self, rates: list[float], tokens: list[float], positions: list[float], max_ks: list[int],
                batch_size: int, cap: int, off: bool) -> int:
        """The k among 0..cap a step drafts given its priced ``rates`` (see :meth:`_best`): switching on only for
        a clear gain, exploring a pass not measured lately where it could win clearly, no drafting on a tie."""
        best = max(rates)
        if off:
            # With speculation off only probes spend steps: exploring would make every row's drafter catch up on
            # what it missed (a prompt's worth in a new row), a price no pass that might prove cheap repays.
            # Switching on makes them catch up too: a small predicted gain would not repay that (and would
            # flap on noise). Where catching up was measured cheap (ngram, suffix) it costs nothing to repay,
            # and staying off loses what drafting would win: only a tie keeps it off.
            margin = TIE if self._measure_from_off(batch_size) else self.switch_on_margin
            return 0 if best < (1 + margin) * rates[0] else rates.index(best)
        # Explore a draft whose scoring pass was not measured lately (never, or REMEASURE_AFTER steps ago) if
        # it would clearly win were that pass no dearer than a shorter one measured lately plus HOPE_RISE of the
        # flattest rise per token measured lately (hopeful_verify_time): a line through short passes misjudges
        # long ones both ways, and a measurement never repeated can lock in a pause. Each such step at most
        # doubles a measured length.
        hopeful = [r or 0.0 for r in self._rates(tokens, max_ks, batch_size, cap, REMEASURE_AFTER, positions)]
        explore = max(range(cap + 1), key=lambda k: hopeful[k])
        longest = math.ceil(positions[explore])  # the longer pass a step asking that many scores
        if not self.costs.is_fresh(longest, batch_size) and hopeful[explore] > (1 + self.switch_on_margin) * best:
            return explore
        # No drafting where it is within TIE of the best: measured costs are noisy, and drafting that buys
        # nothing should not win a tie. Among drafting lengths the best predicted, with no margin (one drafts
        # too short: docs/policies.md). An extrapolated scoring cost is measured by running it.
        # Not where this batch size's drafted passes are priced only from other batch sizes' (rows left a
        # batch): switched off on such an estimate it would never measure one here; drafting measures it.
        carried = getattr(self.costs, "carried_over", None)
        if rates[0] >= (1 - TIE) * best and not (carried is not None and carried(batch_size)):
            return 0
        return max(range(1, len(rates)), key=lambda k: rates[k])

    def _rates(self, tokens: list[float], max_ks: list[int], batch_size: int, cap: int,
               stale_after: int | None = None, positions: list[float] | None = None) -> list[float | None]:
        """Expected tokens per second of a step for k = 0..cap (``tokens[k]``: the rows' expected tokens, see
        :func:`_step_tokens`; unmeasured drafting counted as free), its pass priced at ``positions[k]`` per row
        (see :func:`_step_positions`; default k + 1); None where that pass has no estimate. With
        ``stale_after``, scoring passes not measured within that many steps at their cheapest plausible cost
        (``hopeful_verify_time``)."""
        scoring = self.costs.verify_curve(cap + 1, batch_size, stale_after)
        rows = sum(1 for m in max_ks if m > 0)
        # hopeful pricing counts drafting in more rows than ever measured as unmeasured (free), not at the
        # proportional bound: a batched drafter measured in one row would otherwise never be measured in many
        hopeful = stale_after is not None and not self.costs.drafting_measured(rows)
        drafting = (0.0,) * (cap + 1) if hopeful else self.costs.draft_curve(cap, rows)
        rates = []
        for k in range(cap + 1):  # k <= cap <= the largest max_k: the longest draft is k
            seconds = _between_passes(scoring, k + 1 if positions is None else positions[k])
            rates.append(None if seconds is None else tokens[k] / ((drafting[k] or 0.0) + seconds))
        return rates

    def _could_pay(self, max_ks: list[int], batch_size: int, hopeful: bool = False) -> bool:
        """Whether drafting could beat plain steps by the switch-on margin here if every draft were accepted
        (with ``hopeful``: and unmeasured longer passes cost no more than the longest measured one).

        If not, no α can make speculation pay at this batch size, so measuring drafting or probing α would
        cost steps and change nothing. Unknown (True) while only plain steps are measured."""
        cap = min(self.max_gamma, max(max_ks, default=0))
        if cap <= 0 or self.costs.verify_time(2, batch_size) is None:
            return cap > 0
        rates = self._rates(_step_tokens([1.0] * len(max_ks), max_ks, cap), max_ks, batch_size, cap,
                            REMEASURE_AFTER if hopeful else None)
        if None in rates:
            return True  # a pass with no estimate yet: unknown
        return max(rates[1:]) > (1 + self.switch_on_margin) * rates[0]

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

    def _frozen(self):
        """Costs memoised for one choice (a replaced ``costs`` object may not offer it)."""
        frozen = getattr(self.costs, "frozen", None)
        return frozen() if frozen is not None else contextlib.nullcontext()

    def choose(self, seq, max_k):
        self._serve(seq)
        kept = self._kept_choice([seq], [max_k])
        if kept is not None:
            self._state(seq)["asked"] = kept[0]
            return kept[0]
        with self._frozen():
            return self._choose(seq, max_k)

    def _choose(self, seq, max_k):
        state = self._state(seq)
        batch_size = seq.scratch.get("batch_size", 1)
        off = state.get("k", 1) == 0
        if off:
            self._relax_while_off([seq], batch_size)
        k, measuring = self._one_request(self._acceptance(seq), max_k, batch_size, off)
        can_probe = k == 0 and self._could_pay([max_k], batch_size)
        k, state["idle"], state["wait"] = self._probe(state["idle"], state["wait"], k, can_probe)
        state["probing"] = can_probe and k > 0
        state["k"] = 0 if state["probing"] else k  # the choice, a probe being none: speculation stays off
        tree = bool(seq.scratch.get("max_node_budget"))
        if tree:
            k = self._with_budget([seq], [max_k], batch_size, [k], state["probing"])[0]
        self._keep_choice([seq], [k], not (measuring or state["probing"] or tree))
        state["asked"] = k
        return k

    def _kept_choice(self, seqs, max_ks: list[int]) -> list[int] | None:
        """The last choice's k for each row (capped by its max_k) while it may be kept: for REPRICE_EVERY - 1
        steps after it was priced, and only for the very rows it was priced for."""
        if (self._reuse_left <= 0 or len(seqs) != self._reuse_rows
                or any(self._state(s).get("choice") != self._choices for s in seqs)):
            return None
        self._reuse_left -= 1
        return [min(self._state(s)["chosen"], m) for s, m in zip(seqs, max_ks)]

    def _keep_choice(self, seqs, ks: list[int], keep: bool) -> None:
        """Count a priced choice and let its rows keep their k for the next REPRICE_EVERY - 1 steps where
        ``keep``: it drafts, and neither measures nor probes nor drafts trees (those steps' choices follow from
        what they find). A pass measured for the first time, or again after a while, ends the keeping
        (:meth:`update`): a choice priced on an estimate is decided again on the measurement."""
        self._choices += 1
        keep = keep and any(ks)
        self._reuse_left, self._reuse_rows = (REPRICE_EVERY - 1, len(seqs)) if keep else (0, 0)
        for seq, k in zip(seqs, ks):
            state = self._state(seq)
            state["choice"], state["chosen"] = self._choices, k

    def _with_budget(self, seqs, max_ks: list[int], batch_size: int, ks: list[int], probing: bool) -> list[int]:
        """Each row's k after choosing the step's node budget (written to NODE_BUDGET; 0: chains) for a
        tree-drafting proposer: a tree where it is predicted to beat the chosen chain (see
        :mod:`specplug.node_budgets`), never in a probe or a measuring step."""
        budget, k = 0, max(ks)
        max_ks = [min(m, self.max_gamma) for m in max_ks]
        measured = k > 0 and self.costs.verify_time(k + 1, batch_size) is not None
        if measured and not probing and self.costs.draft_time(1, sum(1 for m in max_ks if m > 0)) is not None:
            alphas = [self._alpha(s) for s in seqs]
            cap = min(self.max_gamma, max(max_ks))
            acceptances = [self._acceptance(s) for s in seqs]
            tokens = _step_tokens(acceptances, max_ks, cap)
            positions = _step_positions(acceptances, max_ks, cap, self._padded)
            rate = self._rates(tokens, max_ks, batch_size, cap, positions=positions)[min(k, cap)] or 0.0
            budget, k = self.budgets.choose(seqs, alphas, max_ks, batch_size, k, rate, self.costs,
                                            self.costs.draft_time)
        for s in seqs:
            s.scratch[NODE_BUDGET] = budget
        return ks if budget == 0 else [min(k, m) for m in max_ks]

    def choose_batch(self, seqs, max_ks):
        """One k for the whole step (each row capped by its own max_k); a probe drafts one token in one row
        only (the likeliest to be accepted), which is all it needs to learn whether α has changed, unless
        drafting in every row costs hardly more (see :meth:`_measure_from_off`)."""
        if seqs:
            self._serve(seqs[0])  # a batch's rows share one proposer
        if not any(m > 0 for m in max_ks):
            # no row may draft (each at its last token): not a choice, so speculation stays on or off as it was;
            # counted as off, the last step of every wave left the next wave to switch on against the margin
            ks = [0] * len(seqs)
        elif (kept := self._kept_choice(seqs, list(max_ks))) is not None:
            ks = kept
        else:
            with self._frozen():
                ks = self._choose_batch(seqs, max_ks)
        for seq, k in zip(seqs, ks):
            self._state(seq)["asked"] = k
        return ks

    def _choose_batch(self, seqs, max_ks):
        self._weigh_probe()
        if self._batch_k == 0:
            self._relax_while_off(seqs, len(seqs))
        acceptances = [self._acceptance(s) for s in seqs]
        tree = bool(seqs[0].scratch.get("max_node_budget"))
        k, trimmed = self._best(acceptances, list(max_ks), len(seqs), self._batch_k == 0, trim=not tree)
        if k < 0:  # measuring
            self._batch_k = MEASURE_K
            ks = [min(MEASURE_K, m) for m in max_ks]
            self._keep_choice(seqs, ks, False)
            return self._with_budget(seqs, max_ks, len(seqs), ks, True) if tree else ks
        idle = k == 0
        # a probe that measures every row may check passes not measured lately; one in one row cannot (it
        # scores a plain pass), so it is spent only where the measured costs leave room for a gain
        measuring = idle and self._probe_in_every_row(len(seqs))
        can_probe = idle and self._could_pay(list(max_ks), len(seqs), hopeful=measuring)
        k, self._batch_idle, self._batch_wait = self._probe(self._batch_idle, self._batch_wait, k, can_probe)
        self._probing = idle and k > 0
        self._batch_k = 0 if self._probing else k
        self._probe_all = self._probing and measuring
        self._off_steps = self._off_steps + 1 if idle and not self._probe_all else 0
        if self._probe_all:
            k = self._probe_k(acceptances, list(max_ks), len(seqs))
            ks = [min(k, m) for m in max_ks]
        elif self._probing:
            ks = self._one_row(seqs, [a.first for a in acceptances], max_ks)
        else:
            ks = trimmed if trimmed is not None else [min(k, m) for m in max_ks]
        self._keep_choice(seqs, ks, not (self._probing or tree))
        return self._with_budget(seqs, max_ks, len(seqs), ks, self._probing) if tree else ks

    def _relax_while_off(self, seqs, batch_size: int) -> None:
        """With speculation off nothing measures a row's acceptance while the text moves on (``ngram``'s first
        tokens are rejected in runs, then a repeated stretch of code accepts whole drafts): each step off moves
        the row's first-token rate 1 − OFF_RELAX of the way to its proposer's running rate, its weight
        unchanged. A row that went off on a bad stretch drafts again once the proposer's usual rate would pay,
        instead of waiting for a probe that lands in a good stretch (docs/policies.md, session 47). Only where
        every drafter catching up was measured cheap (:meth:`_measure_from_off`): a model drafter's switch back
        on costs a catch-up in every row, which only measured acceptance may buy ("Off means off")."""
        if not self._measure_from_off(batch_size):
            return
        for seq in seqs:
            running = self.acceptance_by_proposer.get(seq.scratch.get("proposer", ""))
            if running is not None:
                _relax(self._state(seq)["first"], running.first, OFF_RELAX)

    def _trimmed(self, rows: list[tuple[list[float], list[float]]], ks: list[int], rate: float, batch_size: int,
                 scoring: tuple[float | None, ...]) -> list[int]:
        """Each row's k after dropping its deepest drafts where the tokens they are expected to add fall below
        what the positions they add cost at the step's ``rate``, in tokens per second (ragged rows score each
        row's own draft); a row keeps one token at least, so every row's rates are measured at each drafting
        step (rows left at 0 came back late: docs/policies.md). ``rows``: each row's expected tokens by k asked
        and reach by depth (:meth:`Acceptance.expected_upto`, :meth:`Acceptance.reach_upto`), up to its k
        at least; ``scoring``: the pass's cost by positions per row (:meth:`MeasuredCosts.verify_curve`)."""
        k = max(ks, default=0)
        longest, plain = scoring[k + 1], scoring[1]
        if (k < 2 or self._padded or not rate or longest is None or plain is None
                or not self.costs.is_fresh(k + 1, batch_size)):
            # padded rows score every row over the longest draft: a shorter one saves nothing; a longest pass
            # not measured lately is measured by this step (a step exploring it, or a stale estimate)
            return ks
        per_position = max(longest - plain, 0.0) / (k * batch_size)
        trimmed = []
        threshold = rate * per_position
        for (tokens_at, reach), row_k in zip(rows, ks):
            depth = min(row_k, 1)
            # the d + 1-th draft adds tokens_at[d + 1] - tokens_at[d] and, where drafted, one position
            while depth < row_k and tokens_at[depth + 1] - tokens_at[depth] >= threshold * reach[depth]:
                depth += 1
            trimmed.append(depth)
        return trimmed

    def _weigh_probe(self) -> None:
        """After a probe in every row: one that paid for itself (its rows' tokens per second of its step no fewer
        than a plain step's) is repeated after ``probe_every`` steps, undoing the doubled wait. Acceptance
        that rises along a request (``ngram``: 0.2 over its first 16 tokens, ~0.8 from the 48th) is then
        caught within a few probes; where probes lose, the wait doubles as before, bounding what they cost."""
        step, self._probe_step = self._probe_step, None
        if step is None:
            return
        rows = step["batch_size"]
        plain = self.costs.verify_time(1, rows)
        if plain and (rows + self._probe_accepted) * plain >= rows * (step["draft_time"] + step["verify_time"]):
            self._batch_wait = self.probe_every

    def _probe_k(self, acceptances: list[Acceptance], max_ks: list[int], batch_size: int) -> int:
        """The k a probe drafting in every row asks: the drafting length that would pay best were passes not
        measured lately at their hopeful cost (:meth:`MeasuredCosts.hopeful_verify_time`), MEASURE_K at least.
        Such a probe measures the pass a switch back on would use, not only the short one measured at the
        start, on whose line a longer pass is often priced too high to ever switch on."""
        cap = min(self.max_gamma, max(max_ks))
        tokens = _step_tokens(acceptances, max_ks, cap)
        positions = _step_positions(acceptances, max_ks, cap, self._padded)
        hopeful = [r or 0.0 for r in self._rates(tokens, max_ks, batch_size, cap, REMEASURE_AFTER, positions)]
        return max(MEASURE_K, max(range(1, cap + 1), key=lambda k: hopeful[k]))

    def _measure_from_off(self, batch_size: int, plain_steps: float = 1.0) -> bool:
        """Whether all rows' drafters catching up (``_catch_up`` per row, from the last step with a backlog) was
        measured to cost no more than ``plain_steps`` plain steps. At one (``ngram``, ``suffix``) there is nothing
        for a switch back on to repay: any gain beyond a tie switches speculation on (:meth:`_chosen`), and
        every probe drafts in every row (:meth:`_probe_in_every_row`)."""
        plain = self.costs.verify_time(1, batch_size)
        return (self._catch_up is not None and plain is not None
                and batch_size * self._catch_up <= plain_steps * plain)

    def _probe_in_every_row(self, batch_size: int) -> bool:
        """Whether this probe drafts :meth:`_probe_k` tokens in every row instead of one token in one row: where
        catching up costs no more than a plain step, or than CATCH_UP_SHARE of the plain steps since every row
        last drafted. Such a probe measures a drafted pass and every row's rates; over ragged rows a one-row
        probe scores a plain pass and one row, so a drafted pass measured dear on a slow spell, or a few early
        rejections in the other rows, kept speculation off for good. Where catching up is dear (a model
        drafter, under load) probes stay in one row until then ("Off means off", docs/policies.md)."""
        return self._measure_from_off(batch_size, max(1.0, CATCH_UP_SHARE * self._off_steps))

    def _one_row(self, seqs, firsts: list[float], max_ks: list[int]) -> list[int]:
        """k = 1 in one row: the one measured last step if it can draft (its drafter has no backlog), else the
        likeliest to have its first token accepted (``firsts``)."""
        ready = [j for j, m in enumerate(max_ks) if m > 0]
        ready = [j for j in ready if seqs[j] is not self._empty_row] or ready
        ks = [0] * len(max_ks)
        if ready:
            again = [j for j in ready if seqs[j] is self._probe_row]
            j = again[0] if again else max(ready, key=lambda j: firsts[j])
            ks[j], self._probe_row = 1, seqs[j]
        return ks

    def update(self, seq, proposed, accepted, draft_time, verify_time, batch_size=1):
        self._serve(seq)
        step = seq.scratch.get("batch_step")
        state = self._state(seq)
        shape = seq.scratch.get("drafted_tree")  # (nodes, depth) of a tree step, None for a chain
        if step:  # in a batch: the step's costs once (every row reports the same step)
            if step is not self._last_step:
                self._observe_batch_step(step)
            if step is self._probe_step:
                self._probe_accepted += accepted
        else:
            if self.costs.observe(proposed, draft_time, verify_time, batch_size, None,
                                  state.get("drafted", 0) > 0 and shape is None):
                self._reuse_left = 0
            state["drafted"] = proposed
            if state.pop("probing", False) and proposed == 0:  # probe again next step
                state["wait"] = max(self.probe_every, state["wait"] // 2)
                state["idle"] = state["wait"]
        if shape is None and state.get("asked"):
            self._count_reach(seq, state["asked"], proposed)
        if proposed == 0:
            # a step that did not ask measured nothing while the text moved on (asked, a proposer drafting
            # nothing measured its reach)
            state["unmeasured"] = state.get("unmeasured", 0) + (not state.get("asked"))
            return
        unmeasured = state.pop("unmeasured", 0)
        for rate in (state["first"], state["then"]):
            _age(rate, unmeasured, self.rate_decay)
        if shape is not None:
            nodes, depth = shape
            budget = seq.scratch.get(NODE_BUDGET) or nodes  # a tree the policy did not ask for: keyed by its size
            self.budgets.observe(seq, budget, accepted, nodes, depth, draft_time)
            return
        if seq.scratch.get("max_node_budget"):
            self.budgets.observe(seq, 0, accepted, proposed, proposed, draft_time)
        self._count_acceptance(seq, state, accepted, proposed)

    def _observe_batch_step(self, step: dict) -> None:
        """A batched step's costs and probing outcome, taken once from the first of its rows to report."""
        self._last_step = step
        # drafting is a clean measurement only if no row's drafter had a backlog to catch up on (a row that
        # joined brings its whole prompt)
        clean = step["backlog_rows"] == 0 if "backlog_rows" in step else self._last_rows >= step["draft_rows"]
        clean = clean and not step.get("tree_rows")  # a tree's drafting is no point on the chain's line
        # drafting is priced by the rows asked: each ran its drafter, also one that found nothing to draft
        asked = step.get("asked_rows", step["draft_rows"])
        if self.costs.observe(step["drafted"], step["draft_time"], step["verify_time"], step["batch_size"],
                              step["scored"], clean, asked, step.get("tokens")):
            self._reuse_left = 0
        self._last_rows = step["draft_rows"]
        if step.get("backlog_rows"):
            self._catch_up = step["draft_time"] / step["backlog_rows"]
        self._padded = step.get("padded", False)
        self._empty_row = None
        if self._probing and step["drafted"] == 0:  # probe again next step, in another row
            self._batch_wait = max(self.probe_every, self._batch_wait // 2)
            self._batch_idle, self._empty_row, self._probe_row = self._batch_wait, self._probe_row, None
        elif self._probe_all:
            self._probe_step, self._probe_accepted = step, 0

    def _count_acceptance(self, seq, state: dict, accepted: int, proposed: int) -> None:
        """A chain step's acceptance into the request's rates and its proposer's running rates."""
        trials = accepted + (accepted < proposed)
        state["successes"] = self.decay * state["successes"] + accepted
        state["trials"] = self.decay * state["trials"] + trials
        _count_rates(state["first"], state["then"], accepted, proposed, self.rate_decay)
        first = state["first"][0] / state["first"][1]
        if proposed == 1 and state["then"][0] < first * state["then"][1]:
            # a one-token draft never measures the later-token rate that chose it: a low reading would stick
            _relax(state["then"], first, THEN_RELAX)
        # the proposer's running rates, ratios of decayed sums as per request: a mean of per-step ratios
        # accepted / trials is biased low
        proposer = seq.scratch.get("proposer", "")
        sums = self._proposer_sums.get(proposer)
        if sums is None:
            sums = self._proposer_sums[proposer] = {part: [self.prior_alpha, 1.0] for part in ("all", "first", "then")}
        _count(sums["all"], accepted, trials, PROPOSER_DECAY)
        _count_rates(sums["first"], sums["then"], accepted, proposed, PROPOSER_DECAY)
        self.alpha_by_proposer[proposer] = sums["all"][0] / sums["all"][1]
        self.acceptance_by_proposer[proposer] = Acceptance(*(sums[p][0] / sums[p][1] for p in ("first", "then")))


@hookimpl
def register_policies(register):
    register("fixed", FixedPolicy, "Always draft γ tokens (num_speculative_tokens).")
    register("heuristic", HeuristicPolicy, "HF's schedule: +2 after a fully accepted step, −1 otherwise.")
    register("cost-model", CostModelPolicy,
             "Maximise expected tokens/s from online α and measured draft/verify costs; may choose 0.")
