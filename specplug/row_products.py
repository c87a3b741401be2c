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

A float32 weight that IEEE half or bfloat16 holds exactly (a 16-bit checkpoint loaded in float32, as the zoo is on
a CPU without native bf16 products) is also kept in that 16-bit form, and the kernel reads it there, widening
each element exactly: the same sums, the same bits, half the bytes a step reads (choice
``float32_weight_reads``; a one-row step ran ~2× faster on the zoo's shapes). Used where the machine shows the
16-bit reads give the float32 reads' bits on a probe and they are not slower;
``SPECPLUG_CHOICES=float32_weight_reads=float32`` keeps only the float32 weight. The copy costs 2 bytes a weight
(:meth:`RowProduct.nbytes`).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from . import few_rows, kernel_products, machine, native

SOURCE = "rows_f32.c"
CHOICE = "float32_products"
KERNEL, TORCH = "rows kernel", "torch"
READS = "float32_weight_reads"
SIXTEEN, FLOAT32 = "16-bit", "float32"
CHECKED_ROWS = (1, 2, 3, 5, 6, 7, 11, 12, 13, 16, 17, 33, 64, 80)  # across the kernel's blocks of 6 rows


@functools.lru_cache(maxsize=1)
def load() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel, or None and why not."""
    i64, ptr = native.I64, native.PTR
    return native.bind(SOURCE, {"specplug_rows_f32": ([i64, i64, i64, ptr, ptr, ptr, ptr], None),
                                "specplug_rows_f32_from16": ([i64, i64, i64, ptr, ptr, ptr, ptr, i64], None)})


class RowProduct:
    """``x @ weight.T + bias`` for float32 rows x through the kernel; the weight is the model's own, read where
    given from ``narrow``, the same weight in 16 bits (:func:`exact_16bit`)."""

    __slots__ = ("lib", "weight", "bias", "out_features", "in_features", "narrow")

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 narrow: torch.Tensor | None = None):
        self.lib, (self.out_features, self.in_features) = lib, weight.shape
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.narrow = narrow

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        y = torch.empty(flat.shape[0], self.out_features, dtype=torch.float32)
        rows, bias = flat.shape[0], 0 if self.bias is None else self.bias.data_ptr()
        if rows and self.narrow is None:
            self.lib.specplug_rows_f32(rows, self.out_features, self.in_features, flat.data_ptr(),
                                       self.weight.data_ptr(), bias, y.data_ptr())
        elif rows:
            self.lib.specplug_rows_f32_from16(rows, self.out_features, self.in_features, flat.data_ptr(),
                                              self.narrow.data_ptr(), bias, y.data_ptr(),
                                              self.narrow.dtype == torch.bfloat16)
        return y.reshape(*x.shape[:-1], self.out_features)

    def nbytes(self) -> int:
        """Bytes it keeps beyond the model's weight: its 16-bit copy, if any."""
        return 0 if self.narrow is None else self.narrow.numel() * self.narrow.element_size()


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
    product = kernel_products.choose(KIND, weight, bias, supports(weight), lambda w, b: RowProduct(load()[0], w, b),
                                     lambda x: few_rows.linear(x, weight, bias))
    return product if product is None else _reading_16_bits(product)


def exact_16bit(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight as IEEE half, else as bfloat16, where that dtype holds every element exactly; else None."""
    for dtype in (torch.float16, torch.bfloat16):
        narrow = weight.detach().to(dtype).contiguous()
        if torch.equal(narrow.float(), weight):
            return narrow
    return None


def _reading_16_bits(product: RowProduct) -> RowProduct:
    """``product`` reading its weight's exact 16-bit copy where the machine shows that gives the float32 reads'
    bits and is not slower (decided once per shape and 16-bit dtype, and recorded); else as it was."""
    narrow = exact_16bit(product.weight)
    if narrow is None:
        return product  # nothing to choose: a weight trained or kept in float32
    dtype = str(narrow.dtype).removeprefix("torch.")
    where = f"{dtype} {product.out_features}x{product.in_features} cpu"
    w, x, b = few_rows.sensitive_inputs(product.out_features, product.in_features, torch.float32, "cpu",
                                        product.bias is not None)
    w = w.to(narrow.dtype).float()
    full, read16 = RowProduct(product.lib, w, b), RowProduct(product.lib, w, b, w.to(narrow.dtype))
    same = machine.remembered(f"{READS}_same_bits", where,
                              lambda: "yes" if all(torch.equal(full(x[:m]), read16(x[:m])) for m in (1, 5, 16))
                              else "no",
                              lambda v: "16-bit reads give the float32 reads' bits" if v == "yes"
                              else "16-bit reads differ from float32 reads: not used")
    if same != "yes":
        machine.record(READS, where, FLOAT32, "16-bit reads differ from the float32 reads' bits here", "probe")
        return product
    fast = RowProduct(product.lib, product.weight, product.bias, narrow)
    probe = torch.randn(max(KIND.step_rows), product.in_features, generator=torch.Generator().manual_seed(0))
    steps = [probe[:m] for m in KIND.step_rows]
    forms = {SIXTEEN: lambda: [fast(p) for p in steps], FLOAT32: lambda: [product(p) for p in steps]}
    # 16-bit reads by default: half the bytes for the same bits, so they win ties
    chosen = machine.faster(READS, where, forms, SIXTEEN, product.weight.numel() * product.weight.element_size())
    return fast if chosen == SIXTEEN else product
