"""Greedy ids by a C kernel (``kernels/argmax.c``): each float32 CPU row's argmax in one call, as torch's argmax
takes it (the first of equal maxima, a NaN the largest).

Why: a greedy step reads the argmax of every scored position, and drafters read one a drafted token. The
numpy route (detach, reshape, numpy, argmax, tolist) cost ~60 µs a one-row step of the zoo target on a 2-core
EPYC Zen 4, right after a pass had pushed the interpreter's data out of cache, for a few µs of work; the
kernel's one ctypes call returns the ids as Python ints.

Used where it gives torch's argmax on a probe (random rows, ties, NaNs, infinities, signed zeros) and is not
slower (choice ``greedy_ids``, listed by :func:`specplug.machine.machine_choices`). Without a C compiler, or
with ``SPECPLUG_CHOICES=greedy_ids=numpy``, numpy's argmax runs and the reason is recorded.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Callable

import torch

from . import machine, native

SOURCE = "argmax.c"
CHOICE = "greedy_ids"
KERNEL, NUMPY = "kernel", "numpy"
KEY = "float32 cpu"
PROBE_ROWS = (1, 5, 80)  # a one-token step, a verify pass, a batch of 16 verifying 4 drafts


@functools.lru_cache(maxsize=1)
def load() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel, or None and why it is not available."""
    i64, ptr = native.I64, native.PTR
    return native.bind(SOURCE, {"specplug_argmax_rows": ([i64, i64, ptr, ptr], None)})


class ArgmaxRows:
    """Each row's argmax of contiguous float32 CPU logits [..., V], flattened to a list of ints."""

    __slots__ = ("fn",)

    def __init__(self, lib: ctypes.CDLL):
        self.fn = lib.specplug_argmax_rows

    def __call__(self, logits: torch.Tensor) -> list[int]:
        width = logits.shape[-1]
        rows = logits.numel() // width if width else 0
        if rows == 0:
            return []
        out = (ctypes.c_int64 * rows)()
        self.fn(rows, width, logits.data_ptr(), out)
        return out[:]


def by_numpy(logits: torch.Tensor) -> list[int]:
    """numpy's form of :class:`ArgmaxRows` (any CPU float dtype numpy holds)."""
    return logits.detach().reshape(-1, logits.shape[-1]).numpy().argmax(-1).tolist()


def probe_rows(width: int = 8192 + 7) -> torch.Tensor:
    """Rows whose argmax exposes the rules: random rows, then ties, NaNs, infinities and signed zeros placed
    inside and after the vector body (the width is no multiple of a vector's 16 floats)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(PROBE_ROWS) + 8, width, generator=g)
    x[0, [5, 40, width - 1]] = 9.0  # equal maxima: the first wins
    x[1, [3, width - 2]] = float("nan")  # the first NaN wins, even before a larger number
    x[1, 0] = float("inf")
    x[2] = float("-inf")  # all equal: index 0
    x[3] = -0.0
    x[3, 17] = 0.0  # -0 == +0: the first zero
    x[4, width - 1] = float("inf")  # in the tail, past the vector body
    x[5, width - 3] = float("nan")
    x[6, 33] = x[6, 7] = 50.0
    x[7] = torch.arange(width, 0, -1, dtype=torch.float32)  # the first element
    x[8, 21] = float("nan")  # a NaN inside the vector body alone: no tail to find it
    return x


def _decide(pinned: str | None) -> Callable[[torch.Tensor], list[int]]:
    lib, reason = load()
    if reason:
        if pinned == KERNEL:
            raise ValueError(f"{machine.OVERRIDE_ENV}: {CHOICE}={KERNEL} is pinned, but {reason}")
        machine.record(CHOICE, KEY, NUMPY, reason, "default")
        return by_numpy
    if pinned == NUMPY:
        machine.record(CHOICE, KEY, NUMPY, machine.OVERRIDE_ENV, "override")
        return by_numpy
    kernel = ArgmaxRows(lib)
    x = probe_rows()
    why = "" if kernel(x) == x.argmax(-1).tolist() else "it differs from torch's argmax on a probe"
    probes = [x[:m] for m in PROBE_ROWS]
    forms = {KERNEL: lambda: [kernel(p) for p in probes], NUMPY: lambda: [by_numpy(p) for p in probes]}
    # probed whatever the width: its cost is its calls, not the bytes it reads
    return kernel if machine.kernel_kept(CHOICE, KEY, why, forms, machine.MIN_BYTES, other=NUMPY) else by_numpy


_kept: tuple[int, Callable[[torch.Tensor], list[int]]] | None = None  # (machine.generation, the form)


def chosen() -> Callable[[torch.Tensor], list[int]]:
    """The greedy-ids form for float32 CPU logits on this machine: decided once, again after
    :func:`specplug.machine.forget` (as after a change of ``SPECPLUG_CHOICES``)."""
    global _kept
    if _kept is None or _kept[0] != machine.generation:
        _kept = (machine.generation, _decide(machine.overrides().get(CHOICE)))
    return _kept[1]


def cpu_greedy_ids(logits: torch.Tensor, form: Callable[[torch.Tensor], list[int]]) -> list[int]:
    """Each row's argmax of CPU ``logits`` [..., V]: contiguous float32 rows by ``form`` (a :func:`chosen` form; a
    loop looks it up once rather than per call, since after a pass each lookup's code is out of cache), others
    by numpy (bfloat16 widened first: numpy has none, and widening keeps every value and so the argmax)."""
    if logits.dtype == torch.float32 and logits.is_contiguous():
        return form(logits)
    if logits.dtype not in (torch.float32, torch.float64, torch.float16):
        logits = logits.float()
    return by_numpy(logits)
