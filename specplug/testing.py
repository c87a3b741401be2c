"""Statistical checks that speculative output follows the target's exact distribution.

``exact_distribution`` enumerates the target's distribution over every continuation of n tokens (small
vocabularies only); ``sampled_distribution`` draws n-token continuations through the speculative loop;
``chi_square_pvalue`` compares the two. With fixed seeds the verdicts are deterministic; the threshold
``EXACTNESS_ALPHA`` = 1e-3 is the false-alarm rate for an honest decoder under fresh seeds.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
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
                         seed: int = 0, verification: str = "token") -> Counter:
    """Counts of n-token continuations from ``n_samples`` speculative runs with seeds seed, seed+1, ...
    (``verification``: "token" or "block", as for :func:`~specplug.decode.generate`)."""
    counts: Counter = Counter()
    for i in range(n_samples):
        params = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed + i)
        result = generate(target, proposer, list(prompt_ids), max_new_tokens=n_tokens, sampling=params,
                          num_speculative_tokens=num_speculative_tokens, strict=True, verification=verification)
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


def tiny_llama(out: str | Path, vocab_size: int, *, hidden: int = 32, layers: int = 2, seed: int = 0,
               init: float = 0.3, eos_token_id: int | None = None, max_positions: int = 512) -> Path:
    """Save a random Llama (safetensors + config) for tests; ``init`` sets how peaked its distributions are."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, initializer_range=init,
                         eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = eos_token_id
    model.save_pretrained(out)
    return Path(out)


def assert_proposer_conforms(factory, *, samples: int = 1000, workdir=None, verification: str = "token") -> None:
    """For a plugin's own test suite: run the conformance kit and fail with every failed property's evidence.

    ``factory(target, draft_dir)`` builds the proposer for the kit's tiny 6-token target (``draft_dir`` holds a
    tiny draft model for that target, for proposers that need one). A proposer that drafts trees is checked per
    branch; ``verification="block"`` checks exactness under block verification of its chains.
    """
    from .conformance import ConformanceKit

    failed = [r for r in ConformanceKit(workdir, samples, verification).run(factory) if not r.passed]
    assert not failed, "proposer failed conformance:\n" + "\n".join(f"  {r.name}: {r.evidence}" for r in failed)
