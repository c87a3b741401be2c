"""bf16 products by specplug's kernel (``kernels/product.c``), for the lean forward's bf16 weights on the CPU: on
Intel AMX tiles, or on AVX-512 BF16 dot products where the CPU has those but no AMX (AMD Zen 4).

Why: over the few rows of a decode step oneDNN's bf16 product took several times what reading its weight does
(on an AMD EPYC with AVX-512 BF16, a one-row product of the zoo's 1536 × 512 weight ~57 µs against ~16 on the
kernel), and on some machines beyond a few dozen rows it sums in another order, so a verify pass ran in pieces,
each reading the weight again (:mod:`specplug.few_rows`). The kernel sums every output element in one fixed
order, so a row's result does not depend on the other rows: any number of rows is one product. That is checked
on the machine before it is used (:mod:`specplug.kernel_products`), with inputs that expose any change of order,
and oneDNN must not be faster on the row counts of steps and verify passes (by the probe's margin; choice
``bf16_products``, listed by :func:`specplug.machine.machine_choices`).

Where the CPU has neither form, the kernel does not build or Linux refuses the tile state (then the AVX-512 form
runs where built), a shape does not tile (out_features % 16, in_features % 32), or
``SPECPLUG_CHOICES=bf16_products=oneDNN`` is set, products run through :func:`specplug.few_rows.linear` as before,
and the reason is recorded.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from . import few_rows, kernel_products, machine, native

SOURCE = "product.c"
CHOICE = "bf16_products"
AMX, DOT, ONEDNN = "AMX kernel", "AVX-512 kernel", "oneDNN"
FORM_AMX, FORM_DOT = 1, 2  # specplug_product_forms' bits
CHECKED_ROWS = (1, 2, 3, 4, 5, 15, 16, 17, 33, 64, 80, 96)  # across tiles, groups and blocks, up to a long verify pass


@dataclass(frozen=True)
class Compiled:
    """The compiled kernel in the form this machine runs: ``form`` (AMX or DOT) and its product ``fn``, with the
    library's ``pack``."""

    form: str
    fn: ctypes._CFuncPtr
    pack: ctypes._CFuncPtr


@functools.lru_cache(maxsize=1)
def load() -> tuple[Compiled | None, str]:
    """The compiled kernel in its best form here (AMX with the tile state granted, else AVX-512 BF16), or None
    and why not."""
    flags = machine.cpu_flags()
    amx = flags is None or {"amx_tile", "amx_bf16"} <= flags
    if flags is not None and not amx and "avx512_bf16" not in flags:
        return None, "this CPU has neither AMX bf16 tiles nor AVX-512 BF16 (amx_bf16, avx512_bf16 among its flags)"
    lib, reason = native.bind(SOURCE, {"specplug_product_forms": ([], ctypes.c_int64),
                                       "specplug_product_init": ([], ctypes.c_int64),
                                       "specplug_product_pack": ([native.I64] * 2 + [native.PTR] * 2, None)})
    if lib is None:
        return None, reason
    product_args = [native.I64] * 3 + [native.PTR] * 5
    forms, why = lib.specplug_product_forms(), ""
    if amx and forms & FORM_AMX:
        if lib.specplug_product_init() == 0:
            lib.specplug_product.argtypes, lib.specplug_product.restype = product_args, None
            return Compiled(AMX, lib.specplug_product, lib.specplug_product_pack), ""
        why = "Linux did not grant this process the AMX tile state (arch_prctl XTILEDATA)"
    if forms & FORM_DOT:
        lib.specplug_product_dot.argtypes, lib.specplug_product_dot.restype = product_args, None
        return Compiled(DOT, lib.specplug_product_dot, lib.specplug_product_pack), ""
    return None, why or "the compiler built neither form of product.c for this CPU (-march=native)"


class Bf16Product:
    """``x @ weight.T + bias`` for float32 rows x through a bf16 weight packed once for the kernel; the result is
    rounded to bf16 (as oneDNN's bf16 product is) and returned as float32."""

    __slots__ = ("kernel", "packed", "bias", "out_features", "in_features")

    def __init__(self, kernel: Compiled, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.kernel, (self.out_features, self.in_features) = kernel, weight.shape
        w = weight.detach().contiguous()
        self.packed = torch.empty_like(w)
        kernel.pack(self.out_features, self.in_features, w.data_ptr(), self.packed.data_ptr())
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        rows = flat.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        if rows:
            scratch = torch.empty((rows + 15) // 16 * 16, self.in_features, dtype=torch.bfloat16)
            self.kernel.fn(rows, self.out_features, self.in_features, flat.data_ptr(), self.packed.data_ptr(),
                           0 if self.bias is None else self.bias.data_ptr(), y.data_ptr(), scratch.data_ptr())
        return y.reshape(*x.shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


def supports(weight: torch.Tensor | None) -> str:
    """"" where the kernel can take this weight, else why not."""
    if weight is None or weight.dim() != 2:
        return "not a 2-d weight"
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return f"the bf16 kernel multiplies bf16 CPU weights, not {weight.dtype} on {weight.device.type}"
    if weight.shape[0] % 16 or weight.shape[1] % 32:
        return f"the bf16 kernel takes out_features % 16 == 0 and in_features % 32 == 0, not {tuple(weight.shape)}"
    return load()[1]


def kind() -> kernel_products.Kernel:
    """The choice's description for the form loaded here (its name is the form's: AMX or AVX-512)."""
    compiled = load()[0]
    form = AMX if compiled is None else compiled.form
    return kernel_products.Kernel(CHOICE, form, ONEDNN, "bf16_rows_same_bits", f"the {form}", torch.bfloat16,
                                  CHECKED_ROWS, (1, 16, 80))  # a step at B = 1 and 16, a verify pass of 16 rows x 5


def choose(weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> Bf16Product | None:
    """The kernel's product for this weight, or None for oneDNN's (:func:`few_rows.linear`, through ``packed``
    where given): decided once per shape and machine, and recorded with the reason."""
    return kernel_products.choose(kind(), weight, bias, supports(weight), lambda w, b: Bf16Product(load()[0], w, b),
                                  lambda x: few_rows.linear(x, weight, bias, packed))
