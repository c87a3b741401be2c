"""How a kernel product (:mod:`specplug.bf16_products`, :mod:`specplug.row_products`) is chosen for a weight: used
only where the machine shows every row equals its one-row product (the property a verify pass relies on) and the
torch path is not faster on the row counts of steps and verify passes; recorded with the reason either way, and
pinned by ``SPECPLUG_CHOICES``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import few_rows, machine

Product = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Kernel:
    """What names a kernel's choice: ``choice`` (a machine choice) between forms ``kernel`` and ``fallback``,
    ``fact`` (the machine fact that its rows equal one-row products), ``label`` for messages, the weights'
    ``dtype``, the row counts the bit check covers and those the timing probe runs."""

    choice: str
    kernel: str
    fallback: str
    fact: str
    label: str
    dtype: torch.dtype
    checked_rows: tuple[int, ...]
    step_rows: tuple[int, ...]


def rows_match_one_row_products(product: Product, x: torch.Tensor, checked_rows: tuple[int, ...]) -> bool:
    """Whether every row of products over ``checked_rows`` rows of x equals that row's one-row product, bit for bit."""
    with torch.inference_mode():
        one = torch.cat([product(x[i:i + 1]) for i in range(max(checked_rows))])
        return all(torch.equal(product(x[:m]), one[:m]) for m in checked_rows)


def choose(kernel: Kernel, weight: torch.Tensor | None, bias: torch.Tensor | None, unsupported: str,
           make: Callable[[torch.Tensor, torch.Tensor | None], Product], fallback: Product) -> Product | None:
    """``make(weight, bias)`` where the kernel is to run this weight, else None (``fallback`` runs it):
    ``unsupported`` is why the kernel cannot take it ("" where it can)."""
    out_features, in_features = (0, 0) if weight is None or weight.dim() != 2 else weight.shape
    dtype = str(kernel.dtype).removeprefix("torch.")
    where = f"{dtype} {out_features}x{in_features}{' +bias' if bias is not None else ''} cpu"
    pinned = machine.overrides().get(kernel.choice)
    if unsupported:
        if pinned == kernel.kernel:
            raise ValueError(f"{machine.OVERRIDE_ENV}: {kernel.choice}={kernel.kernel} is pinned, but {unsupported}")
        if weight is not None and weight.dtype == kernel.dtype and weight.device.type == "cpu":
            machine.record(kernel.choice, where, kernel.fallback, unsupported, "default")
        return None
    if pinned == kernel.fallback:
        machine.record(kernel.choice, where, kernel.fallback, machine.OVERRIDE_ENV, "override")
        return None
    w, x, b = few_rows.sensitive_inputs(out_features, in_features, kernel.dtype, "cpu", bias is not None)
    x = torch.cat([x, x.flip(0)])[:max(kernel.checked_rows)].float()
    invariant = machine.remembered(kernel.fact, where,
                                   lambda: "yes" if rows_match_one_row_products(make(w, b), x, kernel.checked_rows)
                                   else "no",
                                   lambda v: "every row equals its one-row product" if v == "yes"
                                   else "rows differ from one-row products: not used")
    if invariant != "yes":
        if pinned == kernel.kernel:
            raise ValueError(f"{machine.OVERRIDE_ENV}: {kernel.choice}={kernel.kernel} is pinned, but its rows "
                             "differ from one-row products on this machine")
        machine.record(kernel.choice, where, kernel.fallback, f"{kernel.label}'s rows differ from one-row products "
                                                               "here", "probe")
        return None
    product = make(weight, bias)
    probe = torch.randn(max(kernel.step_rows), in_features, generator=torch.Generator().manual_seed(0))
    steps = [probe[:m] for m in kernel.step_rows]
    forms = {kernel.kernel: lambda: [product(p) for p in steps], kernel.fallback: lambda: [fallback(p) for p in steps]}
    # the kernel by default: any number of rows is one product (no pieces), so it wins ties
    chosen = machine.faster(kernel.choice, where, forms, kernel.kernel, weight.numel() * weight.element_size())
    return product if chosen == kernel.kernel else None
