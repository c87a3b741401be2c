"""The lean forward's gated activation, silu(gate) · up, by a C kernel (``kernels/silu.c``) for float32 rows on the
CPU: compiled on first use, cached, loaded by ctypes.

Why: torch's form is two views, silu and a product: ~25 µs a layer right after the products on a one-row step
of the zoo target (the interpreter's data out of cache), well under a microsecond of work; in C it also lets a
fused layer (:mod:`specplug.fused_layers`) run as one call. Each element is computed alone, so a row's result
depends on that row only, as the products' and attention's kernels keep it.

Its silu rounds its own way (a few ulps from torch's), so a layer uses one form on every path (steps, verify
passes, prefills, tree nodes) and the choice is made per width and machine: only where the kernel agrees with
torch's silu to float32 precision on a probe, gives every row of a many-row call its one-row bits, and is not
slower (choice ``activation``, listed by :func:`specplug.machine.machine_choices`). Without a C compiler, on
another device or dtype, for another activation, or with ``SPECPLUG_CHOICES=activation=torch``, torch's form
runs and the reason is recorded.
"""
from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from . import machine, native

SOURCE = "silu.c"
CHOICE = "activation"
KERNEL, TORCH = "kernel", "torch"
PROBE_ROWS = (1, 5, 16)  # a one-token step, a verify pass, a batched step


@functools.lru_cache(maxsize=1)
def load() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel, or None and why it is not available."""
    i64, ptr = native.I64, native.PTR
    return native.bind(SOURCE, {"specplug_silu_mul": ([i64, i64, ptr, ptr], None)})


class SiluMul:
    """silu(gate) · up of rows [..., 2·inter] holding gate then up, float32 on the CPU, by the kernel."""

    __slots__ = ("fn", "inter")

    def __init__(self, lib: ctypes.CDLL, inter: int):
        self.fn, self.inter = lib.specplug_silu_mul, inter

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not gate_up.is_contiguous():
            gate_up = gate_up.contiguous()
        out = gate_up.new_empty(*gate_up.shape[:-1], self.inter)
        self.fn(gate_up.numel() // (2 * self.inter), self.inter, gate_up.data_ptr(), out.data_ptr())
        return out


def by_torch(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """torch's form of :class:`SiluMul`."""
    gate, up = gate_up.split(inter, -1)
    return F.silu(gate) * up


def choose(inter: int, dtype: torch.dtype, device) -> SiluMul | None:
    """The kernel for this width, or None for torch's form: decided once per width and machine, and recorded
    with the reason."""
    device = torch.device(device)
    key = f"{inter} {str(dtype).removeprefix('torch.')} {device.type}"
    pinned = machine.overrides().get(CHOICE)
    reason = (f"the activation kernel runs on the CPU, not {device.type}" if device.type != "cpu" else
              f"the activation kernel takes float32 rows, not {dtype}" if dtype != torch.float32 else load()[1])
    if reason:
        if pinned == KERNEL:
            raise ValueError(f"{machine.OVERRIDE_ENV}: {CHOICE}={KERNEL} is pinned, but {reason}")
        if device.type == "cpu":
            machine.record(CHOICE, key, TORCH, reason, "default")
        return None
    if pinned == TORCH:
        machine.record(CHOICE, key, TORCH, machine.OVERRIDE_ENV, "override")
        return None
    kernel = SiluMul(load()[0], inter)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(PROBE_ROWS), 2 * inter, generator=g) * 4
    x[0, :8] = torch.tensor([-100.0, -88.0, -30.0, -0.0, 0.0, 30.0, 88.0, 100.0])  # the exp's clamped ends
    probes = [x[:m] for m in PROBE_ROWS]
    with torch.inference_mode():
        got, want = kernel(x), by_torch(x, inter)
        alone = torch.cat([kernel(x[i:i + 1]) for i in range(x.shape[0])])
    why = ("its rows differ from one-row calls" if not torch.equal(got, alone) else
           "" if torch.allclose(got, want, atol=1e-6, rtol=1e-5) else
           f"it differs from torch's silu by {float((got - want).abs().max()):.2g} on a probe")
    forms = {KERNEL: lambda: [kernel(p) for p in probes], TORCH: lambda: [by_torch(p, inter) for p in probes]}
    # probed whatever the width: its cost is its calls, not the bytes it reads
    return kernel if machine.kernel_kept(CHOICE, key, why, forms, machine.MIN_BYTES) else None
