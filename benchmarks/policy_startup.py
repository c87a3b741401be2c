"""How much does `cost-model` lose to the best static γ while it learns, with no machine noise at all?

    python benchmarks/policy_startup.py [--alpha 0.8] [--seeds 50] [--measure-k 1]

One sequence decoded against modelled costs shaped like the zoo's at batch 1 (scoring n tokens
3 ms × (1 + 0.06 (n − 1)); drafting k tokens 0.6 ms + 0.23 ms × k, plus a 2 ms backlog on the first
drafting step) with geometric acceptance α. Prints tokens per modelled second of static γ = 4 and 6 and of
the policy over runs of 20, 40 and 200 steps, mean over --seeds seeds. ``--measure-k`` overrides the
policy's MEASURE_K (the tokens its two measuring steps draft) to compare start-ups.
"""
from __future__ import annotations

import argparse
import random

import torch

import specplug
import specplug.policies as policies
from specplug.policies import CostModelPolicy


def scoring(n: int) -> float:
    return 0.0030 * (1 + 0.06 * (n - 1))


def drafting(k: int) -> float:
    return 0.0006 + 0.00023 * k if k else 0.0


def run(choose_k, steps: int, seed: int, alpha: float) -> float:
    """Tokens per modelled second of one sequence; ``choose_k`` is a fixed γ or a policy."""
    rnd = random.Random(seed)
    seq = specplug.SequenceState(ids=[1, 2, 3], num_prompt=3, sampling=specplug.GREEDY, rng=torch.Generator(),
                                 target=None)
    policy = None if isinstance(choose_k, int) else choose_k
    if policy is not None:
        policy.begin(seq)
    tokens, seconds, backlog = 0, 0.0, True
    for _ in range(steps):
        k = policy.choose(seq, 8) if policy is not None else choose_k
        accepted = 0
        while accepted < k and rnd.random() < alpha:
            accepted += 1
        draft = drafting(k) + (0.002 if backlog and k else 0.0)
        backlog = backlog and not k
        if policy is not None:
            policy.update(seq, k, accepted, draft, scoring(k + 1))
        tokens += accepted + 1
        seconds += draft + scoring(k + 1)
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alpha", type=float, default=0.8)
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--measure-k", type=int, default=None)
    args = parser.parse_args()
    if args.measure_k is not None:
        policies.MEASURE_K = args.measure_k
    for steps in (20, 40, 200):
        rates = {name: sum(run(make(), steps, s, args.alpha) for s in range(args.seeds)) / args.seeds
                 for name, make in [("γ=4", lambda: 4), ("γ=6", lambda: 6), ("cost-model", CostModelPolicy)]}
        best = max(rates["γ=4"], rates["γ=6"])
        print(f"{steps:4d} steps: " + "  ".join(f"{n} {r:.0f} tok/s" for n, r in rates.items())
              + f"  policy vs best static {100 * (rates['cost-model'] / best - 1):+.1f}%")


if __name__ == "__main__":
    main()
