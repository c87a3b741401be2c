"""float32 products in one fixed summation order (``kernels/rows_f32.c``), for the lean forward's float32 weights on
the CPU.

Why: where torch's float32 products give a row of a many-row product its one-row bits only up to a few rows
(:func:`specplug.few_rows.identical_rows`; 3 on an AVX2-only EPYC), a verify pass or a batched step runs in
pieces of that many rows, each reading the whole weight again, and a 5-token verify pass cost 1.8 one-token
steps. The kernel sums every output element in one order whatever the row count, so any number of rows is one
product, one read of the weight. That is checked on the machine before it is used, with inputs that expose any
change of order, and the few_rows path must not be faster on the row counts of steps and verify passes (by the
probe's margin; choice ``float32_products``, listed by :func:`specplug.machine.machine_choices`). Without a
compiler, where the check fails, or with ``SPECPLUG_CHOICES=float32_products=torch``, products run through
:func:`specplug.few_rows.linear` as before, and the reason is recorded.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from . import few_rows, kernel_products, native

SOURCE = "rows_f32.c"
CHOICE = "float32_products"
KERNEL, TORCH = "rows kernel", "torch"
CHECKED_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 80)  # across the kernel's blocks of 3 rows


@functools.lru_cache(maxsize=1)
def load() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel, or None and why not."""
    i64, ptr = native.I64, native.PTR
    return native.bind(SOURCE, {"specplug_rows_f32": ([i64, i64, i64, ptr, ptr, ptr, ptr], None)})


class RowProduct:
    """``x @ weight.T + bias`` for float32 rows x through the kernel; the weight is the model's own (no copy)."""

    __slots__ = ("lib", "weight", "bias", "out_features", "in_features")

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.lib, (self.out_features, self.in_features) = lib, weight.shape
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        y = torch.empty(flat.shape[0], self.out_features, dtype=torch.float32)
        if flat.shape[0]:
            self.lib.specplug_rows_f32(flat.shape[0], self.out_features, self.in_features, flat.data_ptr(),
                                       self.weight.data_ptr(), 0 if self.bias is None else self.bias.data_ptr(),
                                       y.data_ptr())
        return y.reshape(*x.shape[:-1], self.out_features)

    def nbytes(self) -> int:
        """Bytes it keeps beyond the model's weight: none."""
        return 0


def supports(weight: torch.Tensor | None) -> str:
    """"" where the kernel can take this weight, else why not."""
    if weight is None or weight.dim() != 2:
        return "not a 2-d weight"
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return f"the rows kernel multiplies float32 CPU weights, not {weight.dtype} on {weight.device.type}"
    return load()[1]


KIND = kernel_products.Kernel(CHOICE, KERNEL, TORCH, "kernel_rows_same_bits", "the rows kernel",
                              torch.float32, CHECKED_ROWS, (1, 5, 16, 80))  # steps at B = 1 and 16, verify passes


def choose(weight: torch.Tensor, bias: torch.Tensor | None = None) -> RowProduct | None:
    """The kernel's product for this float32 CPU weight, or None for few_rows' (:func:`few_rows.linear`):
    decided once per shape and machine, and recorded with the reason."""
    return kernel_products.choose(KIND, weight, bias, supports(weight), lambda w, b: RowProduct(load()[0], w, b),
                                  lambda x: few_rows.linear(x, weight, bias))
