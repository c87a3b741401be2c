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

from . import few_rows, machine, native

SOURCE = "rows_f32.c"
CHOICE = "float32_products"
KERNEL, TORCH = "rows kernel", "torch"
CHECKED_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 80)  # across the kernel's blocks of 4 rows


@functools.lru_cache(maxsize=1)
def load() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel, or None and why not."""
    lib, reason = native.build(SOURCE)
    if lib is None:
        return None, reason
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.specplug_rows_f32.argtypes = [i64, i64, i64, ptr, ptr, ptr, ptr]
    lib.specplug_rows_f32.restype = None
    return lib, ""


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


def rows_match_one_row_products(product: RowProduct, x: torch.Tensor) -> bool:
    """Whether every row of products over CHECKED_ROWS rows of x equals that row's one-row product, bit for bit."""
    with torch.inference_mode():
        one = torch.cat([product(x[i:i + 1]) for i in range(max(CHECKED_ROWS))])
        return all(torch.equal(product(x[:m]), one[:m]) for m in CHECKED_ROWS)


def choose(weight: torch.Tensor, bias: torch.Tensor | None = None) -> RowProduct | None:
    """The kernel's product for this float32 CPU weight, or None for few_rows' (:func:`few_rows.linear`):
    decided once per shape and machine, and recorded with the reason."""
    out_features, in_features = (0, 0) if weight is None or weight.dim() != 2 else weight.shape
    where = f"float32 {out_features}x{in_features}{' +bias' if bias is not None else ''} cpu"
    pinned = machine.overrides().get(CHOICE)
    reason = supports(weight)
    if reason:
        if pinned == KERNEL:
            raise ValueError(f"{machine.OVERRIDE_ENV}: {CHOICE}={KERNEL} is pinned, but {reason}")
        if weight is not None and weight.dtype == torch.float32 and weight.device.type == "cpu":
            machine.record(CHOICE, where, TORCH, reason, "default")
        return None
    if pinned == TORCH:
        machine.record(CHOICE, where, TORCH, machine.OVERRIDE_ENV, "override")
        return None
    lib = load()[0]
    w, x, b = few_rows.sensitive_inputs(out_features, in_features, torch.float32, "cpu", bias is not None)
    x = torch.cat([x, x.flip(0)])[:max(CHECKED_ROWS)]
    invariant = machine.remembered("kernel_rows_same_bits", where,
                                   lambda: "yes" if rows_match_one_row_products(RowProduct(lib, w, b), x) else "no",
                                   lambda v: "every row equals its one-row product" if v == "yes"
                                   else "rows differ from one-row products: not used")
    if invariant != "yes":
        if pinned == KERNEL:
            raise ValueError(f"{machine.OVERRIDE_ENV}: {CHOICE}={KERNEL} is pinned, but its rows differ from "
                             "one-row products on this machine")
        machine.record(CHOICE, where, TORCH, "the rows kernel's rows differ from one-row products here", "probe")
        return None
    kernel = RowProduct(lib, weight, bias)
    probe = torch.randn(80, in_features, generator=torch.Generator().manual_seed(0))
    steps = [probe[:1], probe[:5], probe[:16], probe[:80]]  # a step at B = 1 and 16, verify passes of 1 and 16 rows
    forms = {KERNEL: lambda: [kernel(p) for p in steps],
             TORCH: lambda: [few_rows.linear(p, weight, bias) for p in steps]}
    # the kernel by default: any number of rows is one product (no pieces), so it wins ties
    chosen = machine.faster(CHOICE, where, forms, KERNEL, weight.numel() * weight.element_size())
    return kernel if chosen == KERNEL else None
