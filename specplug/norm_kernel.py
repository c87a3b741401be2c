"""The lean forward's RMSNorm kernel (``kernels/norm.c``) for float32 rows on the CPU: compiled on first use,
cached, loaded by ctypes.

Why: torch's rms_norm on a step's few rows is mostly dispatch (~16 µs a call on a 2-core EPYC, 13 calls a step
of the zoo target, ~3% of a one-row step). The kernel normalises each row in one fixed order, so a row's result
depends on that row alone, as the products' and attention's kernels keep it (see the source).

It is used only where it agrees with torch's rms_norm on a probe, gives every row of a many-row call its
one-row bits, and is not slower (a probe, choice ``rms_norm``, listed by
:func:`specplug.machine.machine_choices`); without a C compiler, on another device or dtype, or with
``SPECPLUG_CHOICES=rms_norm=torch``, torch's form runs and the reason is recorded.
"""
from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from . import machine, native

SOURCE = "norm.c"
CHOICE = "rms_norm"
KERNEL, TORCH = "kernel", "torch"
PROBE_ROWS = (1, 5, 16)  # a one-token step, a verify pass, a batched step


@functools.lru_cache(maxsize=1)
def load() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel, or None and why it is not available."""
    i64, ptr = native.I64, native.PTR
    return native.bind(SOURCE, {"specplug_rms_norm": ([i64, i64, ptr, ptr, ctypes.c_float, ptr], None)})


class RmsNorm:
    """RMSNorm over the last dimension of float32 CPU tensors by the kernel, with this weight and eps."""

    __slots__ = ("fn", "weight", "eps", "size")

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, eps: float):
        self.fn, self.weight, self.eps = lib.specplug_rms_norm, weight.detach().contiguous(), float(eps)
        self.size = self.weight.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        out = torch.empty_like(x)
        self.fn(x.numel() // self.size, self.size, x.data_ptr(), self.weight.data_ptr(), self.eps, out.data_ptr())
        return out


def supports(weight: torch.Tensor) -> str:
    """"" where the kernel can normalise rows with this weight (the lean forward's rows share its dtype), else
    why not."""
    if weight.device.type != "cpu":
        return f"the norm kernel runs on the CPU, not {weight.device.type}"
    if weight.dtype != torch.float32:
        return f"the norm kernel takes float32 rows and weights, not {weight.dtype}"
    return load()[1]


def choose(weight: torch.Tensor, eps: float) -> RmsNorm | None:
    """The kernel's norm for this weight, or None for torch's ``F.rms_norm``: decided once per size and machine,
    and recorded with the reason."""
    key = f"{weight.numel()} {str(weight.dtype).removeprefix('torch.')} {weight.device.type}"
    pinned = machine.overrides().get(CHOICE)
    reason = supports(weight)
    if reason:
        if pinned == KERNEL:
            raise ValueError(f"{machine.OVERRIDE_ENV}: {CHOICE}={KERNEL} is pinned, but {reason}")
        if weight.device.type == "cpu":
            machine.record(CHOICE, key, TORCH, reason, "default")
        return None
    if pinned == TORCH:
        machine.record(CHOICE, key, TORCH, machine.OVERRIDE_ENV, "override")
        return None
    kernel = RmsNorm(load()[0], weight, eps)
    shape = tuple(weight.shape)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(PROBE_ROWS), weight.numel(), generator=g) * 3
    probes = [x[:m] for m in PROBE_ROWS]
    with torch.inference_mode():
        got, want = kernel(x), F.rms_norm(x, shape, weight, eps)
        alone = torch.cat([kernel(x[i:i + 1]) for i in range(x.shape[0])])
    why = ("its rows differ from one-row calls" if not torch.equal(got, alone) else
           "" if torch.allclose(got, want, atol=1e-5, rtol=1e-5) else
           f"it differs from torch's rms_norm by {float((got - want).abs().max()):.2g} on a probe")
    forms = {KERNEL: lambda: [kernel(p) for p in probes], TORCH: lambda: [F.rms_norm(p, shape, weight, eps) for p in probes]}
    # probed whatever the weight's size: a norm's cost is its calls, not the bytes it reads
    return kernel if machine.kernel_kept(CHOICE, key, why, forms, machine.MIN_BYTES) else None
