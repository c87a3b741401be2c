"""Linear layers that stay fast on the few-row inputs a verify pass feeds them (CPU, float32).

A speculative step scores k + 1 = 2..9 positions. On the CPU BLAS torch 2.13 ships, ``F.linear`` over 2-4 rows
of an 8192 × 512 LM head takes 2-4× as long as over one row (measured, weights out of cache: 0.85 ms for one
row, 3.4 ms for two or three), while the same product computed as ``W @ xᵀ`` takes 0.2-0.9 ms. That quirk alone
made scoring 3 tokens cost 1.6 target steps, and a verify pass costing more than a step is exactly what
Leviathan's formula assumes away. Same arithmetic, another loop order: results agree to float32 rounding.

One row (plain decoding) is slower still through BLAS's matrix-vector path, so it is padded to two rows and
takes the same form: the target-only baseline gets the fix too (99 -> 125 tokens/s on zoo:pycode), and every
speed-up stays a ratio of two equally tuned paths. Long prefills (more than MAX_ROWS rows) keep ``F.linear``.

``install(model, weight_dtype=torch.bfloat16)`` instead keeps the linear weights in bfloat16 and multiplies in it
(inputs cast down, products cast back), while everything else — embeddings, norms, attention, the residual
stream, the KV cache — stays float32: the arithmetic of bf16-autocast training, without autocast's per-call
weight casts. On a CPU with native bf16 products it halves the bytes a step reads, and a product over 2-9 rows
costs about what one row does, so scoring k + 1 drafted tokens is nearly as cheap as one step, as on a GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_ROWS = 16  # beyond this the two forms cost the same (measured up to 144 rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``weight @ xᵀ`` for 1..MAX_ROWS rows of CPU float32; in the
    weights' dtype, cast back to x's, where the weights are kept narrower than x (see :func:`install`)."""
    if weight.dtype != x.dtype:
        flat = x.reshape(-1, x.shape[-1]).to(weight.dtype)
        rows = flat.shape[0]
        if rows == 1:  # one row takes another kernel, whose sums round differently: pad to two
            flat = torch.cat([flat, torch.zeros_like(flat)])
        return F.linear(flat, weight, bias)[:rows].to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
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


def install(model: torch.nn.Module, weight_dtype: torch.dtype | None = None) -> int:
    """Give every float32 ``nn.Linear`` of ``model`` the path of :func:`linear`; return how many got it.

    Without ``weight_dtype``: CPU layers only, weights untouched (the few-rows path). With it: the layers'
    weights and biases are converted to ``weight_dtype`` in place (a tied LM head gets its own copy, the
    embedding stays float32) and every product runs in it, on any device."""
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.dtype != torch.float32:
            continue
        if weight_dtype is not None and weight_dtype != torch.float32:
            module.weight = torch.nn.Parameter(module.weight.detach().to(weight_dtype), requires_grad=False)
            if module.bias is not None:
                module.bias = torch.nn.Parameter(module.bias.detach().to(weight_dtype), requires_grad=False)
        elif module.weight.device.type != "cpu":
            continue
        module.forward = _forward.__get__(module)
        count += 1
    return count
