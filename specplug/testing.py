"""Statistical checks that speculative output follows the target's exact distribution.

``exact_distribution`` enumerates the target's distribution over every continuation of n tokens (small
vocabularies only); ``sampled_distribution`` draws n-token continuations through the speculative loop;
``chi_square_pvalue`` compares the two. With fixed seeds the verdicts are deterministic; the threshold
``EXACTNESS_ALPHA`` = 1e-3 is the false-alarm rate for an honest decoder under fresh seeds.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

from .decode import generate
from .sampling import SamplingParams, processed_probs
from .target import Target
from .types import Proposer

EXACTNESS_ALPHA = 1e-3


def exact_distribution(target: Target, prompt_ids: Sequence[int], n_tokens: int,
                       sampling: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(x1..xn | prompt) under plain sampling from the target, for every continuation with mass."""
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n_tokens):
        prefixes = list(dist)
        batch = torch.tensor([list(prompt_ids) + list(p) for p in prefixes], device=target.device)
        with torch.inference_mode():
            logits = target.model(input_ids=batch).logits[:, -1]
        probs = processed_probs(logits.double(), sampling).double().cpu()
        grown: dict[tuple[int, ...], float] = {}
        for row, prefix in enumerate(prefixes):
            for token in probs[row].nonzero().flatten().tolist():
                grown[prefix + (token,)] = dist[prefix] * float(probs[row, token])
        dist = grown
    return dist


def sampled_distribution(target: Target, proposer: Proposer | None, prompt_ids: Sequence[int], n_tokens: int,
                         sampling: SamplingParams, n_samples: int, *, num_speculative_tokens: int = 2,
                         seed: int = 0) -> Counter:
    """Counts of n-token continuations from ``n_samples`` speculative runs with seeds seed, seed+1, ..."""
    counts: Counter = Counter()
    for i in range(n_samples):
        params = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed + i)
        result = generate(target, proposer, list(prompt_ids), max_new_tokens=n_tokens, sampling=params,
                          num_speculative_tokens=num_speculative_tokens, strict=True)
        counts[tuple(result.tokens)] += 1
    return counts


def chi_square_pvalue(counts: Counter, expected: dict[tuple[int, ...], float], min_expected: float = 5.0) -> float:
    """Pearson's chi-square goodness of fit; outcomes expected fewer than ``min_expected`` times are pooled.

    An outcome the target gives zero probability makes the p-value 0 outright.
    """
    n = sum(counts.values())
    if any(outcome not in expected for outcome in counts):
        return 0.0
    observed, wanted, pooled_o, pooled_e = [], [], 0.0, 0.0
    for outcome, prob in expected.items():
        if prob * n >= min_expected:
            observed.append(counts.get(outcome, 0))
            wanted.append(prob * n)
        else:
            pooled_o += counts.get(outcome, 0)
            pooled_e += prob * n
    if pooled_e > 0:
        observed.append(pooled_o)
        wanted.append(pooled_e)
    o = torch.tensor(observed, dtype=torch.float64)
    e = torch.tensor(wanted, dtype=torch.float64)
    stat = float(((o - e) ** 2 / e).sum())
    dof = len(observed) - 1
    if dof < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))
