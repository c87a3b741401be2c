"""Sampling parameters and the one function that turns logits into the distribution sampling uses.

The target and every model-based drafter go through :func:`processed_probs`, so "p" and "q" always
mean the same processed thing (temperature, top-k, top-p applied; temperature 0 is a one-hot argmax).
"""
from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass

import torch

from specplug.verifier.rule import sample_from_weights

from . import argmax_kernel


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 (or None) and top_p 1.0 (or None) disable those filters, as in HF;
    seed fixes the rng."""

    temperature: float = 1.0
    top_k: int | None = 0
    top_p: float | None = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        # frozen: normalise through object.__setattr__, so ``top_k`` is always an int and ``top_p`` a float
        if self.top_k is None:
            object.__setattr__(self, "top_k", 0)
        if self.top_p is None:
            object.__setattr__(self, "top_p", 1.0)
        _check_type("temperature", self.temperature, numbers.Real)
        _check_type("top_k", self.top_k, numbers.Integral)
        _check_type("top_p", self.top_p, numbers.Real)
        if self.seed is not None:
            _check_type("seed", self.seed, numbers.Integral)
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g

    def to_dict(self) -> dict:
        return asdict(self)


def _check_type(name: str, value, kind: type) -> None:
    """A clear TypeError for a value of the wrong type (a bool is no number here), not one from a comparison."""
    if isinstance(value, bool) or not isinstance(value, kind):
        what = "an integer" if kind is numbers.Integral else "a number"
        raise TypeError(f"SamplingParams: {name} must be {what}, got {value!r}")


GREEDY = SamplingParams(temperature=0.0)


def argmax_ids(logits: torch.Tensor) -> list[int]:
    """Each row's argmax over the last dimension of logits [..., V], flattened to a list of ints: the first of
    equal maxima, a NaN counting as the largest, as torch's argmax takes it.

    Why not torch's argmax on the CPU: over 8,192 logits it took 35 µs for 5 rows and 450 µs for 80 on the 2-core
    Xeon, numpy's 3 and 80; a greedy step takes one per drafted token and one over every scored position.
    Contiguous float32 rows go to this machine's choice (:mod:`specplug.argmax_kernel`: one C call where it
    built), others to numpy."""
    if logits.device.type != "cpu":
        return logits.argmax(-1).reshape(-1).tolist()
    return argmax_kernel.cpu_greedy_ids(logits, argmax_kernel.chosen())


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] -> float32 probabilities [..., V] exactly as ordinary sampling would draw from."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample_rows(q: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
    """One token id per row of the distributions q [n, V], drawn with ``rng``: inverse CDF from one uniform a row.

    Why not ``torch.multinomial``: for one sample it draws V exponentials (0.13 ms over 8,192 tokens on the
    2-core CPU, a fifth of a draft step); one uniform and a cumulative sum give the same distribution."""
    u = torch.rand(q.shape[0], generator=rng, device=q.device, dtype=torch.float32)
    return sample_from_weights(q.float(), u)


def multinomial(q: torch.Tensor, rng: torch.Generator) -> int:
    """One token id drawn from the distribution q [V] with ``rng``."""
    return int(sample_rows(q.reshape(1, -1), rng)[0])


def draw(logits: torch.Tensor, params: SamplingParams, rng: torch.Generator,
         sample=multinomial) -> tuple[int, torch.Tensor | None]:
    """A drafter's token from ``logits`` [V] and the q it was drawn from: under greedy decoding the argmax and
    None (the point mass there: the same argmax processed_probs takes), else a ``sample(q, rng)`` from the
    processed distribution q."""
    if params.greedy:
        return argmax_ids(logits)[0], None
    q = processed_probs(logits, params)
    return sample(q, rng), q


def q_from_counts(rows, tokens: list[int], vocab_size: int, device) -> torch.Tensor:
    """A dense [k, V] q from count rows, for frequency-based drafters (ngram counts, suffix).

    ``rows[i]`` is ``(ids, counts, total)`` — q_i(ids[j]) = counts[j] / total — or None for a point mass at
    ``tokens[i]``.
    """
    r_idx, c_idx, vals = [], [], []
    for i, (row, tok) in enumerate(zip(rows, tokens)):
        if row is None:
            r_idx.append(i)
            c_idx.append(tok)
            vals.append(1.0)
        else:
            ids, counts, total = row
            r_idx.extend([i] * len(ids))
            c_idx.extend(ids)
            vals.extend(c / total for c in counts)
    q = torch.zeros(len(tokens), vocab_size, dtype=torch.float32)
    q[r_idx, c_idx] = torch.tensor(vals, dtype=torch.float32)
    return q.to(device)
