"""bf16 products on Intel AMX tiles (``kernels/product.c``), for the lean forward's bf16 weights on the CPU.

Why: over the few rows of a decode step oneDNN's bf16 product took several times what reading its weight does
here, and beyond a few dozen rows it sums in another order, so a verify pass of many rows ran in pieces, each
reading the weight again (:mod:`specplug.few_rows`). The kernel sums every output element in one fixed order
(tiles of K in sequence, from zero), so a row's result does not depend on the other rows: any number of rows is
one product. That is checked on the machine before it is used (:mod:`specplug.kernel_products`), with
inputs that expose any change of order, and oneDNN must not be faster on the row counts of steps and verify
passes (by the probe's margin; choice ``bf16_products``, listed by :func:`specplug.machine.machine_choices`).

Where the CPU has no AMX, the kernel does not build or Linux refuses the tile state, a shape does not tile
(out_features % 16, in_features % 32), or ``SPECPLUG_CHOICES=bf16_products=oneDNN`` is set, products run through
:func:`specplug.few_rows.linear` as before, and the reason is recorded.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from . import few_rows, kernel_products, machine, native

SOURCE = "product.c"
CHOICE = "bf16_products"
AMX, ONEDNN = "AMX kernel", "oneDNN"
CHECKED_ROWS = (1, 2, 3, 15, 16, 17, 33, 64, 80, 96)  # across tile and group boundaries, up to a long verify pass


@functools.lru_cache(maxsize=1)
def load() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel with the tile state granted, or None and why not."""
    flags = machine.cpu_flags()
    if flags is not None and not {"amx_tile", "amx_bf16"} <= flags:
        return None, "this CPU has no AMX bf16 tiles (no amx_tile and amx_bf16 among its flags)"
    lib, reason = native.build(SOURCE)
    if lib is None:
        return None, reason
    lib.specplug_product_init.restype = ctypes.c_int64
    if lib.specplug_product_init() != 0:
        return None, "Linux did not grant this process the AMX tile state (arch_prctl XTILEDATA)"
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.specplug_product_pack.argtypes = [i64, i64, ptr, ptr]
    lib.specplug_product_pack.restype = None
    lib.specplug_product.argtypes = [i64, i64, i64, ptr, ptr, ptr, ptr, ptr]
    lib.specplug_product.restype = None
    return lib, ""


class TileProduct:
    """``x @ weight.T + bias`` for float32 rows x through a bf16 weight packed once into AMX tiles; the result
    is rounded to bf16 (as oneDNN's bf16 product is) and returned as float32."""

    __slots__ = ("lib", "packed", "bias", "out_features", "in_features")

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.lib, (self.out_features, self.in_features) = lib, weight.shape
        w = weight.detach().contiguous()
        self.packed = torch.empty_like(w)
        lib.specplug_product_pack(self.out_features, self.in_features, w.data_ptr(), self.packed.data_ptr())
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        rows = flat.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        if rows:
            scratch = torch.empty((rows + 15) // 16 * 16, self.in_features, dtype=torch.bfloat16)
            self.lib.specplug_product(rows, self.out_features, self.in_features, flat.data_ptr(),
                                      self.packed.data_ptr(), 0 if self.bias is None else self.bias.data_ptr(),
                                      y.data_ptr(), scratch.data_ptr())
        return y.reshape(*x.shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


def supports(weight: torch.Tensor | None) -> str:
    """"" where the kernel can take this weight, else why not."""
    if weight is None or weight.dim() != 2:
        return "not a 2-d weight"
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return f"the AMX kernel multiplies bf16 CPU weights, not {weight.dtype} on {weight.device.type}"
    if weight.shape[0] % 16 or weight.shape[1] % 32:
        return f"the AMX kernel tiles out_features % 16 == 0 and in_features % 32 == 0, not {tuple(weight.shape)}"
    return load()[1]


KIND = kernel_products.Kernel(CHOICE, AMX, ONEDNN, "tile_rows_same_bits", "the AMX kernel", torch.bfloat16,
                              CHECKED_ROWS, (1, 16, 80))  # a step at B = 1 and 16, a verify pass of 16 rows x 5


def choose(weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> TileProduct | None:
    """The AMX product for this weight, or None for oneDNN's (:func:`few_rows.linear`, through ``packed`` where
    given): decided once per shape and machine, and recorded with the reason."""
    return kernel_products.choose(KIND, weight, bias, supports(weight), lambda w, b: TileProduct(load()[0], w, b),
                                  lambda x: few_rows.linear(x, weight, bias, packed))
