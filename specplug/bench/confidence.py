"""How sure a compare cell's figures are: a bootstrap interval for its speed-up, and the signs that the
machine was busy while it ran (a speed-up its own τ, c and v cannot explain; runs far slower than their
repeats of the same work). See docs/performance.md, "Reading compare's figures"."""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np

LEVEL = 0.95
RESAMPLES = 2000
SLOW = 1.3  # a run this much slower than the fastest repeat of the same work was slowed by something else
SLOW_SHARE = 0.25  # a cell is flagged when at least this share of its paired runs ran slow
OVER_BOUND = 1.2  # the loop's own savings cannot lift a speed-up this far above what τ, c and v allow
BUSY = "machine busy during this cell: rerun"


def speedup_interval(groups: Sequence[Sequence[float]], level: float = LEVEL, resamples: int = RESAMPLES,
                     seed: int = 0) -> tuple[float, float] | None:
    """A percentile-bootstrap interval for the median of the pooled values.

    ``groups`` holds one list per prompt (and sample) of its paired speed-ups, one per repeat: each resample
    draws prompts with replacement, then each drawn prompt's repeats with replacement, so the interval
    covers both how prompts differ and how repeats of one prompt differ. It always contains the median.
    """
    groups = [list(g) for g in groups if len(g)]
    if not groups:
        return None
    median = float(np.median(np.concatenate(groups)))
    rng = np.random.default_rng(seed)
    sizes = {len(g) for g in groups}
    if len(sizes) == 1:  # every prompt has as many repeats: one vectorised draw
        table = np.array(groups)
        n_groups, n_reps = table.shape
        picked = rng.integers(n_groups, size=(resamples, n_groups, 1))
        within = rng.integers(n_reps, size=(resamples, n_groups, n_reps))
        medians = np.median(table[picked, within].reshape(resamples, -1), axis=1)
    else:
        medians = np.array([np.median(np.concatenate([rng.choice(groups[j], size=len(groups[j]))
                                                      for j in rng.integers(len(groups), size=len(groups))]))
                            for _ in range(resamples)])
    low, high = np.quantile(medians, [(1 - level) / 2, (1 + level) / 2])
    return min(float(low), median), max(float(high), median)


def slowness(seconds: Mapping[Hashable, float], same_work: Mapping[Hashable, Hashable]) -> dict:
    """Each run's seconds over the fastest run of the same work (``same_work[run]``: its repeats share a
    key); 1.0 for a run with no repeat, since nothing then tells a slow spell from a long prompt."""
    fastest: dict = {}
    for run, s in seconds.items():
        key = same_work[run]
        fastest[key] = min(fastest.get(key, s), s)
    return {run: s / fastest[same_work[run]] if fastest[same_work[run]] > 0 else 1.0 for run, s in seconds.items()}


def speedup_bound(tokens_per_call: float | None, mean_gamma: float, c: float | None,
                  v: float | None) -> float | None:
    """The speed-up a cell's own figures allow: τ / (γ̄c + v), with v at least 1, since scoring γ + 1
    tokens never costs less than scoring one (a smaller measured v means target-only itself ran slow)."""
    if not tokens_per_call or v is None:
        return None
    return tokens_per_call / (mean_gamma * (c or 0.0) + max(v, 1.0))


def inconsistencies(speedup: float | None, bound: float | None, slow_runs: int, runs: int) -> list[str]:
    """Why a cell's figures cannot be trusted as measured, one reason each; empty when they can."""
    reasons = []
    if speedup is not None and bound is not None and speedup > OVER_BOUND * bound:
        reasons.append(f"speed-up {speedup:.2f}x > the {bound:.2f}x its τ, c and v allow")
    if runs and slow_runs / runs >= SLOW_SHARE:
        reasons.append(f"{slow_runs} of {runs} runs took ≥{SLOW - 1:.0%} longer than a repeat")
    return reasons
