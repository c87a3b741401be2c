"""Per-request speculation metrics (vLLM's names where they exist) and their aggregation."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def expected_tokens(alpha: float, k: float) -> float:
    """Tokens a step emits on average when each of k drafts is accepted with probability α (bonus included)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: float, c: float, verify_cost: float = 1.0) -> float:
    """Leviathan et al.'s expected speed-up (1 - α^(γ+1)) / ((1 - α)(γc + 1)).

    ``verify_cost`` is the target's scoring pass over γ + 1 tokens in units of a one-token step. The paper
    takes it as 1; on a CPU it is not (≈ 1.2 for 5 tokens here), and passing the measured value separates
    what the hardware costs from what the decode loop wastes.
    """
    if gamma <= 0:
        return 1.0
    return expected_tokens(alpha, gamma) / (gamma * c + verify_cost)


@dataclass
class GenerationStats:
    """What one request did, step by step (each step is one target call). Times are seconds."""

    prompt_tokens: int = 0
    fallback_steps: int = 0
    draft_time: float = 0.0
    target_time: float = 0.0
    verify_time: float = 0.0
    prefill_time: float = 0.0
    wall_time: float = 0.0
    step_gammas: list[int] = field(default_factory=list)  # k asked of the proposer
    step_proposed: list[int] = field(default_factory=list)  # tokens it drafted
    step_accepted: list[int] = field(default_factory=list)
    step_emitted: list[int] = field(default_factory=list)  # accepted + 1, less any cut at EOS/stop/limit
    step_times: list[float] = field(default_factory=list)
    step_scored: list[int] = field(default_factory=list)  # positions the target scored: the last token + the nodes
    finish_reason: str = ""

    def record_step(self, k_asked: int, proposed: int, accepted: int, emitted: int, step_time: float,
                    scored: int | None = None) -> None:
        """One step; ``scored`` (default proposed + 1) counts what the target's pass scored for the request."""
        self.step_scored.append(proposed + 1 if scored is None else scored)
        self.step_gammas.append(k_asked)
        self.step_proposed.append(proposed)
        self.step_accepted.append(accepted)
        self.step_emitted.append(emitted)
        self.step_times.append(step_time)

    @property
    def new_tokens(self) -> int:
        return sum(self.step_emitted)

    @property
    def target_calls(self) -> int:
        return len(self.step_times)

    @property
    def draft_tokens(self) -> int:
        return sum(self.step_proposed)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.step_accepted)

    @property
    def proposed_at(self) -> np.ndarray:
        """Steps that drafted a token at position i (0-based)."""
        proposed = np.array(self.step_proposed, dtype=int)
        return np.array([(proposed > i).sum() for i in range(proposed.max(initial=0))], dtype=int)

    @property
    def accepted_at(self) -> np.ndarray:
        accepted = np.array(self.step_accepted, dtype=int)
        return np.array([(accepted > i).sum() for i in range(len(self.proposed_at))], dtype=int)

    # --- derived figures ----------------------------------------------------------------------------
    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def alpha(self) -> float | None:
        """Per-position acceptance probability as Leviathan's formula means it: accepted / tried, where a
        step tries positions up to its first rejection (accepted / drafted counts untried positions as
        failures and understates it)."""
        trials = self.accepted_tokens + sum(a < p for a, p in zip(self.step_accepted, self.step_proposed))
        return self.accepted_tokens / trials if trials else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """τ: tokens emitted per target call, bonus included (1.0 without speculation)."""
        return sum(self.step_emitted) / self.target_calls if self.target_calls else None

    @property
    def per_position_acceptance(self) -> list[float]:
        return [float(a / p) for a, p in zip(self.accepted_at, self.proposed_at)]

    @property
    def nodes_scored_per_step(self) -> float | None:
        """Positions the target scored per call (a chain of k: k + 1; a tree of n nodes: n + 1)."""
        return sum(self.step_scored) / len(self.step_scored) if self.step_scored else None

    @property
    def mean_gamma(self) -> float:
        return self.draft_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def draft_cost_ratio(self) -> float | None:
        """c: drafting time per drafted token over target time per target call (a verify pass)."""
        if not self.draft_tokens or not self.target_calls or not self.target_time:
            return None
        return (self.draft_time / self.draft_tokens) / (self.target_time / self.target_calls)

    @property
    def predicted_speedup(self) -> float | None:
        alpha, c = self.alpha, self.draft_cost_ratio
        if alpha is None or c is None:
            return None
        return predicted_speedup(alpha, self.mean_gamma, c)

    @property
    def tokens_per_second(self) -> float | None:
        return self.new_tokens / self.wall_time if self.wall_time else None

    def token_latencies(self) -> np.ndarray:
        """Per emitted token: its step's time shared among the tokens that step emitted."""
        if not self.step_times:
            return np.zeros(0)
        return np.repeat(np.array(self.step_times) / np.maximum(self.step_emitted, 1), self.step_emitted)

    @property
    def overhead_share(self) -> float | None:
        """Share of wall time spent outside drafting and target forwards (the loop's own cost)."""
        if not self.wall_time:
            return None
        return max(0.0, 1.0 - (self.draft_time + self.target_time + self.prefill_time) / self.wall_time)

    def to_dict(self) -> dict:
        lat = self.token_latencies()
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
            "target_calls": self.target_calls, "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens, "fallback_steps": self.fallback_steps,
            "acceptance_rate": self.acceptance_rate, "alpha": self.alpha,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance, "mean_gamma": self.mean_gamma,
            "nodes_scored_per_step": self.nodes_scored_per_step,
            "draft_time_s": self.draft_time, "target_time_s": self.target_time, "verify_time_s": self.verify_time,
            "prefill_time_s": self.prefill_time, "wall_time_s": self.wall_time,
            "draft_cost_ratio": self.draft_cost_ratio, "predicted_speedup": self.predicted_speedup,
            "tokens_per_second": self.tokens_per_second,
            "token_latency_p50_s": float(np.percentile(lat, 50)) if lat.size else None,
            "token_latency_p99_s": float(np.percentile(lat, 99)) if lat.size else None,
            "finish_reason": self.finish_reason,
        }


def aggregate(stats: list[GenerationStats]) -> dict:
    """Pool several requests: token-weighted rates, pooled latency percentiles, spread of finish times."""
    pooled = GenerationStats()
    for s in stats:
        pooled.prompt_tokens += s.prompt_tokens
        pooled.fallback_steps += s.fallback_steps
        for name in ("draft_time", "target_time", "verify_time", "prefill_time", "wall_time"):
            setattr(pooled, name, getattr(pooled, name) + getattr(s, name))
        for name in ("step_gammas", "step_proposed", "step_accepted", "step_emitted", "step_times", "step_scored"):
            getattr(pooled, name).extend(getattr(s, name))
    out = pooled.to_dict()
    del out["finish_reason"]
    finish = np.array([s.wall_time for s in stats])
    out["requests"] = len(stats)
    out["time_to_finish_p50_s"] = float(np.percentile(finish, 50)) if finish.size else None
    out["time_to_finish_p90_s"] = float(np.percentile(finish, 90)) if finish.size else None
    out["time_to_finish_max_s"] = float(finish.max()) if finish.size else None
    return out
