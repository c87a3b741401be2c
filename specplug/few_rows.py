"""Linear layers that stay fast on the few-row inputs a verify pass feeds them (CPU, float32).

A speculative step scores k + 1 = 2..9 positions. On the CPU BLAS torch 2.13 ships, ``F.linear`` over 2-4 rows
of an 8192 × 512 LM head takes 2-4× as long as over one row (measured, weights out of cache: 0.85 ms for one
row, 3.4 ms for two or three), while the same product computed as ``W @ xᵀ`` takes 0.2-0.9 ms. That quirk alone
made scoring 3 tokens cost 1.6 target steps, and a verify pass costing more than a step is exactly what
Leviathan's formula assumes away. Same arithmetic, another loop order: results agree to float32 rounding.

One row (plain decoding) is slower still through BLAS's matrix-vector path, so it is padded to two rows and
takes the same form: the target-only baseline gets the fix too (99 -> 125 tokens/s on zoo:pycode), and every
speed-up stays a ratio of two equally tuned paths. Long prefills (more than MAX_ROWS rows) keep ``F.linear``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_ROWS = 16  # beyond this the two forms cost the same (measured up to 144 rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``weight @ xᵀ`` for 1..MAX_ROWS rows of CPU float32."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows <= MAX_ROWS or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:  # a one-row product takes BLAS's matrix-vector path, slower still: pad to two rows
        flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    y = torch.mm(weight, flat.T).T[:rows].contiguous()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def install(model: torch.nn.Module) -> int:
    """Give every ``nn.Linear`` of a CPU float32 ``model`` the few-rows path; return how many got it."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu" \
                and module.weight.dtype == torch.float32:
            module.forward = _forward.__get__(module)
            count += 1
    return count
